// The checks that decide, before the in-place update writes anything, whether the step may run
// (inplace.h): every parameter chunk still matches its digest -- the backward pass read it
// intact -- and the square of every gradient value is finite. One pass over p and g (4 bytes a
// bf16 parameter), every leaf of the call in one launch.
//
// Per chunk of `chunk_elems` elements of a leaf (the last one may be short):
//   damaged[c]    1 where p's chunk no longer matches its digest (digest.h, chunks of
//                 chunk_elems * sizeof(p) bytes), else 0 -- as scan.h's verify
//   nonfinite[c]  gradient values g of the chunk with float(g) * float(g) not finite (NaN or
//                 infinite g, or |g| so large that AdamW's second moment overflows); 0 where
//                 the call has no gradients (g null: p's digests alone, 2 bytes a bf16
//                 parameter -- the update then finds non-finite gradients itself, as elements
//                 it keeps)
// and, over every leaf of the call, totals[0] the damaged chunks and totals[1] the non-finite
// values: the verdict needs only these, so no reduction of the maps follows the call.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "pimhbm/digest.h"

#if defined(PIMHBM_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace pimhbm::update {

inline constexpr int kPrecheckTotals = 2;  // damaged chunks, non-finite gradient values

struct PrecheckLeaf {
  int64_t n = 0;
  int64_t chunk_elems = 0;
  bool bf16 = false;  // p and g: bfloat16, else float32
  const void* p = nullptr;
  const uint32_t* d_p = nullptr;  // p's digest table (chunks, 2)
  const void* g = nullptr;  // null: no gradient checked (nonfinite 0); alike in a call
  int32_t* damaged = nullptr;
  int32_t* nonfinite = nullptr;
  // One int32 in the buffers' memory: the index of p's chunk 0 in its whole tensor (nonzero for
  // a shard: its digests are the whole tensor's); null: 0.
  const int32_t* chunk_base = nullptr;
};

PIMHBM_HD int64_t precheck_base(const PrecheckLeaf& L) {
  return L.chunk_base != nullptr ? *L.chunk_base : 0;
}

PIMHBM_HD int64_t precheck_chunks(const PrecheckLeaf& L) {
  return L.n == 0 ? 0 : (L.n + L.chunk_elems - 1) / L.chunk_elems;
}

// Whether g * g (rounded to float) is NaN or infinite; `bits`: g's bits (bf16 in the low half).
PIMHBM_HD bool square_nonfinite(uint32_t bits, bool bf16) {
  const uint32_t f32 = bf16 ? bits << 16 : bits;
#if defined(__CUDA_ARCH__)
  const float g = __uint_as_float(f32);
  const uint32_t s = __float_as_uint(__fmul_rn(g, g));
#else
  float g;
  std::memcpy(&g, &f32, sizeof(g));
  const float sq = g * g;
  uint32_t s;
  std::memcpy(&s, &sq, sizeof(s));
#endif
  return (s & 0x7FFFFFFFu) >= 0x7F800000u;
}

// CPU reference.
void precheck_cpu(const PrecheckLeaf* leaves, size_t count, uint64_t* totals);

#if defined(PIMHBM_WITH_CUDA)
// The same results, bit for bit; p and g must be 16-byte aligned (the handler checks).
cudaError_t precheck_cuda(const PrecheckLeaf* leaves, size_t count, uint64_t* totals,
                          cudaStream_t stream);
#endif

}  // namespace pimhbm::update
