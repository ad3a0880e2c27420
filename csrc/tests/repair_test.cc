// CPU reference of chunk repair, the device copy's restore, fault injection, and the update's
// device copy (written only for chunks that verified).
#include "repair/repair.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "adamw_host_leaf.h"
#include "faults/inject.h"
#include "scan/scan.h"
#include "test_util.h"
#include "update/adamw.h"

namespace pimhbm {
namespace {

using testing::random_bytes;
using testing::rng_for_test;

TEST(Repair, CopiesVerifiedSourceChunksOnly) {
  PIMHBM_SEED_TRACE();
  auto rng = rng_for_test();
  const int64_t chunk = 256;
  auto good = random_bytes(rng, 10000);
  const auto table = testing::digest_table(good, chunk);
  auto target = good;
  target[300] ^= 1;   // chunk 1
  target[9999] ^= 8;  // chunk 39 (short last chunk)
  target[5000] ^= 2;  // chunk 19
  auto source = good;
  source[5001] ^= 4;  // the backup of chunk 19 is damaged too
  auto target_table = table;
  const std::vector<int32_t> chunks = {1, 39, 19, -1, 40};
  std::vector<int32_t> status(chunks.size(), 77);
  repair::repair_cpu(chunks.data(), static_cast<int64_t>(chunks.size()),
                     {source.data(), 10000, chunk, table.data()},
                     {target.data(), 10000, chunk, target_table.data()}, status.data());
  EXPECT_EQ(status,
            (std::vector<int32_t>{repair::kRepaired, repair::kRepaired, repair::kSourceDamaged,
                                  repair::kNotListed, repair::kOutOfRange}));
  EXPECT_EQ(target[300], good[300]);
  EXPECT_EQ(target[9999], good[9999]);
  EXPECT_NE(target[5000], good[5000]);  // not copied from a damaged source
}

// Chunks received packed (entry k at row k, as a replica sends them) land where they belong,
// each checked against the digest row that came with it; the ragged last chunk's row is
// padded and only its real bytes are written.
TEST(Repair, PackedRowsAreCheckedAndWrittenToTheirChunks) {
  PIMHBM_SEED_TRACE();
  auto rng = rng_for_test();
  const int64_t chunk = 256, size = 10000;  // 40 chunks, the last of 16 bytes
  auto good = random_bytes(rng, size);
  const auto table = testing::digest_table(good, chunk);
  auto target = good;
  target[300] ^= 1;   // chunk 1
  target[9999] ^= 8;  // chunk 39
  target[5000] ^= 2;  // chunk 19
  auto target_table = table;
  const std::vector<int32_t> chunks = {39, 1, 19, -1, 40};
  std::vector<uint8_t> rows(chunks.size() * chunk, 0xEE);
  std::vector<uint32_t> row_table(2 * chunks.size(), 0);
  for (size_t k = 0; k < chunks.size(); ++k) {
    const int64_t c = chunks[k];
    if (c < 0 || c >= 40) continue;
    const int64_t len = chunk_length(size, chunk, c);
    std::memcpy(rows.data() + k * chunk, good.data() + c * chunk, len);
    row_table[2 * k] = table[2 * c];
    row_table[2 * k + 1] = table[2 * c + 1];
  }
  rows[2 * chunk + 7] ^= 16;  // chunk 19 arrives damaged
  repair::Sources packed{};
  packed.tensor[0] = {rows.data(), static_cast<int64_t>(rows.size()), chunk, row_table.data()};
  packed.count = 1;
  packed.self = -1;
  packed.packed = true;
  std::vector<int32_t> status(chunks.size(), 77);
  repair::repair_from_cpu(chunks.data(), static_cast<int64_t>(chunks.size()), packed,
                          {target.data(), size, chunk, target_table.data()}, status.data());
  EXPECT_EQ(status,
            (std::vector<int32_t>{repair::kRepaired, repair::kRepaired, repair::kSourceDamaged,
                                  repair::kNotListed, repair::kOutOfRange}));
  for (int64_t i = 0; i < size; ++i) {
    if (i / chunk == 19) continue;
    ASSERT_EQ(target[i], good[i]) << i;
  }
  EXPECT_NE(target[5000], good[5000]);  // not written from a damaged row
  EXPECT_EQ(target_table, table);
}

TEST(RestoreClean, CopiesCleanChunksWhenTheStepDoesNotCommit) {
  PIMHBM_SEED_TRACE();
  auto rng = rng_for_test();
  const int64_t chunk = 64;
  auto src = random_bytes(rng, 1000), dst = random_bytes(rng, 1000);
  auto src_table = testing::digest_table(src, chunk), dst_table = testing::digest_table(dst, chunk);
  const auto dst0 = dst;
  std::vector<int32_t> faults(num_chunks(1000, chunk), 0);
  faults[3] = 4;
  const int32_t commit = 1, skip = 0;
  repair::restore_clean_cpu(&commit, faults.data(), {src.data(), 1000, chunk, src_table.data()},
                            {dst.data(), 1000, chunk, dst_table.data()});
  EXPECT_EQ(dst, dst0);
  repair::restore_clean_cpu(&skip, faults.data(), {src.data(), 1000, chunk, src_table.data()},
                            {dst.data(), 1000, chunk, dst_table.data()});
  for (int64_t i = 0; i < 1000; ++i) {
    EXPECT_EQ(dst[i], i / chunk == 3 ? dst0[i] : src[i]) << i;
  }
}

TEST(Inject, EveryKindDoesWhatItSaysAndStaysInside) {
  PIMHBM_SEED_TRACE();
  auto rng = rng_for_test();
  auto x = random_bytes(rng, 4000);
  const auto x0 = x;
  const auto spec = [](int32_t kind, uint64_t off, int32_t len, int32_t bit, int32_t seed,
                       int32_t value) {
    return std::vector<int32_t>{kind,
                                static_cast<int32_t>(off & 0xFFFFFFFFu),
                                static_cast<int32_t>(off >> 32),
                                len,
                                bit,
                                seed,
                                value,
                                0};
  };
  faults::inject_cpu(x.data(), 4000, faults::kRawBytes,
                     spec(faults::kFlipBit, 17, 0, 3, 0, 0).data());
  for (int i = 0; i < 4000; ++i) EXPECT_EQ(x[i], i == 17 ? (x0[i] ^ 8) : x0[i]);
  x = x0;
  faults::inject_cpu(x.data(), 4000, faults::kRawBytes,
                     spec(faults::kOverwrite, 3900, 1000, 0, 5, 0).data());
  int changed = 0;
  for (int i = 0; i < 4000; ++i) {
    if (i < 3900) EXPECT_EQ(x[i], x0[i]);
    changed += x[i] != x0[i];
  }
  EXPECT_GT(changed, 90);  // 100 bytes clipped at the end, each changed with p = 255/256
  std::vector<float> f(10, 1.0f);
  faults::inject_cpu(reinterpret_cast<uint8_t*>(f.data()), 40, faults::kFloat32,
                     spec(faults::kNonFinite, 7, 0, 0, 0, 2).data());
  EXPECT_TRUE(std::isinf(f[7]) && f[7] < 0);
  faults::inject_cpu(reinterpret_cast<uint8_t*>(f.data()), 40, faults::kFloat32,
                     spec(faults::kNonFinite, 10, 0, 0, 0, 0).data());  // out of range: nothing
  for (int i = 0; i < 10; ++i) EXPECT_TRUE(i == 7 || f[i] == 1.0f);
}

TEST(AdamWDeviceCopy, TakesOnlyChunksThatVerified) {
  PIMHBM_SEED_TRACE();
  auto rng = rng_for_test();
  using update::testing::HostLeaf;
  HostLeaf h(rng, 5000, 512, true, true);
  h.mu[1234] += 1.0f;  // chunk 2 of mu damaged: the device copy must keep its old chunk 2
  update::testing::HostCopy copy(h, 0x55, 3, 3.0f, 9);
  const float step[3] = {1e-3f, 0.1f, 0.001f};
  update::adamw_cpu(copy.attach(h.view()), update::testing::kHyper, step);
  for (int64_t i = 0; i < h.n; ++i) {
    const bool damaged_chunk = i / 512 == 2;
    EXPECT_EQ(copy.mu[i], damaged_chunk ? 3.0f : h.mu_out[i]) << i;
    EXPECT_EQ(copy.w[i], damaged_chunk ? 3 : h.w_out[i]) << i;
  }
  for (int64_t c = 0; c < h.chunks(); ++c) {
    EXPECT_EQ(copy.dmu[2 * c], c == 2 ? 9u : h.dn_mu[2 * c]) << c;
  }
}

}  // namespace
}  // namespace pimhbm
