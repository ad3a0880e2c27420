// Parity over groups of chunks: the redundancy that lets a damaged chunk be rebuilt in place.
//
// A tensor's bytes are cut into chunks of `chunk_bytes` (as its digests are: digest.h) and the
// chunks into groups of at most `group` chunks, neighbours in different groups (groups.h). The
// parity of a group is the bytewise XOR of its chunks, each zero-padded to chunk_bytes (a short
// last chunk, a short group), so one parity row costs chunk_bytes and a tensor's parity about
// 1/group of its bytes. A chunk is the XOR of its group's parity and the group's other chunks:
// one damaged chunk of a group can be rebuilt, two cannot (the rebuild then fails its digest
// check and says so).
//
// parity: the rows of a tensor from scratch (uint32 words, (groups, chunk_bytes / 4)).
// rebuild: listed chunks rebuilt in place from the parity and checked against the tensor's
//   digest table afterwards. Per listed entry a status (repair.h's values): kRepaired,
//   kStillDamaged (rebuilt, but it does not match its digest: another chunk of its group, or
//   the parity, is damaged too), kNotListed (-1 entries), kOutOfRange (past the tensor), or
//   kGroupConflict (another entry names the same group: neither is rebuilt, since each would
//   read the chunk the other writes).
#pragma once

#include <cstdint>

#include "parity/groups.h"
#include "pimhbm/digest.h"

#if defined(PIMHBM_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace pimhbm::parity {

inline constexpr int32_t kGroupConflict = -4;  // beside repair::Status's values

// Groups of a tensor of `nbytes`.
inline int64_t num_groups(int64_t nbytes, int64_t chunk_bytes, int64_t group) {
  return groups_of_chunks(nbytes == 0 ? 0 : (nbytes + chunk_bytes - 1) / chunk_bytes, group);
}

struct Grouped {  // a tensor's bytes in chunks and groups, its digests and its parity rows
  uint8_t* data;
  int64_t nbytes;
  int64_t chunk_bytes;
  int64_t group;
  const uint32_t* table;  // digests, uint32 (chunks, 2)
  // One int32 in the buffers' memory: the index of chunk 0 in its whole tensor (a shard's
  // digests are the whole tensor's); null: 0. Groups and the list are the buffer's own chunks.
  const int32_t* chunk_base = nullptr;
};

PIMHBM_HD int64_t grouped_base(const Grouped& t) {
  return t.chunk_base != nullptr ? *t.chunk_base : 0;
}

void parity_cpu(const uint8_t* data, int64_t nbytes, int64_t chunk_bytes, int64_t group,
                uint32_t* rows);
void rebuild_cpu(const Grouped& t, const uint32_t* rows, const int32_t* list, int64_t count,
                 int32_t* status);

#if defined(PIMHBM_WITH_CUDA)
cudaError_t parity_cuda(const uint8_t* data, int64_t nbytes, int64_t chunk_bytes, int64_t group,
                        uint32_t* rows, cudaStream_t stream);
cudaError_t rebuild_cuda(const Grouped& t, const uint32_t* rows, const int32_t* list,
                         int64_t count, int32_t* status, cudaStream_t stream);
#endif

}  // namespace pimhbm::parity
