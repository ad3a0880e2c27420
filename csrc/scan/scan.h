// The integrity scan: per-chunk digests, non-finite counts and max |x| of a buffer.
//
// Outputs, for a buffer of `nbytes` cut into n = num_chunks(nbytes, chunk_bytes) chunks:
//   digests[2 * c + 0 / 1]  low / high word of chunk c's digest (digest.h)
//   nonfinite[c]            number of NaN/Inf elements in chunk c (0 for integer dtypes)
//   max_abs[c]              largest |x| over the finite elements of chunk c, as float
//                           (0 when there are none, and for integer dtypes)
// verify compares the digests with an expected table and writes mismatch[c] = 1 or 0.
//
// `chunk_base`: the index, within its whole tensor, of the buffer's chunk 0 -- nonzero when the
// buffer is one shard of a tensor (the chunks of a shard keep their digests of the whole); the
// outputs are indexed by the buffer's own chunks either way.
#pragma once

#include <cstdint>

#include "pimhbm/elem.h"

#if defined(PIMHBM_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace pimhbm::scan {

// ---- CPU reference (plain loops; the CUDA kernels are checked against these) ----

// Digest of one chunk of `len` bytes that is chunk number `chunk` of its buffer.
uint64_t chunk_digest(const uint8_t* p, int64_t len, int64_t chunk);

struct ChunkHealth {
  int32_t nonfinite = 0;
  float max_abs = 0.0f;
};
// Finite check and max |x| of one chunk of `len` bytes of elements of class `elem`.
ChunkHealth chunk_health(const uint8_t* p, int64_t len, Elem elem);

void scan_cpu(const void* data, int64_t nbytes, Elem elem, int64_t chunk_bytes,
              uint32_t* digests, int32_t* nonfinite, float* max_abs, int64_t chunk_base = 0);

void verify_cpu(const void* data, int64_t nbytes, int64_t chunk_bytes, const uint32_t* expected,
                uint8_t* mismatch, int64_t chunk_base = 0);

#if defined(PIMHBM_WITH_CUDA)
// ---- CUDA (same results, bit for bit) ----
// Any pointer alignment is accepted: 16-byte aligned data takes the vector path, anything
// else a byte path. Returns the first CUDA error (launch errors included). `chunk_base`: device
// memory, one int32 (null: 0), read by the kernel so that a compiled program can pass each
// shard its own.
cudaError_t scan_cuda(const void* data, int64_t nbytes, Elem elem, int64_t chunk_bytes,
                      uint32_t* digests, int32_t* nonfinite, float* max_abs,
                      cudaStream_t stream, const int32_t* chunk_base = nullptr);

cudaError_t verify_cuda(const void* data, int64_t nbytes, int64_t chunk_bytes,
                        const uint32_t* expected, uint8_t* mismatch, cudaStream_t stream,
                        const int32_t* chunk_base = nullptr);

// Launch geometry, exposed so that tests can show that results do not depend on it:
// `threads` per block (a multiple of 32, at most 1024), at most `max_blocks` blocks
// (each block loops over chunks). 0 means the default.
struct LaunchShape {
  int threads = 0;
  int max_blocks = 0;
};
cudaError_t scan_cuda_shaped(const void* data, int64_t nbytes, Elem elem, int64_t chunk_bytes,
                             uint32_t* digests, int32_t* nonfinite, float* max_abs,
                             cudaStream_t stream, LaunchShape shape,
                             const int32_t* chunk_base = nullptr);
#endif

}  // namespace pimhbm::scan
