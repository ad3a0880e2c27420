// The fault lists' CPU reference (summary/fault_list.h) against the lists written out by hand
// from the concatenated maps: ragged leaves, empty ones, a list shorter and longer than the
// non-zero entries, poisoned outputs.
#include "summary/fault_list.h"

#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "test_util.h"

namespace pimhbm::summary {
namespace {

struct Lists {
  std::vector<int32_t> index, value;
  uint64_t totals[kListTotals];
};

Lists run_cpu(const std::vector<std::vector<int32_t>>& maps, int64_t capacity) {
  std::vector<MapView> views;
  for (const auto& m : maps) views.push_back(MapView{m.data(), static_cast<int64_t>(m.size())});
  Lists out{std::vector<int32_t>(capacity, 0x5A5A5A5A),
            std::vector<int32_t>(capacity, 0x5A5A5A5A),
            {~0ull, ~0ull}};
  fault_list_cpu(views.data(), views.size(),
                 ListOut{out.index.data(), out.value.data(), capacity, out.totals});
  return out;
}

TEST(FaultList, IsTheFirstNonZeroEntriesOfTheConcatenation) {
  auto rng = testing::rng_for_test();
  for (int trial = 0; trial < 60; ++trial) {
    const int leaves = static_cast<int>(rng() % 9);
    const double density = std::vector<double>{0.0, 1e-3, 0.05, 0.5, 1.0}[trial % 5];
    std::vector<std::vector<int32_t>> maps(leaves);
    std::vector<int32_t> flat;
    for (auto& m : maps) {
      m.resize(rng() % 3 == 0 ? 0 : rng() % 20000);
      for (auto& v : m) {
        v = std::uniform_real_distribution<>(0, 1)(rng) < density ? 1 + rng() % (1 << 20) : 0;
      }
      flat.insert(flat.end(), m.begin(), m.end());
    }
    std::vector<int32_t> want_index, want_value;
    uint64_t nonzero = 0, sum = 0;
    for (size_t e = 0; e < flat.size(); ++e) {
      if (flat[e] == 0) continue;
      ++nonzero, sum += flat[e];
      want_index.push_back(static_cast<int32_t>(e));
      want_value.push_back(flat[e]);
    }
    for (int64_t capacity : {0, 1, 7, 64, 5000}) {
      const Lists got = run_cpu(maps, capacity);
      for (int64_t j = 0; j < capacity; ++j) {
        const bool listed = j < static_cast<int64_t>(want_index.size());
        ASSERT_EQ(got.index[j], listed ? want_index[j] : -1) << "trial " << trial << " j " << j;
        ASSERT_EQ(got.value[j], listed ? want_value[j] : 0) << "trial " << trial << " j " << j;
      }
      EXPECT_EQ(got.totals[0], nonzero);
      EXPECT_EQ(got.totals[1], sum);
    }
  }
}

TEST(FaultList, CountsTheScratchRowsOfEveryLeaf) {
  const std::vector<int32_t> a(kRangeEntries), b(kRangeEntries + 1), c(1);
  const MapView maps[] = {{a.data(), static_cast<int64_t>(a.size())},
                          {nullptr, 0},
                          {b.data(), static_cast<int64_t>(b.size())},
                          {c.data(), 1}};
  EXPECT_EQ(range_count(maps, 4), 1 + 0 + 2 + 1);
}

}  // namespace
}  // namespace pimhbm::summary
