// The parts of an injection shared by the CPU and CUDA code.
#pragma once

#include <cstdint>

#include "faults/inject.h"

#if defined(__CUDACC__)
#define PIMHBM_FAULTS_HD __host__ __device__ __forceinline__
#else
#define PIMHBM_FAULTS_HD inline
#endif

namespace pimhbm::faults {

PIMHBM_FAULTS_HD uint64_t spec_offset(const int32_t* spec) {
  return static_cast<uint64_t>(static_cast<uint32_t>(spec[1])) |
         static_cast<uint64_t>(static_cast<uint32_t>(spec[2])) << 32;
}

// The random byte at position i of stream `seed` (splitmix64 of both).
PIMHBM_FAULTS_HD uint8_t random_byte_hd(uint32_t seed, uint64_t i) {
  uint64_t z = (static_cast<uint64_t>(seed) << 32 ^ i) + 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return static_cast<uint8_t>(z ^ (z >> 31));
}

PIMHBM_FAULTS_HD int element_size(Format f) {
  return f == kFloat32 ? 4 : f == kFloat64 ? 8 : (f == kBFloat16 || f == kFloat16) ? 2 : 1;
}

// The little-endian bytes of NaN / +Inf / -Inf in format f, written at p.
PIMHBM_FAULTS_HD void write_nonfinite(uint8_t* p, Format f, int32_t value) {
  uint64_t bits = 0;
  const bool neg = value == 2;
  const bool nan = value == 0;
  switch (f) {
    case kFloat32: bits = nan ? 0x7FC00000u : (neg ? 0xFF800000u : 0x7F800000u); break;
    case kBFloat16: bits = nan ? 0x7FC0u : (neg ? 0xFF80u : 0x7F80u); break;
    case kFloat16: bits = nan ? 0x7E00u : (neg ? 0xFC00u : 0x7C00u); break;
    case kFloat64:
      bits = nan ? 0x7FF8000000000000ull : (neg ? 0xFFF0000000000000ull : 0x7FF0000000000000ull);
      break;
    default: return;
  }
  for (int b = 0; b < element_size(f); ++b) p[b] = static_cast<uint8_t>(bits >> (8 * b));
}

}  // namespace pimhbm::faults
