// Parity groups (CPU): which chunks each group holds, the rows made from them, and rebuilds of
// a burst over neighbouring chunks.
#include "parity/parity.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "parity/groups.h"
#include "repair/repair.h"
#include "test_util.h"

namespace pimhbm {
namespace {

using testing::random_bytes;
using testing::rng_for_test;

// Every chunk in exactly one group, each group at most `group` chunks listed in increasing
// order, the last chunk last in the last group, and neighbours inside a block apart.
void check_layout(int64_t chunks, int64_t group) {
  SCOPED_TRACE(std::to_string(chunks) + " chunks, group " + std::to_string(group));
  const int64_t groups = parity::groups_of_chunks(chunks, group);
  ASSERT_EQ(groups, (chunks + group - 1) / group);
  std::vector<int64_t> owner(chunks, -1);
  for (int64_t g = 0; g < groups; ++g) {
    const parity::GroupSpan s = parity::group_span(chunks, group, g);
    ASSERT_GE(s.count, 1);
    ASSERT_LE(int64_t{s.count}, group);
    for (uint32_t m = 0; m < s.count; ++m) {
      const int64_t c = s.chunk(m);
      ASSERT_LT(c, chunks);
      ASSERT_EQ(owner[c], -1) << "chunk " << c << " in two groups";
      owner[c] = g;
      ASSERT_EQ(parity::group_of(chunks, group, c), g) << "chunk " << c;
    }
  }
  for (int64_t c = 0; c < chunks; ++c) ASSERT_GE(owner[c], 0) << "chunk " << c << " in none";
  if (chunks == 0) return;
  const parity::GroupSpan last = parity::group_span(chunks, group, groups - 1);
  EXPECT_EQ(last.first + (last.count - 1) * last.stride, chunks - 1);
  const int64_t block = group * group;
  for (int64_t c = 0; c + 1 < chunks; ++c) {
    const int64_t in_block = std::min(block, chunks - c / block * block);
    if ((c + 1) % block == 0 || in_block <= group) continue;  // another block, or one group
    EXPECT_NE(owner[c], owner[c + 1]) << "neighbours " << c << ", " << c + 1;
  }
}

TEST(ParityGroups, EveryChunkInOneGroupNeighboursApart) {
  for (int64_t group : {1, 2, 3, 4, 7, 16, 17}) {
    for (int64_t chunks = 0; chunks <= 3 * group * group + 5; ++chunks) check_layout(chunks, group);
  }
  PIMHBM_SEED_TRACE();
  auto rng = rng_for_test();
  for (int k = 0; k < 20; ++k) {
    check_layout(1 + static_cast<int64_t>(rng() % 100000), 1 + static_cast<int64_t>(rng() % 64));
  }
}

// A whole block's group j holds the block's chunks j, j + group, j + 2 group, ...
TEST(ParityGroups, WholeBlocksDealRoundRobin) {
  const int64_t group = 16, chunks = 3 * group * group + 40;
  for (int64_t c = 0; c < 3 * group * group; ++c) {
    const int64_t block = c / (group * group);
    ASSERT_EQ(parity::group_of(chunks, group, c), block * group + c % group) << c;
  }
}

struct Tensor {
  std::vector<uint8_t> bytes;
  std::vector<uint32_t> table;
  std::vector<uint32_t> rows;
};

Tensor make_tensor(std::mt19937_64& rng, int64_t nbytes, int64_t chunk, int64_t group) {
  Tensor t;
  t.bytes = random_bytes(rng, static_cast<size_t>(nbytes));
  t.table = testing::digest_table(t.bytes, chunk);
  t.rows.assign(static_cast<size_t>(parity::num_groups(nbytes, chunk, group) * chunk / 4), 0);
  parity::parity_cpu(t.bytes.data(), nbytes, chunk, group, t.rows.data());
  return t;
}

// Row g is the XOR of the chunks group_span names, each zero-padded: checked byte by byte
// against the chunks themselves.
TEST(ParityCpu, RowsAreTheXorOfTheirGroups) {
  PIMHBM_SEED_TRACE();
  auto rng = rng_for_test();
  for (int64_t nbytes : {int64_t{1}, int64_t{1000}, int64_t{64 * 300 + 17}}) {
    const int64_t chunk = 64, group = 1 + static_cast<int64_t>(rng() % 6);
    const Tensor t = make_tensor(rng, nbytes, chunk, group);
    const int64_t chunks = (nbytes + chunk - 1) / chunk;
    const auto* rows = reinterpret_cast<const uint8_t*>(t.rows.data());
    for (int64_t g = 0; g < parity::groups_of_chunks(chunks, group); ++g) {
      const parity::GroupSpan s = parity::group_span(chunks, group, g);
      for (int64_t b = 0; b < chunk; ++b) {
        uint8_t want = 0;
        for (uint32_t m = 0; m < s.count; ++m) {
          const int64_t at = s.chunk(m) * chunk + b;
          if (at < nbytes) want ^= t.bytes[at];
        }
        ASSERT_EQ(rows[g * chunk + b], want) << nbytes << " group " << g << " byte " << b;
      }
    }
  }
}

// A burst over neighbouring chunks of whole blocks (a failed row) is one chunk in each of several
// groups: every one is rebuilt. Two damaged chunks of one group are not (the positive control).
// (A short last block of n chunks has ceil(n / group) groups: bursts over more neighbours than
// that go to the next source, as every burst did before the deal.)
TEST(ParityCpu, ABurstOverNeighboursIsRebuiltTwoChunksOfAGroupAreNot) {
  PIMHBM_SEED_TRACE();
  auto rng = rng_for_test();
  const int64_t chunk = 256, group = 16, chunks = 2 * group * group + 37;
  const int64_t nbytes = chunks * chunk - 100;  // a short last chunk
  for (int trial = 0; trial < 20; ++trial) {
    Tensor t = make_tensor(rng, nbytes, chunk, group);
    const std::vector<uint8_t> good = t.bytes;
    const int64_t len = 1024 + static_cast<int64_t>(rng() % 1025);  // 1-2 KiB
    const int64_t whole_blocks = 2 * group * group * chunk;         // bytes
    const int64_t at = static_cast<int64_t>(rng() % static_cast<uint64_t>(whole_blocks - len + 1));
    for (int64_t b = at; b < at + len; ++b) t.bytes[b] ^= static_cast<uint8_t>(1 + rng() % 255);
    std::vector<int32_t> list;
    for (int64_t c = at / chunk; c <= (at + len - 1) / chunk; ++c) list.push_back(int32_t(c));
    std::vector<int32_t> status(list.size(), 77);
    const parity::Grouped view{t.bytes.data(), nbytes, chunk, group, t.table.data()};
    parity::rebuild_cpu(view, t.rows.data(), list.data(), int64_t(list.size()), status.data());
    for (size_t k = 0; k < list.size(); ++k) EXPECT_EQ(status[k], repair::kRepaired) << list[k];
    EXPECT_EQ(t.bytes, good) << "burst at " << at << " of " << len;
  }
  Tensor t = make_tensor(rng, nbytes, chunk, group);
  const int64_t c = group * group + 5, partner = c + group;  // one group of the second block
  ASSERT_EQ(parity::group_of(chunks, group, c), parity::group_of(chunks, group, partner));
  t.bytes[c * chunk + 3] ^= 0x40;
  t.bytes[partner * chunk + 3] ^= 0x40;
  const parity::Grouped view{t.bytes.data(), nbytes, chunk, group, t.table.data()};
  std::vector<int32_t> both = {int32_t(c), int32_t(partner)}, status(2, 77);
  parity::rebuild_cpu(view, t.rows.data(), both.data(), 2, status.data());
  EXPECT_EQ(status, (std::vector<int32_t>{parity::kGroupConflict, parity::kGroupConflict}));
  std::vector<int32_t> one = {int32_t(c)};
  parity::rebuild_cpu(view, t.rows.data(), one.data(), 1, status.data());
  EXPECT_EQ(status[0], repair::kStillDamaged);
}

}  // namespace
}  // namespace pimhbm
