// What the digest costs in instructions per 16 bytes: the previous definition (a 64-bit unit's
// term of two 64-bit multiplies with xorshifts, its key advanced per unit; copied here, it is no
// longer the library's) against today's (digest.h: each 32-bit word times its multiplier, the
// multipliers read four at a time from shared memory as the update and precheck kernels do).
// Not a test and not linked anywhere: compiled for its SASS only (bench/NOTES.md, "The digest
// as word products"):
//   nvcc -std=c++17 -O3 -arch=sm_90 -cubin -Icsrc/include bench/digest_term_cost.cu -o /tmp/d.cubin
//   python3 scripts/sass_report.py /tmp/d.cubin 'term_loop' --classes
// Each loop iteration digests four 16-byte vectors; instructions a vector = loop / 4.
#include <cstdint>

#include "pimhbm/digest.h"
#include "pimhbm/word_muls.cuh"

namespace pimhbm_bench {

using pimhbm::kMul1;
using pimhbm::kMul2;

constexpr uint64_t kPreviousUnitStride = 0x9E3779B97F4A7C15ull;

__device__ __forceinline__ uint64_t previous_unit_term(uint64_t unit, uint64_t key) {
  uint64_t x = unit ^ key;
  x *= kMul1;
  x ^= x >> 32;
  x *= kMul2;
  x ^= x >> 32;
  return x;
}

template <int kWordProducts>
__global__ void term_loop(const uint4* __restrict__ in, uint64_t* out, int n, uint64_t key0) {
  __shared__ uint4 muls[128];
  pimhbm::fill_word_muls(muls);
  uint64_t acc = 0;
  uint64_t key = key0 + 2 * threadIdx.x * kPreviousUnitStride;
#pragma unroll 4
  for (int i = threadIdx.x; i < n; i += 32) {
    const uint4 w = in[i];
    if constexpr (kWordProducts) {
      acc += pimhbm::vector_terms(w, muls[i & 127]);
    } else {
      const uint64_t a = static_cast<uint64_t>(w.y) << 32 | w.x;
      const uint64_t b = static_cast<uint64_t>(w.w) << 32 | w.z;
      acc += previous_unit_term(a, key) + previous_unit_term(b, key + kPreviousUnitStride);
      key += 64 * kPreviousUnitStride;
    }
  }
  out[threadIdx.x] = acc;
}

template __global__ void term_loop<0>(const uint4*, uint64_t*, int, uint64_t);
template __global__ void term_loop<1>(const uint4*, uint64_t*, int, uint64_t);

}  // namespace pimhbm_bench
