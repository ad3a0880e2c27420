// The integrity scan: per-chunk digests, non-finite counts and max |x| of a buffer.
//
// Outputs, for a buffer of `nbytes` cut into n = num_chunks(nbytes, chunk_bytes) chunks:
//   digests[2 * c + 0 / 1]  low / high word of chunk c's digest (digest.h)
//   nonfinite[c]            number of NaN/Inf elements in chunk c (0 for integer dtypes)
//   max_abs[c]              largest |x| over the finite elements of chunk c, as float
//                           (0 when there are none, and for integer dtypes)
// verify compares the digests with an expected table and writes mismatch[c] = 1 or 0.
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
              uint32_t* digests, int32_t* nonfinite, float* max_abs);

void verify_cpu(const void* data, int64_t nbytes, int64_t chunk_bytes, const uint32_t* expected,
                uint8_t* mismatch);

#if defined(PIMHBM_WITH_CUDA)
// ---- CUDA (same results, bit for bit) ----
// Any pointer alignment is accepted: 16-byte aligned data takes the vector path, anything
// else a byte path. Returns the first CUDA error (launch errors included).
cudaError_t scan_cuda(const void* data, int64_t nbytes, Elem elem, int64_t chunk_bytes,
                      uint32_t* digests, int32_t* nonfinite, float* max_abs,
                      cudaStream_t stream);

cudaError_t verify_cuda(const void* data, int64_t nbytes, int64_t chunk_bytes,
                        const uint32_t* expected, uint8_t* mismatch, cudaStream_t stream);

// Launch geometry, exposed so that tests can show that results do not depend on it:
// `threads` per block (a multiple of 32, at most 1024), at most `max_blocks` blocks
// (each block loops over chunks). 0 means the default.
struct LaunchShape {
  int threads = 0;
  int max_blocks = 0;
};
cudaError_t scan_cuda_shaped(const void* data, int64_t nbytes, Elem elem, int64_t chunk_bytes,
                             uint32_t* digests, int32_t* nonfinite, float* max_abs,
                             cudaStream_t stream, LaunchShape shape);
#endif

}  // namespace pimhbm::scan
