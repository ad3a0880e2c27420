// The launch variants of the guarded update (adamw_variants.cuh) against the CPU reference and
// against the library's own kernel, bit for bit: every parameter kind, ragged sizes and chunk
// sizes, damaged state and non-finite gradients, with and without the device copy.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "adamw_device_leaf.h"
#include "adamw_variants.cuh"
#include "cuda_test_util.h"
#include "test_util.h"
#include "update/adamw.h"

namespace pimhbm::bench {
namespace {

using ::pimhbm::testing::rng_for_test;
using update::AdamWLeaf;
using update::testing::HostCopy;
using update::testing::HostLeaf;
using update::testing::kHyper;
using update::testing::kStep;

// Every variant without the device copy: one and two groups in flight, L2 prefetch, the
// shared-memory pipeline, 4 blocks per SM, plain loads.
const AdamWVariant kNoCopyVariants[] = {
    AdamWVariant{1},
    AdamWVariant{2},
    AdamWVariant{1, CopyPass::kDefault, 2},
    AdamWVariant{1, CopyPass::kDefault, 4},
    AdamWVariant{1, CopyPass::kDefault, 0, 2},
    AdamWVariant{1, CopyPass::kDefault, 0, 3},
    AdamWVariant{1, CopyPass::kDefault, 0, 4},
    AdamWVariant{1, CopyPass::kDefault, 0, 0, 4},
    AdamWVariant{1, CopyPass::kDefault, 0, 0, 0, true},
};

// Every pass of the device copy (plain loads: not with the copy).
const AdamWVariant kCopyVariants[] = {
    AdamWVariant{1, CopyPass::kRegisters}, AdamWVariant{1, CopyPass::kTwoReads},
    AdamWVariant{2, CopyPass::kTwoReads},  AdamWVariant{1, CopyPass::kTwoReadsKeep},
    AdamWVariant{0, CopyPass::kDefault},   AdamWVariant{0, CopyPass::kDefault, 0, 0, 0, true},
};

auto variant_update(const AdamWVariant& v) {
  return [v](const AdamWLeaf& leaf, const float* step) {
    return adamw_variant(leaf, kHyper, step, nullptr, v);
  };
}

cudaError_t library_update(const AdamWLeaf& leaf, const float* step) {
  return update::adamw_cuda(leaf, kHyper, step, nullptr);
}

class AdamWVariants : public ::testing::TestWithParam<std::tuple<bool, bool>> {};

TEST_P(AdamWVariants, MatchTheCpuReferenceAndTheLibraryBitForBit) {
  PIMHBM_SKIP_WITHOUT_GPU();
  PIMHBM_SEED_TRACE();
  auto rng = rng_for_test();
  const auto [bf16, master] = GetParam();
  update::testing::for_each_update_case(
      rng, bf16, master,
      [&](const HostLeaf& input, const HostLeaf& cpu, bool damaged, const std::string& what) {
        HostLeaf library = input;
        update::testing::run_gpu(library, kStep, library_update);
        for (const AdamWVariant& v : kNoCopyVariants) {
          HostLeaf gpu = input;
          update::testing::run_gpu(gpu, kStep, variant_update(v));
          update::testing::expect_matches_cpu(gpu, cpu, damaged, what + ", " + describe(v));
          // The same GPU arithmetic as the library's: the same bits, NaN patterns included.
          update::testing::expect_same_bits(gpu, library, what + ", " + describe(v));
        }
      });
}

TEST_P(AdamWVariants, DeviceCopyMatchesTheCpuReferenceAndTheLibrary) {
  PIMHBM_SKIP_WITHOUT_GPU();
  PIMHBM_SEED_TRACE();
  auto rng = rng_for_test();
  const auto [bf16, master] = GetParam();
  update::testing::for_each_copy_case(
      rng, bf16, master,
      [&](const HostLeaf& input, const HostLeaf& cpu, const HostCopy& cpu_copy,
          const std::string& what) {
        HostLeaf library = input;
        HostCopy library_copy(library);
        update::testing::run_gpu(library, kStep, library_update, &library_copy);
        for (const AdamWVariant& v : kCopyVariants) {
          HostLeaf gpu = input;
          HostCopy out(gpu);
          update::testing::run_gpu(gpu, kStep, variant_update(v), &out);
          const std::string where = what + ", " + describe(v);
          update::testing::expect_copy_matches_cpu(gpu, out, cpu, cpu_copy, where);
          update::testing::expect_same_copy(out, library_copy, where);
        }
      });
}

INSTANTIATE_TEST_SUITE_P(ParamKinds, AdamWVariants, update::testing::param_kinds(),
                         update::testing::param_kind_name);

// A tree's leaves in one call through the shared-memory pipeline (3 stages): kinds mixed,
// more leaves than one launch's table holds, empty, ragged and damaged leaves.
TEST(AdamWVariantsTree, EveryLeafOfOneCallMatchesTheCpuReference) {
  PIMHBM_SKIP_WITHOUT_GPU();
  PIMHBM_SEED_TRACE();
  auto rng = rng_for_test();
  const int64_t chunk = 16 * (1 + static_cast<int64_t>(rng() % 300));
  std::vector<HostLeaf> cpu = update::testing::tree_leaves(rng, chunk);
  const AdamWVariant staged{0, CopyPass::kDefault, 0, 3};
  update::testing::expect_tree_matches_cpu(
      cpu, false,
      [&](const AdamWLeaf* leaves, size_t count, const float* step) {
        return adamw_variant(leaves, count, kHyper, step, nullptr, staged);
      },
      describe(staged));
}

// Options out of range are refused before anything runs (no GPU needed).
TEST(AdamWVariantsPlan, RefusesOptionsOutOfRange) {
  AdamWLeaf leaf;
  for (const AdamWVariant bad :
       {AdamWVariant{3}, AdamWVariant{-1}, AdamWVariant{1, CopyPass::kDefault, 3},
        AdamWVariant{1, CopyPass::kDefault, 0, 1}, AdamWVariant{1, CopyPass::kDefault, 0, 5},
        AdamWVariant{1, CopyPass::kDefault, 0, 0, 2},
        AdamWVariant{1, CopyPass::kDefault, 0, 0, 5}}) {
    EXPECT_EQ(adamw_variant(&leaf, 1, kHyper, nullptr, nullptr, bad), cudaErrorInvalidValue)
        << bad.groups_in_flight << " " << bad.prefetch << " " << bad.stages << " "
        << bad.min_blocks;
  }
}

}  // namespace
}  // namespace pimhbm::bench
