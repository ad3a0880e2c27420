// Digest of one chunk by one thread block: for kernels that handle a few chunks (repair,
// restore), where plain and obviously right beats fast. The scan kernels have their own,
// tuned version of the same sum (scan_cuda.cu); both are checked against the CPU reference.
#pragma once

#include <cuda_runtime.h>

#include "pimhbm/digest.h"

namespace pimhbm {

// Sum over the block, returned to every thread. `scratch` holds 32 values.
__device__ __forceinline__ uint64_t block_sum_u64(uint64_t v, uint64_t* scratch) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, off);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < static_cast<int>(blockDim.x >> 5) ? scratch[lane] : 0;
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, off);
  __syncthreads();
  return v;
}

// Digest of `len` bytes at `p` (chunk number `chunk`); every thread of the block gets it.
// Whole units are read as 8-byte words where `p` is 8-byte aligned, byte by byte else; the
// short last unit (a buffer's last chunk only) is read by thread 0 alone, one byte per
// iteration of a loop that stops at the end -- no load is ever issued past the buffer, not
// even a predicated-off one (a tail read with predicated byte loads came out wrong under
// compute-sanitizer memcheck for 1-3 byte tails, while plain runs matched).
__device__ __forceinline__ uint64_t block_chunk_digest(const uint8_t* p, int64_t len,
                                                       uint64_t chunk, uint64_t* scratch) {
  const int64_t whole = len / 8;
  const bool aligned = reinterpret_cast<uintptr_t>(p) % 8 == 0;
  uint64_t acc = 0;
  for (int64_t i = threadIdx.x; i < whole; i += blockDim.x) {
    uint64_t u;
    if (aligned) {
      u = reinterpret_cast<const uint64_t*>(p)[i];
    } else {
      u = 0;
      for (int b = 0; b < 8; ++b) u |= static_cast<uint64_t>(p[8 * i + b]) << (8 * b);
    }
    acc += unit_terms(u, static_cast<uint64_t>(i));
  }
  const int rest = static_cast<int>(len - 8 * whole);
  if (rest > 0 && threadIdx.x == 0) {
    uint64_t u = 0;
    for (int b = 0; b < rest; ++b) u |= static_cast<uint64_t>(p[8 * whole + b]) << (8 * b);
    acc += unit_terms(u, static_cast<uint64_t>(whole));
  }
  return finalize(block_sum_u64(acc, scratch), static_cast<uint64_t>(len), chunk);
}

// Copies `len` bytes from src to dst with the whole block (16-byte words when both are
// aligned). Ends with a barrier: the copy is visible to the block afterwards.
__device__ __forceinline__ void block_copy(const uint8_t* src, uint8_t* dst, int64_t len) {
  const bool vec = (reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst)) % 16 == 0;
  const int64_t nvec = vec ? len / 16 : 0;
  for (int64_t i = threadIdx.x; i < nvec; i += blockDim.x) {
    reinterpret_cast<uint4*>(dst)[i] = reinterpret_cast<const uint4*>(src)[i];
  }
  for (int64_t i = 16 * nvec + threadIdx.x; i < len; i += blockDim.x) dst[i] = src[i];
  __syncthreads();
}

}  // namespace pimhbm
