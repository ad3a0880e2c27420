// Chunk-level repair and the mirror's commit-or-skip.
//
// repair: rewrites listed chunks of a tensor from a backup copy, in place. Each listed chunk
//   of the source is checked against the source's digest table first (a damaged backup is
//   never copied); the chunk and its table row are copied; the target is checked against its
//   table afterwards. Per listed chunk a status: kRepaired, kSourceDamaged (nothing copied),
//   kStillDamaged (copied, but the target does not verify: a fault while repairing), or
//   kNotListed for padding (-1) entries; kOutOfRange for an index past the tensor.
//
// restore_clean: after a step that did not commit, puts the read side back into the mirror
//   for the chunks that verified (faults[c] == 0) -- the others kept their last good copy,
//   because the update never wrote them to the mirror.
#pragma once

#include <cstdint>

#if defined(PIMHBM_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace pimhbm::repair {

enum Status : int32_t {
  kNotListed = 0,
  kRepaired = 1,
  kSourceDamaged = -1,
  kStillDamaged = -2,
  kOutOfRange = -3,
};

struct ChunkedTensor {  // a tensor's bytes and its digest table
  const uint8_t* data;
  int64_t nbytes;
  int64_t chunk_bytes;
  const uint32_t* table;  // uint32 (nchunks, 2)
};

struct MutableChunkedTensor {
  uint8_t* data;
  int64_t nbytes;
  int64_t chunk_bytes;
  uint32_t* table;
};

void repair_cpu(const int32_t* chunks, int64_t nlisted, const ChunkedTensor& src,
                const MutableChunkedTensor& dst, int32_t* status);

void restore_clean_cpu(const int32_t* commit, const int32_t* faults, const ChunkedTensor& src,
                       const MutableChunkedTensor& dst);

#if defined(PIMHBM_WITH_CUDA)
cudaError_t repair_cuda(const int32_t* chunks, int64_t nlisted, const ChunkedTensor& src,
                        const MutableChunkedTensor& dst, int32_t* status, cudaStream_t stream);

cudaError_t restore_clean_cuda(const int32_t* commit, const int32_t* faults,
                               const ChunkedTensor& src, const MutableChunkedTensor& dst,
                               cudaStream_t stream);
#endif

}  // namespace pimhbm::repair
