// The fault lists on the GPU against the CPU reference, bit for bit: more leaves than a counting
// launch describes, leaves across and within ranges, empty ones, densities from none to all,
// lists shorter and longer than the non-zero entries, poisoned outputs.
#include <gtest/gtest.h>

#include <memory>
#include <random>
#include <string>
#include <vector>

#include "cuda_test_util.h"
#include "summary/fault_list.h"
#include "test_util.h"

namespace pimhbm::summary {
namespace {

using testing::DeviceBuffer;

struct Lists {
  std::vector<int32_t> index, value;
  std::vector<uint64_t> totals;
};

std::vector<std::vector<int32_t>> random_maps(std::mt19937_64& rng, int leaves, int64_t largest,
                                              double density) {
  std::vector<std::vector<int32_t>> maps(leaves);
  for (auto& m : maps) {
    m.resize(rng() % 4 == 0 ? 0 : rng() % (largest + 1));
    for (auto& v : m) {
      v = std::uniform_real_distribution<>(0, 1)(rng) < density ? 1 + rng() % 0xFFFF : 0;
    }
  }
  return maps;
}

Lists on_cpu(const std::vector<std::vector<int32_t>>& maps, int64_t capacity) {
  std::vector<MapView> views;
  for (const auto& m : maps) views.push_back(MapView{m.data(), static_cast<int64_t>(m.size())});
  Lists out{std::vector<int32_t>(capacity), std::vector<int32_t>(capacity),
            std::vector<uint64_t>(kListTotals)};
  fault_list_cpu(views.data(), views.size(),
                 ListOut{out.index.data(), out.value.data(), capacity, out.totals.data()});
  return out;
}

void on_gpu(const std::vector<std::vector<int32_t>>& maps, int64_t capacity, Lists* out) {
  std::vector<std::unique_ptr<DeviceBuffer<int32_t>>> buffers;
  std::vector<MapView> views;
  for (const auto& m : maps) {
    buffers.push_back(std::make_unique<DeviceBuffer<int32_t>>(m.size()));
    PIMHBM_ASSERT_CUDA(buffers.back()->upload(m));
    views.push_back(MapView{buffers.back()->get(), static_cast<int64_t>(m.size())});
  }
  DeviceBuffer<Range> scratch(range_count(views.data(), views.size()));
  DeviceBuffer<int32_t> index(capacity), value(capacity);
  DeviceBuffer<uint64_t> totals(kListTotals);
  PIMHBM_ASSERT_CUDA(scratch.poison());
  PIMHBM_ASSERT_CUDA(index.poison());
  PIMHBM_ASSERT_CUDA(value.poison());
  PIMHBM_ASSERT_CUDA(totals.poison());
  PIMHBM_ASSERT_CUDA(fault_list_cuda(views.data(), views.size(), scratch.get(),
                                     ListOut{index.get(), value.get(), capacity, totals.get()},
                                     nullptr));
  PIMHBM_ASSERT_CUDA(cudaDeviceSynchronize());
  PIMHBM_ASSERT_DOWNLOAD(out->index, index);
  PIMHBM_ASSERT_DOWNLOAD(out->value, value);
  PIMHBM_ASSERT_DOWNLOAD(out->totals, totals);
}

void expect_same(const Lists& want, const Lists& got, const std::string& what) {
  ASSERT_EQ(want.index, got.index) << what;
  ASSERT_EQ(want.value, got.value) << what;
  ASSERT_EQ(want.totals, got.totals) << what;
}

TEST(FaultListCuda, IsTheCpuReferenceBitForBit) {
  PIMHBM_SKIP_WITHOUT_GPU();
  auto rng = testing::rng_for_test();
  const int64_t largest = testing::small_sizes() ? 3 * kRangeEntries : 40 * kRangeEntries;
  for (int leaves : {0, 1, 3, 40, 300, 700}) {
    for (double density : {0.0, 1e-5, 1e-3, 0.2, 1.0}) {
      // Many leaves: most of them small, so that several counting launches stay quick.
      const auto maps = random_maps(rng, leaves, leaves > 40 ? 3000 : largest, density);
      for (int64_t capacity : {0, 1, 16, 64, 3000}) {
        Lists got;
        on_gpu(maps, capacity, &got);
        expect_same(on_cpu(maps, capacity), got,
                    std::to_string(leaves) + " leaves, density " + std::to_string(density) +
                        ", capacity " + std::to_string(capacity));
      }
    }
  }
}

TEST(FaultListCuda, FindsOneEntryAnywhereInALongMap) {
  PIMHBM_SKIP_WITHOUT_GPU();
  auto rng = testing::rng_for_test();
  std::vector<std::vector<int32_t>> maps = {std::vector<int32_t>(5 * kRangeEntries + 17, 0),
                                            std::vector<int32_t>(3, 0)};
  for (int trial = 0; trial < 20; ++trial) {
    auto& m = maps[rng() % 2];
    const size_t at = rng() % m.size();
    m[at] = 7;
    Lists got;
    on_gpu(maps, 4, &got);
    expect_same(on_cpu(maps, 4), got, "trial " + std::to_string(trial));
    ASSERT_EQ(got.totals[0], 1u);
    m[at] = 0;
  }
}

}  // namespace
}  // namespace pimhbm::summary
