// The meeting point of the peer ops: payloads exchanged over many calls by threads that run at
// different speeds, bounded waits that name the missing ranks, and the segment copies.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <random>
#include <thread>
#include <vector>

#include "peer/copy.h"
#include "peer/rendezvous.h"
#include "test_util.h"

namespace pimhbm::peer {
namespace {

using std::chrono::milliseconds;

TEST(Rendezvous, EveryCallSeesEveryRanksPayloadOfThatCall) {
  constexpr int kRanks = 4, kCalls = 300;
  Group group(kRanks);
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r) {
    threads.emplace_back([&, r] {
      std::mt19937 gen(r * 7919 + 1);
      for (int call = 0; call < kCalls; ++call) {
        // Payload = (call, rank) encoded in the pointer values; ranks run at uneven speeds.
        if (gen() % 8 == 0) std::this_thread::sleep_for(std::chrono::microseconds(gen() % 300));
        Payload mine{reinterpret_cast<const void*>(static_cast<uintptr_t>(call * 16 + r + 1))};
        std::vector<Payload> all;
        if (!group.exchange(r, kReady, mine, &all, milliseconds(10000)).empty()) ++failures;
        for (int p = 0; p < kRanks; ++p) {
          if (reinterpret_cast<uintptr_t>(all[p].in) != static_cast<uintptr_t>(call * 16 + p + 1)) {
            ++failures;
          }
        }
        Payload done{nullptr, reinterpret_cast<const void*>(static_cast<uintptr_t>(call + 1))};
        if (!group.exchange(r, kDone, done, &all, milliseconds(10000)).empty()) ++failures;
        for (int p = 0; p < kRanks; ++p) {
          if (reinterpret_cast<uintptr_t>(all[p].extra) != static_cast<uintptr_t>(call + 1))
            ++failures;
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(failures.load(), 0);
}

TEST(Rendezvous, AMissingPeerGivesAnErrorNamingItNotAHang) {
  Group group(3);
  std::vector<Payload> all;
  std::string e1;
  std::thread other([&] { e1 = group.exchange(1, kReady, Payload{}, &all, milliseconds(200)); });
  std::vector<Payload> mine;
  const auto t0 = std::chrono::steady_clock::now();
  const std::string e0 = group.exchange(0, kReady, Payload{}, &mine, milliseconds(200));
  other.join();
  const auto waited = std::chrono::steady_clock::now() - t0;
  EXPECT_NE(e0.find("rank(s) 2 of 3"), std::string::npos) << e0;
  EXPECT_NE(e1.find("rank(s) 2 of 3"), std::string::npos) << e1;
  EXPECT_LT(waited, std::chrono::seconds(5));
}

TEST(Rendezvous, GroupsAreFoundByOrdinal) {
  const int64_t ordinals[] = {4, 5, 6, 7, 0, 1, 2, 3};  // two groups of four
  int64_t group;
  int rank;
  ASSERT_TRUE(find_rank(ordinals, 8, 4, 6, &group, &rank));
  EXPECT_EQ(group, 0);
  EXPECT_EQ(rank, 2);
  ASSERT_TRUE(find_rank(ordinals, 8, 4, 1, &group, &rank));
  EXPECT_EQ(group, 1);
  EXPECT_EQ(rank, 1);
  EXPECT_FALSE(find_rank(ordinals, 8, 4, 9, &group, &rank));
  std::string error;
  ASSERT_NE(group_for(12345, 0, 4, &error), nullptr);
  EXPECT_EQ(group_for(12345, 0, 2, &error), nullptr);
  EXPECT_NE(error.find("groups of 4 and now 2 devices"), std::string::npos) << error;
}

TEST(CopySegments, EverySegmentLandsInItsPlaceForRaggedSizes) {
  std::mt19937 gen(static_cast<uint32_t>(pimhbm::testing::test_seed()));
  for (int64_t bytes : {0, 1, 3, 15, 16, 17, 255, 4099}) {
    for (int count = 1; count <= kMaxGroup; count += 3) {
      std::vector<std::vector<uint8_t>> inputs(count, std::vector<uint8_t>(bytes));
      Segments s{};
      s.count = count;
      s.bytes = bytes;
      for (int p = 0; p < count; ++p) {
        for (auto& b : inputs[p]) b = static_cast<uint8_t>(gen());
        s.src[p] = inputs[p].data();
      }
      std::vector<uint8_t> out(bytes * count + 1, 0xA5);  // one guard byte
      copy_segments_cpu(s, out.data());
      for (int p = 0; p < count; ++p) {
        ASSERT_TRUE(std::equal(inputs[p].begin(), inputs[p].end(), out.begin() + p * bytes));
      }
      EXPECT_EQ(out.back(), 0xA5);
    }
  }
}

}  // namespace
}  // namespace pimhbm::peer
