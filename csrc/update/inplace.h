// The guarded AdamW update in place: one copy of the state, kept redundant by parity groups.
//
// The caller decides before the update whether the step may commit at all (`go`: every gradient
// finite, the parameters intact after the backward pass read them, the step scalars valid --
// python/pimhbm/inplace.py; options leave the first two to this update, whose caller then
// withholds the commit where it kept elements or, speculatively, found a damaged parameter).
// Given go, the update reads every chunk of the state and its gradient once and writes the new
// state over the old one. What it finds from there on is local to a chunk:
//
// * A chunk whose state does not match its digests (damage to the master weights, the moments,
//   or a parameter after the backward pass read it) is not written: it keeps its state, digests
//   and place in the parity, and its gradient goes into the stash. The damaged tensors' old
//   state is then their group's parity XOR the group's other chunks (parity/parity.h rebuilds
//   them), and the redo call updates the chunk from there with the stashed gradient -- the step
//   is complete without a replay. Two chunks of one group damaged in the same tensor cannot both
//   be rebuilt.
// * An element whose new values are not all finite (a learning rate or eps that makes the
//   update divide by zero or overflow) keeps its old values; the chunk counts it (`kept`).
//
// Parity: the rows of each tensor of a leaf (parity.h: the XOR of up to `group` chunks, which
// parity/groups.h deals so that neighbouring chunks sit in different groups).
// Where every chunk of a group commits, its rows are written anew as the XOR of the new chunks:
// the old rows are not read, and a row damaged since the last step is whole again. Where a
// chunk of the group is left unwritten (damaged), its correct bytes exist only in the old rows,
// so those are updated instead by the XOR of each committed chunk's old and new bytes (as is
// every row a redo touches). One warp handles a whole group on the GPU, so a row has one writer.
// group 0: no parity (data-parallel replicas are the redundancy).
//
// go == 0: nothing is written; the fault maps are the checks' (kFaultParam where p's chunk was
// found damaged before the update, InPlaceLeaf::checked), every other report is zero.
#pragma once

#include <cstddef>
#include <cstdint>

#include "pimhbm/adamw_math.h"
#include "update/adamw.h"

#if defined(PIMHBM_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace pimhbm::update {

// The chunk sizes the GPU kernel takes: a warp holds a whole chunk in registers (4, 8 or 16
// elements a lane) so that the chunk verifies before its first write.
inline constexpr int64_t kInPlaceChunkElems[] = {128, 256, 512};
inline bool inplace_chunk_ok(int64_t chunk_elems) {
  for (int64_t c : kInPlaceChunkElems) {
    if (c == chunk_elems) return true;
  }
  return false;
}

struct InPlaceLeaf {
  int64_t n = 0;
  int64_t chunk_elems = 0;
  int64_t group = 0;    // chunks per parity group; 0: no parity
  int32_t index = 0;    // the leaf's position in its call (stash rows name leaves by it)
  bool param_bf16 = false;
  bool has_master = false;  // bf16 parameters only; remainders as in adamw.h

  void* p = nullptr;  // the state, updated in place
  uint16_t* master = nullptr;
  float* mu = nullptr;
  float* nu = nullptr;
  uint32_t* d_p = nullptr;  // digest tables (nchunks, 2), updated in place
  uint32_t* d_master = nullptr;
  uint32_t* d_mu = nullptr;
  uint32_t* d_nu = nullptr;
  uint32_t* q_p = nullptr;  // parity rows (groups, chunk bytes / 4), updated in place
  uint32_t* q_master = nullptr;
  uint32_t* q_mu = nullptr;
  uint32_t* q_nu = nullptr;
  const void* g = nullptr;  // the gradient (a full update), or null (a redo: from the stash)

  int32_t* faults = nullptr;  // per chunk: FaultBits of the digests that did not match
  int32_t* kept = nullptr;    // per chunk: elements kept because their new values were not finite
  // One int32 in the buffers' memory: the index of chunk 0 in the leaf's whole tensor (nonzero
  // for a shard: its digests are the whole tensor's; parity groups and the stash are the
  // shard's own); null: 0.
  const int32_t* chunk_base = nullptr;
  // The update's checks' map of p (non-zero: the chunk no longer matched its digest), or null
  // (a redo, or no checks before the update: pimhbm.inplace.ParameterChecks.IN_UPDATE). A
  // skipped step's fault map is this one (kFaultParam where damaged): the step's report then
  // needs no XLA op a leaf to merge the two.
  const int32_t* checked = nullptr;
};

// The index in the whole tensor of the leaf's chunk c: what its digests are keyed by.
PIMHBM_HD uint64_t inplace_key_chunk(const InPlaceLeaf& leaf, int64_t c) {
  return static_cast<uint64_t>((leaf.chunk_base != nullptr ? *leaf.chunk_base : 0) + c);
}

// The gradients of the chunks that did not commit: row k holds chunk (leaf, chunk) = index[k][0..1]
// -- its gradient bytes, chunk_elems words a row, zero-padded -- and index[k][2], the FaultBits of
// its damaged tensors; unused rows have index (-1, -1, 0).
inline constexpr int kStashIndexColumns = 3;
struct Stash {
  uint32_t* rows = nullptr;
  int32_t* index = nullptr;
  int64_t capacity = 0;
};

struct StashIn {  // the same, read by a redo
  const uint32_t* rows = nullptr;
  const int32_t* index = nullptr;
  int64_t entries = 0;
};

// The call's totals (64-bit counters), by position: chunks that did not commit; elements kept;
// chunks offered to the stash (more than its capacity: some could not be stashed); of the
// chunks that did not commit, those whose parameter was damaged (with no checks before the
// writes, the gradients may have read it). Python reads them by the names (inplace_calls.py).
enum InPlaceTotal : int { kTotalFaulty, kTotalKept, kTotalStashed, kTotalSuspect };
inline constexpr const char* kInPlaceTotalNames[] = {"faulty", "kept", "stashed", "suspect"};
inline constexpr int kInPlaceTotals = 4;
static_assert(sizeof(kInPlaceTotalNames) / sizeof(kInPlaceTotalNames[0]) == kInPlaceTotals);

PIMHBM_HD int64_t inplace_chunks(const InPlaceLeaf& leaf) {
  return leaf.n == 0 ? 0 : (leaf.n + leaf.chunk_elems - 1) / leaf.chunk_elems;
}
// Parity groups (chunks, when the leaf has no parity).
PIMHBM_HD int64_t inplace_groups(const InPlaceLeaf& leaf) {
  const int64_t per = leaf.group > 0 ? leaf.group : 1;
  return (inplace_chunks(leaf) + per - 1) / per;
}

// CPU reference. step: lr, 1 - b1^t, 1 - b2^t; go: the verdict (host memory).
void inplace_cpu(const InPlaceLeaf* leaves, size_t count, const AdamWHyper& hyper,
                 const float* step, const int32_t* go, const Stash& stash, uint64_t* totals);
// The stashed chunks updated (their damaged tensors rebuilt first), each committing where it
// verifies. Entries of one parity group are taken in order by one writer (on the GPU, a warp).
void redo_cpu(const InPlaceLeaf* leaves, size_t count, const AdamWHyper& hyper, const float* step,
              const StashIn& stash, uint64_t* totals);

#if defined(PIMHBM_WITH_CUDA)
cudaError_t inplace_cuda(const InPlaceLeaf* leaves, size_t count, const AdamWHyper& hyper,
                         const float* step, const int32_t* go, const Stash& stash,
                         uint64_t* totals, cudaStream_t stream);
cudaError_t redo_cuda(const InPlaceLeaf* leaves, size_t count, const AdamWHyper& hyper,
                      const float* step, const StashIn& stash, uint64_t* totals,
                      cudaStream_t stream);
#endif

}  // namespace pimhbm::update
