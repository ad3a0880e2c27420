// Chunk-level repair and the device copy's commit-or-skip.
//
// repair: rewrites listed chunks of a tensor from a backup copy, in place. Each listed chunk
//   of the source is checked against the source's digest table first (a damaged backup is
//   never copied); the chunk and its table row are copied; the target is checked against its
//   table afterwards. Per listed chunk a status: kRepaired, kSourceDamaged (nothing copied),
//   kStillDamaged (copied, but the target does not verify: a fault while repairing), or
//   kNotListed for padding (-1) entries; kOutOfRange for an index past the tensor.
//
// repair_from: the same, each listed chunk taken from one of several sources (the copies of
//   the tensor on peer devices, read in place): which[k] names the source of entry k; an entry
//   whose source is `self` (this device: nothing to pull) is kNotListed; a source outside
//   [0, count) is kOutOfRange.
//
// repair_packed: the same from chunks packed by entry (Sources::packed), one source.
//
// restore_clean: after a step that did not commit, puts the read side back into the device
//   copy for the chunks that verified (faults[c] == 0) -- the others kept their last good copy,
//   because the update never wrote them to the device copy.
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

constexpr int kMaxSources = 8;  // peers of one group (the GPUs of one host)

struct Sources {
  ChunkedTensor tensor[kMaxSources];
  int count;
  const int32_t* which;  // per listed entry, the source; null: every entry from tensor[0]
  int self;              // entries whose source is `self` are not this device's to repair
  // Packed: tensor[s] holds only the listed chunks, entry k's chunk at row k (chunk_bytes
  // apart) and its digest at table row k -- chunks received from another device, checked
  // against the digest that came with them before they are written.
  bool packed;
};

void repair_from_cpu(const int32_t* chunks, int64_t nlisted, const Sources& sources,
                     const MutableChunkedTensor& dst, int32_t* status);

void repair_cpu(const int32_t* chunks, int64_t nlisted, const ChunkedTensor& src,
                const MutableChunkedTensor& dst, int32_t* status);

void restore_clean_cpu(const int32_t* commit, const int32_t* faults, const ChunkedTensor& src,
                       const MutableChunkedTensor& dst);

// One tensor of a restore_clean over several (the device copy of every leaf of a tree).
struct CleanPair {
  const int32_t* faults;
  ChunkedTensor src;
  MutableChunkedTensor dst;
};
constexpr int kMaxCleanPairs = 64;  // per launch: the list travels in the kernel's parameters

#if defined(PIMHBM_WITH_CUDA)
// `which` (when given) and `chunks` are device memory; the sources' data may be a peer GPU's
// (peer access enabled), read directly by the kernel.
cudaError_t repair_from_cuda(const int32_t* chunks, int64_t nlisted, const Sources& sources,
                             const MutableChunkedTensor& dst, int32_t* status, cudaStream_t stream);

cudaError_t repair_cuda(const int32_t* chunks, int64_t nlisted, const ChunkedTensor& src,
                        const MutableChunkedTensor& dst, int32_t* status, cudaStream_t stream);

cudaError_t restore_clean_cuda(const int32_t* commit, const int32_t* faults,
                               const ChunkedTensor& src, const MutableChunkedTensor& dst,
                               cudaStream_t stream);
// Several tensors in one launch (up to kMaxCleanPairs each): the device copy of every leaf.
cudaError_t restore_clean_cuda(const int32_t* commit, const CleanPair* pairs, size_t count,
                               cudaStream_t stream);
#endif

}  // namespace pimhbm::repair
