// The digest's word multipliers (digest.h) of a chunk's first words, kept in shared memory by
// kernels that digest small chunks: a 16-byte load gives four of them, where word_mul costs
// ~9 instructions a word -- as much as the rest of the digest. Both give the same values.
#pragma once

#include <cuda_runtime.h>

#include "pimhbm/digest.h"

namespace pimhbm {

// The multipliers of words 4 v .. 4 v + 3.
__device__ __forceinline__ uint4 word_muls_of_vector(uint32_t v) {
  const uint32_t w = 4u * v;
  return make_uint4(word_mul(w), word_mul(w + 1), word_mul(w + 2), word_mul(w + 3));
}

// table[v] = the multipliers of words 4 v .. 4 v + 3, for v < kVectors, written by the whole
// block; ends with a barrier, so every thread of the block must call it.
template <int kVectors>
__device__ __forceinline__ void fill_word_muls(uint4 (&table)[kVectors]) {
  for (int v = threadIdx.x; v < kVectors; v += blockDim.x) {
    table[v] = word_muls_of_vector(static_cast<uint32_t>(v));
  }
  __syncthreads();
}

// The terms of four words with their multipliers.
__device__ __forceinline__ uint64_t vector_terms(uint4 words, uint4 muls) {
  return word_term(words.x, muls.x) + word_term(words.y, muls.y) + word_term(words.z, muls.z) +
         word_term(words.w, muls.w);
}

// The terms of two words with their multipliers.
__device__ __forceinline__ uint64_t pair_terms(uint32_t w0, uint32_t w1, uint32_t m0, uint32_t m1) {
  return word_term(w0, m0) + word_term(w1, m1);
}

}  // namespace pimhbm
