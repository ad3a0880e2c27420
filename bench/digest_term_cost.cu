// What one 64-bit digest unit costs in instructions: today's term (digest.h: two 64-bit
// multiplies with xorshifts) against a candidate with the same guarantee for a change confined
// to one 32-bit word (each half XORed with its key and multiplied by an odd 64-bit constant,
// the two products summed: an odd multiplier never maps a nonzero change to zero).
// Not a test and not linked anywhere: compiled for its SASS only (bench/NOTES.md, "v8 measured"):
//   nvcc -std=c++17 -O3 -arch=sm_90 -cubin -Icsrc/include bench/digest_term_cost.cu -o /tmp/d.cubin
//   python3 scripts/sass_report.py /tmp/d.cubin 'term_loop' --classes
// Each loop iteration digests 8 units (four 128-bit loads); instructions a unit = loop / 8.
#include <cstdint>

#include "pimhbm/digest.h"

namespace pimhbm_bench {

using pimhbm::kMul1;
using pimhbm::kMul2;
using pimhbm::kUnitStride;

__device__ __forceinline__ uint64_t two_product_term(uint64_t unit, uint64_t key) {
  const uint64_t x = unit ^ key;
  return (x & 0xFFFFFFFFull) * kMul1 + (x >> 32) * kMul2;
}

template <int kCandidate>
__global__ void term_loop(const uint4* __restrict__ in, uint64_t* out, int n, uint64_t key0) {
  uint64_t acc = 0;
  uint64_t key = key0 + 2 * threadIdx.x * kUnitStride;
#pragma unroll 4
  for (int i = threadIdx.x; i < n; i += 32) {
    const uint4 w = in[i];
    const uint64_t a = static_cast<uint64_t>(w.y) << 32 | w.x;
    const uint64_t b = static_cast<uint64_t>(w.w) << 32 | w.z;
    acc += kCandidate ? two_product_term(a, key) + two_product_term(b, key + kUnitStride)
                      : pimhbm::unit_term(a, key) + pimhbm::unit_term(b, key + kUnitStride);
    key += 64 * kUnitStride;
  }
  out[threadIdx.x] = acc;
}

template __global__ void term_loop<0>(const uint4*, uint64_t*, int, uint64_t);
template __global__ void term_loop<1>(const uint4*, uint64_t*, int, uint64_t);

}  // namespace pimhbm_bench
