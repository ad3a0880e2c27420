// The CPU reference's finite check and max |x| against truths computed independently
// (elem_samples.h), for every float dtype, ragged sizes and chunk sizes.
#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "elem_samples.h"
#include "scan/scan.h"
#include "test_util.h"

namespace pimhbm {
namespace {

using testing::make_sample;
using testing::rng_for_test;

class HealthTest : public ::testing::TestWithParam<Elem> {};

TEST_P(HealthTest, CountsAndMaxMatchTheTruth) {
  PIMHBM_SEED_TRACE();
  auto rng = rng_for_test();
  const Elem elem = GetParam();
  for (size_t count : {0u, 1u, 3u, 7u, 31u, 257u, 4099u, 70001u}) {
    const auto s = make_sample(rng, elem, count, count % 2 ? 0.01 : 0.2);
    const int64_t nbytes = static_cast<int64_t>(s.bytes.size());
    const int64_t chunk = 16 * (1 + static_cast<int64_t>(rng() % 300));
    const int64_t n = num_chunks(nbytes, chunk);
    std::vector<uint32_t> digests(2 * n, 0xDEADBEEF);
    std::vector<int32_t> nonfinite(n, -7);
    std::vector<float> max_abs(n, -1.0f);
    scan::scan_cpu(s.bytes.data(), nbytes, elem, chunk, digests.data(), nonfinite.data(),
                   max_abs.data());
    const int64_t per_chunk = chunk / s.elem_size;
    for (int64_t c = 0; c < n; ++c) {
      int32_t bad = 0;
      double mx = 0.0;
      for (int64_t i = c * per_chunk; i < std::min<int64_t>((c + 1) * per_chunk, count); ++i) {
        bad += s.finite[i] ? 0 : 1;
        if (s.finite[i]) mx = std::max(mx, s.magnitude[i]);
      }
      ASSERT_EQ(nonfinite[c], bad) << "chunk " << c << " count " << count;
      ASSERT_EQ(max_abs[c], static_cast<float>(mx)) << "chunk " << c << " count " << count;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllFloatDtypes, HealthTest,
                         ::testing::Values(Elem::kF64, Elem::kF32, Elem::kF16, Elem::kBF16,
                                           Elem::kF8E4M3FN, Elem::kF8E5M2));

TEST(Health, IntegersAreNeverNonFinite) {
  PIMHBM_SEED_TRACE();
  auto rng = rng_for_test();
  auto bytes = testing::random_bytes(rng, 10000);
  std::vector<uint32_t> digests(2);
  std::vector<int32_t> nonfinite(1, -1);
  std::vector<float> max_abs(1, -1.0f);
  scan::scan_cpu(bytes.data(), 10000, Elem::kRaw, 65536, digests.data(), nonfinite.data(),
                 max_abs.data());
  EXPECT_EQ(nonfinite[0], 0);
  EXPECT_EQ(max_abs[0], 0.0f);
}

// A shard that starts at chunk k of its tensor, scanned with chunk_base k, has the whole
// tensor's digests of those chunks -- and without it, other ones (the base is in the key).
TEST(ChunkBase, AShardHasTheWholeTensorsDigests) {
  PIMHBM_SEED_TRACE();
  auto rng = rng_for_test();
  const int64_t chunk = 256, chunks = 37;
  auto bytes = testing::random_bytes(rng, chunk * chunks - 40);  // a short last chunk
  const int64_t nbytes = static_cast<int64_t>(bytes.size());
  std::vector<uint32_t> whole(2 * chunks);
  std::vector<int32_t> nonfinite(chunks);
  std::vector<float> max_abs(chunks);
  scan::scan_cpu(bytes.data(), nbytes, Elem::kRaw, chunk, whole.data(), nonfinite.data(),
                 max_abs.data());
  for (int64_t first : {int64_t{0}, int64_t{1}, int64_t{12}, chunks - 1}) {
    const int64_t len = nbytes - first * chunk, n = chunks - first;
    std::vector<uint32_t> part(2 * n), unbased(2 * n);
    scan::scan_cpu(bytes.data() + first * chunk, len, Elem::kRaw, chunk, part.data(),
                   nonfinite.data(), max_abs.data(), first);
    scan::scan_cpu(bytes.data() + first * chunk, len, Elem::kRaw, chunk, unbased.data(),
                   nonfinite.data(), max_abs.data());
    EXPECT_TRUE(std::equal(part.begin(), part.end(), whole.begin() + 2 * first)) << first;
    if (first > 0) EXPECT_NE(unbased[0], whole[2 * first]) << first;
    std::vector<uint8_t> mismatch(n, 7);
    scan::verify_cpu(bytes.data() + first * chunk, len, chunk, whole.data() + 2 * first,
                     mismatch.data(), first);
    EXPECT_EQ(std::count(mismatch.begin(), mismatch.end(), 0), n) << first;
  }
}

}  // namespace
}  // namespace pimhbm
