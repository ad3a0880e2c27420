// The chunk digest: one definition shared by the CPU reference and the CUDA kernels.
//
// A tensor's raw bytes (row-major, as XLA hands them to us) are cut into chunks of
// `chunk_bytes` (a positive multiple of 16; the last chunk may be short). Each chunk is read
// as 32-bit little-endian words x_w (the last word zero-padded) and its digest is
//
//   acc    = sum over words w of  x_w * M(w)                   (mod 2^64)
//   M(w)   = word_mul(w): odd, below 2^32, distinct for every w < 2^31
//   digest = finalize(acc, chunk length in bytes, c)
//
// Why this shape (each term is one 32 x 32 -> 64-bit multiply-add: the update kernel digests
// every word it reads and writes, so the term's cost is the digest's cost):
// * one word changed by d (0 < |d| < 2^32) changes acc by d M(w), which is not 0 and lies
//   strictly between -2^64 and 2^64, so it is not 0 mod 2^64: any change confined to one
//   32-bit word -- any single-bit flip -- is detected, always.
// * two single-bit flips in different words change acc by +-2^a M(u) +- 2^b M(v); each part
//   is below 2^63, so the sum is 0 mod 2^64 only if it is 0, i.e. a = b (the M are odd) and
//   M(u) = M(v) (they are distinct): any two flipped bits of a chunk are detected, always.
//   Two swapped words change it by (x_u - x_v)(M(v) - M(u)): detected, always.
// * damage to several words where one of them takes a random value: given the others, that
//   word's change must be one value (M odd, so invertible mod 2^64): missed with probability
//   at most 2^-32. Structured patterns of three or more words cancel only where small
//   integer relations between the M hold, which the mixing in word_mul makes as rare.
// * zero words add nothing, so zero padding needs no mask; the length enters finalize.
// * the chunk's index enters finalize, so two chunks with identical bytes still have distinct
//   digests (a repair that writes the wrong chunk is caught).
// * the sum is commutative and associative, so the result does not depend on how the words
//   are split across threads, warps, blocks or CPU loops: CPU and GPU agree bit for bit.
// * finalize() is a bijection of acc, so it keeps every property above.
//
// Digests are stored as two uint32 words (low, high) so JAX never needs 64-bit mode.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define PIMHBM_HD __host__ __device__ __forceinline__
#else
#define PIMHBM_HD inline
#endif

namespace pimhbm {

// Default chunk size: 64 KiB, the granularity at which damage is located and repaired.
inline constexpr int64_t kDefaultChunkBytes = 64 * 1024;
// Chunks are a whole number of 16-byte vectors so that every chunk of an aligned buffer
// starts on a 16-byte boundary.
inline constexpr int64_t kChunkAlign = 16;

inline constexpr uint64_t kChunkStride = 0xD6E8FEB86659FD93ull;  // odd
inline constexpr uint64_t kMul1 = 0xFF51AFD7ED558CCDull;         // odd (murmur3 fmix64)
inline constexpr uint64_t kMul2 = 0xC4CEB9FE1A85EC53ull;         // odd (murmur3 fmix64)
inline constexpr uint64_t kLengthMul = 0x94D049BB133111EBull;    // odd (splitmix64)
// Chunks hold at most 2^31 bytes or elements, so fewer than 2^31 words even for 4-byte elements
// (word_mul's distinct range).
inline constexpr int64_t kMaxChunkSize = int64_t{1} << 31;

// Enters finalize: distinct per chunk, so that two chunks with identical bytes still have
// distinct digests.
PIMHBM_HD uint64_t chunk_key(uint64_t chunk) { return (chunk + 1) * kChunkStride; }

// The multiplier of word w of a chunk: 2 h(w) + 1 with h a bijection of 31-bit numbers (odd
// affine maps and xorshifts mod 2^31), so odd, below 2^32, and distinct for every w < 2^31.
PIMHBM_HD constexpr uint32_t word_mul(uint32_t w) {
  uint32_t x = (w * 0x5BD1E995u + 0x6A09E667u) & 0x7FFFFFFFu;
  x ^= x >> 15;
  x = (x * 0x2C1B3C6Du) & 0x7FFFFFFFu;
  x ^= x >> 13;
  return 2u * x + 1u;
}

// The term of one word: a single multiply-add into the 64-bit sum on the GPU.
PIMHBM_HD uint64_t word_term(uint32_t word, uint32_t mul) {
  return static_cast<uint64_t>(word) * mul;
}

// The terms of 64-bit unit i of a chunk (its words 2 i and 2 i + 1), for loops that read
// 8 bytes at a time.
PIMHBM_HD uint64_t unit_terms(uint64_t unit, uint64_t i) {
  const uint32_t w = static_cast<uint32_t>(2 * i);
  return word_term(static_cast<uint32_t>(unit), word_mul(w)) +
         word_term(static_cast<uint32_t>(unit >> 32), word_mul(w + 1));
}

// Bijective in `acc` for a fixed chunk length and index.
PIMHBM_HD uint64_t finalize(uint64_t acc, uint64_t chunk_len, uint64_t chunk) {
  uint64_t x = acc + chunk_len * kLengthMul + chunk_key(chunk);
  x ^= x >> 33;
  x *= kMul1;
  x ^= x >> 33;
  x *= kMul2;
  x ^= x >> 33;
  return x;
}

// Number of chunks of a buffer of `nbytes`: 0 for an empty buffer.
PIMHBM_HD int64_t num_chunks(int64_t nbytes, int64_t chunk_bytes) {
  return (nbytes + chunk_bytes - 1) / chunk_bytes;
}

// Length in bytes of chunk `c` (the last one may be short).
PIMHBM_HD int64_t chunk_length(int64_t nbytes, int64_t chunk_bytes, int64_t c) {
  int64_t rest = nbytes - c * chunk_bytes;
  return rest < chunk_bytes ? rest : chunk_bytes;
}

PIMHBM_HD uint32_t digest_lo(uint64_t d) { return static_cast<uint32_t>(d); }
PIMHBM_HD uint32_t digest_hi(uint64_t d) { return static_cast<uint32_t>(d >> 32); }
PIMHBM_HD uint64_t digest_join(uint32_t lo, uint32_t hi) {
  return (static_cast<uint64_t>(hi) << 32) | lo;
}

}  // namespace pimhbm
