// The chunk digest: one definition shared by the CPU reference and the CUDA kernels.
//
// A tensor's raw bytes (row-major, as XLA hands them to us) are cut into chunks of
// `chunk_bytes` (a positive multiple of 16; the last chunk may be short). Each chunk is read
// as 64-bit little-endian units (the last unit zero-padded) and its digest is
//
//   acc    = sum over units i of  term(unit_i, key_i)          (mod 2^64)
//   key_i  = chunk_key(c) + i * kUnitStride                    (mod 2^64)
//   digest = finalize(acc, chunk length in bytes, c)
//
// Why this shape:
// * term(., key) is a bijection of the unit (xor, multiply by an odd constant, xorshift,
//   multiply, xorshift), so any change confined to one unit -- a single bit, any damage to
//   one 32-bit word -- changes exactly one term and therefore the sum: detected always.
// * key_i depends on the position, so swapped words or a word read from another offset
//   change the terms they land in; the second multiply spreads even a top-bit flip over
//   more than 32 bits, so structured multi-word damage cancels with probability ~2^-33 or
//   less, and random damage with ~2^-64.
// * the sum is commutative and associative, so the result does not depend on how the units
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

inline constexpr uint64_t kUnitStride = 0x9E3779B97F4A7C15ull;  // odd: 2^64 / golden ratio
inline constexpr uint64_t kChunkStride = 0xD6E8FEB86659FD93ull;  // odd
inline constexpr uint64_t kMul1 = 0xFF51AFD7ED558CCDull;         // odd (murmur3 fmix64)
inline constexpr uint64_t kMul2 = 0xC4CEB9FE1A85EC53ull;         // odd (murmur3 fmix64)
inline constexpr uint64_t kLengthMul = 0x94D049BB133111EBull;    // odd (splitmix64)

// Key of unit 0 of chunk `chunk`: distinct per chunk, so that two chunks with identical
// bytes still have distinct digests (a repair that writes the wrong chunk is caught).
PIMHBM_HD uint64_t chunk_key(uint64_t chunk) { return (chunk + 1) * kChunkStride; }

// The per-unit term: a bijection of `unit` for every key.
PIMHBM_HD uint64_t unit_term(uint64_t unit, uint64_t key) {
  uint64_t x = unit ^ key;
  x *= kMul1;
  x ^= x >> 32;
  x *= kMul2;
  x ^= x >> 32;
  return x;
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
