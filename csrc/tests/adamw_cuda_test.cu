// The fused CUDA update against the CPU reference, bit for bit: every parameter kind, ragged
// sizes and chunk sizes, damaged state and non-finite gradients, with and without the device
// copy; and the predicated restore. (The launch variants that lost to the library's kernel are
// tested the same way in bench/adamw_variants_test.cu.)
#include <gtest/gtest.h>

#include <memory>
#include <vector>

#include "adamw_device_leaf.h"
#include "cuda_test_util.h"
#include "test_util.h"
#include "update/adamw.h"
#include "update/restore.h"

namespace pimhbm::update {
namespace {

using ::pimhbm::testing::DeviceBuffer;
using ::pimhbm::testing::rng_for_test;
using testing::HostCopy;
using testing::HostLeaf;
using testing::kHyper;

cudaError_t library_update(const AdamWLeaf& leaf, const float* step) {
  return adamw_cuda(leaf, kHyper, step, nullptr);
}

class AdamWCuda : public ::testing::TestWithParam<std::tuple<bool, bool>> {};

TEST_P(AdamWCuda, MatchesTheCpuReferenceBitForBit) {
  PIMHBM_SKIP_WITHOUT_GPU();
  PIMHBM_SEED_TRACE();
  auto rng = rng_for_test();
  const auto [bf16, master] = GetParam();
  testing::for_each_update_case(
      rng, bf16, master,
      [&](const HostLeaf& input, const HostLeaf& cpu, bool damaged, const std::string& what) {
        HostLeaf gpu = input;
        testing::run_gpu(gpu, testing::kStep, library_update);
        testing::expect_matches_cpu(gpu, cpu, damaged, what);
      });
}

TEST_P(AdamWCuda, DeviceCopyMatchesTheCpuReference) {
  PIMHBM_SKIP_WITHOUT_GPU();
  PIMHBM_SEED_TRACE();
  auto rng = rng_for_test();
  const auto [bf16, master] = GetParam();
  testing::for_each_copy_case(rng, bf16, master,
                              [&](const HostLeaf& input, const HostLeaf& cpu,
                                  const HostCopy& cpu_copy, const std::string& what) {
                                HostLeaf gpu = input;
                                HostCopy out(gpu);
                                testing::run_gpu(gpu, testing::kStep, library_update, &out);
                                testing::expect_copy_matches_cpu(gpu, out, cpu, cpu_copy, what);
                              });
}

// eps 0 where both moments are 0 (every new value 0 / 0) on a random part of ragged leaves,
// and one overflowing gradient: the GPU counts exactly the CPU reference's elements -- not the
// lanes past a leaf's end, which the kernel fills with zeros (0 / 0 with eps 0 too).
TEST_P(AdamWCuda, CountsNewValuesThatAreNotFiniteAsTheCpuDoes) {
  PIMHBM_SKIP_WITHOUT_GPU();
  PIMHBM_SEED_TRACE();
  auto rng = rng_for_test();
  const auto [bf16, master] = GetParam();
  AdamWHyper eps0 = kHyper;
  eps0.eps = 0.0f;
  const auto update_eps0 = [&](const AdamWLeaf& leaf, const float* step) {
    return adamw_cuda(leaf, eps0, step, nullptr);
  };
  for (int64_t n :
       {int64_t{1}, int64_t{3}, int64_t{17}, int64_t{1001}, int64_t{16385}, int64_t{100003}}) {
    for (int64_t chunk :
         {int64_t{16}, int64_t{1024}, 16 * (1 + static_cast<int64_t>(rng() % 300))}) {
      HostLeaf cpu(rng, n, chunk, bf16, master);
      for (int64_t i = 0; i < n; ++i) {
        if (rng() % 3 != 0) continue;
        cpu.set(cpu.g, i, 0.0f);
        cpu.mu[i] = cpu.nu[i] = 0.0f;
      }
      cpu.set(cpu.g, static_cast<int64_t>(rng() % n), 1e30f);
      cpu.d_mu = HostLeaf::table_of(cpu.mu.data(), n, 4, chunk);
      cpu.d_nu = HostLeaf::table_of(cpu.nu.data(), n, 4, chunk);
      HostLeaf gpu = cpu;
      adamw_cpu(cpu.view(), eps0, testing::kStep);
      testing::run_gpu(gpu, testing::kStep, update_eps0);
      const std::string what = "n " + std::to_string(n) + " chunk " + std::to_string(chunk);
      EXPECT_GT(cpu.totals[1], 0u) << what;
      testing::expect_matches_cpu(gpu, cpu, /*damaged=*/true, what);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(ParamKinds, AdamWCuda, testing::param_kinds(), testing::param_kind_name);

// A tree's leaves in one call: kinds mixed (each kind its own launch, in the order given),
// more leaves than one launch's table holds, empty and ragged leaves, damaged ones; with and
// without the device copy. Every leaf must equal its own CPU run.
TEST(AdamWCudaTree, EveryLeafOfOneCallMatchesTheCpuReference) {
  PIMHBM_SKIP_WITHOUT_GPU();
  PIMHBM_SEED_TRACE();
  auto rng = rng_for_test();
  for (const bool with_copy : {false, true}) {
    const int64_t chunk = with_copy ? 1024 : 16 * (1 + static_cast<int64_t>(rng() % 300));
    std::vector<HostLeaf> cpu = testing::tree_leaves(rng, chunk);
    testing::expect_tree_matches_cpu(
        cpu, with_copy,
        [](const AdamWLeaf* leaves, size_t count, const float* step) {
          return adamw_cuda(leaves, count, kHyper, step, nullptr);
        },
        "device copy " + std::to_string(with_copy));
  }
}

TEST(AdamWLaunchPlan, RegisterLayoutsCoverChunksUpTo4096Elements) {
  EXPECT_EQ(resident_groups(16), 1);
  EXPECT_EQ(resident_groups(1024), 1);
  EXPECT_EQ(resident_groups(1040), 2);
  EXPECT_EQ(resident_groups(2048), 2);
  EXPECT_EQ(resident_groups(2064), 4);
  EXPECT_EQ(resident_groups(4096), 4);
  EXPECT_EQ(resident_groups(4112), 0);
  EXPECT_EQ(resident_groups(16384), 0);
}

TEST(RestoreCuda, CopiesOnlyWhenTheStepDoesNotCommit) {
  PIMHBM_SKIP_WITHOUT_GPU();
  PIMHBM_SEED_TRACE();
  auto rng = rng_for_test();
  // More pairs than one launch takes, ragged and odd sizes.
  std::vector<std::vector<uint8_t>> src, dst;
  for (int k = 0; k < 70; ++k) {
    const size_t n = rng() % 5000;
    src.push_back(::pimhbm::testing::random_bytes(rng, n));
    dst.push_back(::pimhbm::testing::random_bytes(rng, n));
  }
  for (int32_t commit : {1, 0}) {
    std::vector<std::unique_ptr<DeviceBuffer<uint8_t>>> ds, dd;
    std::vector<CopyPair> pairs;
    for (size_t k = 0; k < src.size(); ++k) {
      ds.push_back(std::make_unique<DeviceBuffer<uint8_t>>(src[k].size()));
      dd.push_back(std::make_unique<DeviceBuffer<uint8_t>>(dst[k].size()));
      PIMHBM_ASSERT_CUDA(ds.back()->upload(src[k]));
      PIMHBM_ASSERT_CUDA(dd.back()->upload(dst[k]));
      pairs.push_back({ds.back()->get(), dd.back()->get(), static_cast<int64_t>(src[k].size())});
    }
    std::vector<int32_t> flag_host = {commit};
    DeviceBuffer<int32_t> flag(1);
    PIMHBM_ASSERT_CUDA(flag.upload(flag_host));
    PIMHBM_ASSERT_CUDA(restore_cuda(flag.get(), pairs, nullptr));
    PIMHBM_ASSERT_CUDA(cudaDeviceSynchronize());
    for (size_t k = 0; k < src.size(); ++k) {
      cudaError_t err;
      const auto got = dd[k]->download(&err);
      PIMHBM_ASSERT_CUDA(err);
      ASSERT_EQ(got, commit ? dst[k] : src[k]) << "pair " << k << " commit " << commit;
    }
  }
}

}  // namespace
}  // namespace pimhbm::update
