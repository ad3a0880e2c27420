// Properties of the chunk digest (digest.h), on the CPU reference.
#include "pimhbm/digest.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <vector>

#include "scan/scan.h"
#include "test_util.h"

namespace pimhbm {
namespace {

using scan::chunk_digest;
using testing::random_bytes;
using testing::rng_for_test;

uint32_t get_word(const std::vector<uint8_t>& b, size_t w) {
  uint32_t v;
  std::memcpy(&v, b.data() + 4 * w, 4);
  return v;
}
void set_word(std::vector<uint8_t>& b, size_t w, uint32_t v) {
  std::memcpy(b.data() + 4 * w, &v, 4);
}

uint64_t digest(const std::vector<uint8_t>& b, int64_t chunk = 0) {
  return chunk_digest(b.data(), static_cast<int64_t>(b.size()), chunk);
}

// Chunk lengths that exercise whole chunks and every kind of ragged end.
const std::vector<size_t> kLengths = {4, 8, 12, 16, 20, 28, 100, 1000, 4096, 4100, 65536};

TEST(Digest, EverySingleBitFlipIsDetected) {
  PIMHBM_SEED_TRACE();
  auto rng = rng_for_test();
  for (size_t len : kLengths) {
    auto bytes = random_bytes(rng, len);
    const uint64_t d0 = digest(bytes);
    const size_t words = len / 4;
    for (int trial = 0; trial < 64; ++trial) {
      const size_t w = trial == 0 ? words - 1 : rng() % words;  // always try the last word
      for (int bit = 0; bit < 32; ++bit) {
        set_word(bytes, w, get_word(bytes, w) ^ (1u << bit));
        EXPECT_NE(digest(bytes), d0) << "len " << len << " word " << w << " bit " << bit;
        set_word(bytes, w, get_word(bytes, w) ^ (1u << bit));
      }
    }
    EXPECT_EQ(digest(bytes), d0);
  }
}

TEST(Digest, AnyChangeConfinedToOneWordIsDetected) {
  PIMHBM_SEED_TRACE();
  auto rng = rng_for_test();
  auto bytes = random_bytes(rng, 65536);
  const uint64_t d0 = digest(bytes);
  for (int trial = 0; trial < 20000; ++trial) {
    const size_t w = rng() % (bytes.size() / 4);
    const uint32_t old = get_word(bytes, w);
    uint32_t v = static_cast<uint32_t>(rng());
    // Mostly random values; also small deltas and a single byte changed.
    if (trial % 3 == 1) v = old + static_cast<uint32_t>(1 + rng() % 7);
    if (trial % 3 == 2) v = old ^ (static_cast<uint32_t>(1 + rng() % 255) << (8 * (rng() % 4)));
    if (v == old) continue;
    set_word(bytes, w, v);
    ASSERT_NE(digest(bytes), d0) << "word " << w << " " << old << " -> " << v;
    set_word(bytes, w, old);
  }
}

TEST(Digest, SwappedWordsAreDetected) {
  PIMHBM_SEED_TRACE();
  auto rng = rng_for_test();
  auto bytes = random_bytes(rng, 65536);
  const size_t words = bytes.size() / 4;
  const uint64_t d0 = digest(bytes);
  for (int trial = 0; trial < 20000; ++trial) {
    const size_t i = rng() % words;
    // Neighbours (inside one unit and across units) and far-apart pairs.
    const size_t j = trial % 2 ? (i + 1 + rng() % 3) % words : rng() % words;
    const uint32_t a = get_word(bytes, i), b = get_word(bytes, j);
    if (a == b) continue;
    set_word(bytes, i, b);
    set_word(bytes, j, a);
    ASSERT_NE(digest(bytes), d0) << "swap of words " << i << " and " << j;
    set_word(bytes, i, a);
    set_word(bytes, j, b);
  }
}

TEST(Digest, WordReadFromAnotherOffsetIsDetected) {
  PIMHBM_SEED_TRACE();
  auto rng = rng_for_test();
  auto bytes = random_bytes(rng, 65536 + 64);
  const size_t words = 65536 / 4;
  std::vector<uint8_t> chunk(bytes.begin(), bytes.begin() + 65536);
  const uint64_t d0 = digest(chunk);
  for (int trial = 0; trial < 20000; ++trial) {
    const size_t i = rng() % words, j = rng() % words;
    const uint32_t a = get_word(chunk, i), b = get_word(chunk, j);
    if (a == b) continue;
    set_word(chunk, i, b);  // word i read from the address of word j
    ASSERT_NE(digest(chunk), d0) << "word " << i << " replaced by word " << j;
    set_word(chunk, i, a);
  }
  // The whole chunk read from a shifted base address.
  for (size_t shift : {1, 2, 4, 8, 16, 32, 64}) {
    EXPECT_NE(chunk_digest(bytes.data() + shift, 65536, 0), d0) << "shift " << shift;
  }
}

TEST(Digest, RandomMultiWordCorruptionsAreDetected) {
  PIMHBM_SEED_TRACE();
  auto rng = rng_for_test();
  constexpr size_t kLen = 4096;
  auto bytes = random_bytes(rng, kLen);
  const uint64_t d0 = digest(bytes);
  const size_t words = kLen / 4;
  int detected = 0;
  constexpr int kTrials = 100000;
  for (int trial = 0; trial < kTrials; ++trial) {
    auto damaged = bytes;
    switch (trial % 4) {
      case 0:  // 2..64 random words get random values
      case 1: {
        const int k = 2 + static_cast<int>(rng() % 63);
        for (int n = 0; n < k; ++n) set_word(damaged, rng() % words, static_cast<uint32_t>(rng()));
        break;
      }
      case 2: {  // the same bit flipped in 2..16 words (a stuck column)
        const int bit = static_cast<int>(rng() % 32), k = 2 + static_cast<int>(rng() % 15);
        for (int n = 0; n < k; ++n) {
          const size_t w = rng() % words;
          set_word(damaged, w, get_word(damaged, w) ^ (1u << bit));
        }
        break;
      }
      case 3: {  // a burst: 64..1024 contiguous bytes overwritten (a failed row)
        const size_t len = 64 + rng() % 961, at = rng() % (kLen - len);
        for (size_t b = at; b < at + len; ++b) damaged[b] = static_cast<uint8_t>(rng());
        break;
      }
    }
    if (damaged == bytes) {  // the damage undid itself (e.g. a bit flipped twice)
      ++detected;
      continue;
    }
    detected += digest(damaged) != d0 ? 1 : 0;
  }
  EXPECT_EQ(detected, kTrials);
}

TEST(Digest, DoesNotDependOnHowWordsAreSplit) {
  // The kernels sum word terms in whatever order their threads reach them; any split and
  // order of the sum must give the reference digest.
  PIMHBM_SEED_TRACE();
  auto rng = rng_for_test();
  for (size_t len : {16u, 1000u, 4096u, 65536u}) {
    auto bytes = random_bytes(rng, len);
    const uint64_t want = digest(bytes, 7);
    const size_t words = (len + 3) / 4;
    std::vector<uint64_t> terms(words);
    for (size_t i = 0; i < words; ++i) {
      uint32_t w = 0;
      std::memcpy(&w, bytes.data() + 4 * i, std::min<size_t>(4, len - 4 * i));
      terms[i] = word_term(w, word_mul(static_cast<uint32_t>(i)));
    }
    for (int trial = 0; trial < 20; ++trial) {
      std::vector<size_t> order(words);
      std::iota(order.begin(), order.end(), 0);
      std::shuffle(order.begin(), order.end(), rng);
      const size_t parts = 1 + rng() % 64;
      std::vector<uint64_t> partial(parts, 0);
      for (size_t k = 0; k < words; ++k) partial[rng() % parts] += terms[order[k]];
      uint64_t acc = 0;
      for (uint64_t p : partial) acc += p;
      EXPECT_EQ(finalize(acc, len, 7), want);
    }
  }
}

TEST(Digest, UnitTermsAreTheirTwoWordsTerms) {
  PIMHBM_SEED_TRACE();
  auto rng = rng_for_test();
  for (int trial = 0; trial < 1000; ++trial) {
    const uint64_t unit = rng(), i = rng() % (1u << 29);
    const uint32_t w = static_cast<uint32_t>(2 * i);
    EXPECT_EQ(unit_terms(unit, i),
              word_term(static_cast<uint32_t>(unit), word_mul(w)) +
                  word_term(static_cast<uint32_t>(unit >> 32), word_mul(w + 1)));
  }
}

// The guarantees of digest.h rest on the multipliers being odd and distinct: checked over the
// first 2^22 words (chunks of 16 MiB; the defaults are 64 KiB and smaller) and at the top of
// the range.
TEST(Digest, WordMultipliersAreOddAndDistinct) {
  std::vector<uint32_t> m;
  m.reserve((1u << 22) + 4096);
  for (uint32_t w = 0; w < (1u << 22); ++w) m.push_back(word_mul(w));
  for (uint32_t w = 0x7FFFFFFFu - 4095; w <= 0x7FFFFFFEu; ++w) m.push_back(word_mul(w));
  m.push_back(word_mul(0x7FFFFFFFu));
  for (uint32_t v : m) ASSERT_EQ(v & 1u, 1u);
  std::sort(m.begin(), m.end());
  EXPECT_EQ(std::adjacent_find(m.begin(), m.end()), m.end());
}

// The sum of a chunk's word terms with the given multipliers.
uint64_t word_sum(const std::vector<uint8_t>& b, const std::vector<uint32_t>& muls) {
  uint64_t acc = 0;
  for (size_t w = 0; w < muls.size(); ++w) acc += word_term(get_word(b, w), muls[w]);
  return acc;
}

// Whether every pair of flipped bits of the chunk changes the word sum.
bool every_pair_of_flips_changes(std::vector<uint8_t> b, const std::vector<uint32_t>& muls) {
  const uint64_t s0 = word_sum(b, muls);
  const size_t bits = 8 * b.size();
  for (size_t x = 0; x < bits; ++x) {
    for (size_t y = x + 1; y < bits; ++y) {
      b[x / 8] ^= static_cast<uint8_t>(1u << (x % 8));
      b[y / 8] ^= static_cast<uint8_t>(1u << (y % 8));
      const bool same = word_sum(b, muls) == s0;
      b[x / 8] ^= static_cast<uint8_t>(1u << (x % 8));
      b[y / 8] ^= static_cast<uint8_t>(1u << (y % 8));
      if (same) return false;
    }
  }
  return true;
}

TEST(Digest, EveryPairOfBitFlipsInAChunkIsDetected) {
  PIMHBM_SEED_TRACE();
  auto rng = rng_for_test();
  constexpr uint32_t kWords = 32;  // every pair of the chunk's 1024 bits
  auto bytes = random_bytes(rng, 4 * kWords);
  std::vector<uint32_t> muls(kWords);
  for (uint32_t w = 0; w < kWords; ++w) muls[w] = word_mul(w);
  EXPECT_TRUE(every_pair_of_flips_changes(bytes, muls));
  // The positive control: with two equal multipliers the same bit flipped one way in one word
  // and the other way in the other cancels, and the search finds it.
  set_word(bytes, 5, get_word(bytes, 5) | 0x80000000u);
  set_word(bytes, 9, get_word(bytes, 9) & 0x7FFFFFFFu);
  muls[9] = muls[5];
  EXPECT_FALSE(every_pair_of_flips_changes(bytes, muls));
}

TEST(Digest, RaggedLengthsAndChunkIndexAreDistinguished) {
  PIMHBM_SEED_TRACE();
  auto rng = rng_for_test();
  auto bytes = random_bytes(rng, 300);
  for (size_t len = 1; len < 300; ++len) {
    // Trailing zero bytes are not the same chunk as a shorter one.
    std::vector<uint8_t> a(bytes.begin(), bytes.begin() + len), b = a;
    b.push_back(0);
    EXPECT_NE(digest(a), digest(b)) << "len " << len;
    // Identical bytes in two different chunks have different digests.
    EXPECT_NE(digest(a, 0), digest(a, 1)) << "len " << len;
  }
  EXPECT_NE(chunk_digest(nullptr, 0, 0), chunk_digest(nullptr, 0, 1));
}

TEST(Digest, KnownAnswers) {
  // Pins the definition: digests are stored (tables, host snapshots) and must not change
  // between versions without notice.
  std::vector<uint8_t> bytes(100);
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<uint8_t>(i * 31 + 7);
  // The same values come from the independent Python definition in tests/digest_ref.py.
  EXPECT_EQ(chunk_digest(bytes.data(), 100, 0), 0x2468ec2345067874ull);
  EXPECT_EQ(chunk_digest(bytes.data(), 64, 5), 0xfaff18c9e8adae37ull);
  EXPECT_EQ(chunk_digest(bytes.data(), 3, 2), 0x2891d3d6d587b4dcull);
  EXPECT_EQ(word_mul(0), 536062291u);
  EXPECT_EQ(word_mul(3), 475453563u);
}

TEST(ScanTable, ChunkCountsAndLengths) {
  EXPECT_EQ(num_chunks(0, 16), 0);
  EXPECT_EQ(num_chunks(1, 16), 1);
  EXPECT_EQ(num_chunks(16, 16), 1);
  EXPECT_EQ(num_chunks(17, 16), 2);
  EXPECT_EQ(num_chunks(65536 * 3 + 5, 65536), 4);
  EXPECT_EQ(chunk_length(65536 * 3 + 5, 65536, 3), 5);
  EXPECT_EQ(chunk_length(65536 * 3 + 5, 65536, 2), 65536);
}

TEST(ScanTable, VerifyFlagsExactlyTheDamagedChunks) {
  PIMHBM_SEED_TRACE();
  auto rng = rng_for_test();
  for (size_t len : {0u, 5u, 4096u, 100000u, 1u << 20}) {
    auto bytes = random_bytes(rng, len);
    const int64_t chunk = 16 * (1 + static_cast<int64_t>(rng() % 512));
    const int64_t n = num_chunks(static_cast<int64_t>(len), chunk);
    std::vector<uint32_t> table(2 * n);
    std::vector<int32_t> nonfinite(n);
    std::vector<float> max_abs(n);
    scan::scan_cpu(bytes.data(), static_cast<int64_t>(len), Elem::kRaw, chunk, table.data(),
                   nonfinite.data(), max_abs.data());
    for (int64_t c = 0; c < n; ++c) {
      const uint64_t d = chunk_digest(bytes.data() + c * chunk, chunk_length(len, chunk, c), c);
      ASSERT_EQ(digest_join(table[2 * c], table[2 * c + 1]), d);
    }
    const auto original = bytes;
    for (int k = 0; k < 5 && len > 0; ++k) {
      bytes[rng() % len] ^= static_cast<uint8_t>(1u << (rng() % 8));
    }
    std::vector<uint8_t> mismatch(n, 9);  // poisoned: every entry must be written
    scan::verify_cpu(bytes.data(), static_cast<int64_t>(len), chunk, table.data(), mismatch.data());
    for (int64_t c = 0; c < n; ++c) {
      const auto from = static_cast<size_t>(c * chunk);
      const auto to = from + static_cast<size_t>(chunk_length(len, chunk, c));
      const bool damaged =
          !std::equal(bytes.begin() + from, bytes.begin() + to, original.begin() + from);
      EXPECT_EQ(mismatch[c], damaged ? 1 : 0) << "chunk " << c << " of " << n;
    }
  }
}

}  // namespace
}  // namespace pimhbm
