// The guarded AdamW update of one parameter tensor, in one pass over memory.
//
// It reads the current state (parameter, optional fp32 master weight stored as the parameter
// and a 16-bit remainder, fp32 moments) and the gradient, checks every chunk of the state
// against the digest table written by the previous update, counts non-finite gradient
// values, and writes the updated state -- with its new digest tables -- into the other copy of
// the state (the write side). Nothing is written to the read side, so a step that must not
// commit leaves it bit-identical: the caller decides commit or skip after every tensor is
// done (restore.h), on the device.
//
// Optionally it also writes the new state into a device copy (the mirror, a backup for
// chunk-level repair) -- but only for chunks whose read side verified, so that a damaged
// chunk never overwrites its last good copy. (On the GPU this needs the chunk's verdict before
// its first write: the kernel reads the chunk twice, the second time from L2.)
#pragma once

#include <cstdint>

#include "pimhbm/adamw_math.h"

#if defined(PIMHBM_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace pimhbm::update {

// Bits of the per-chunk fault map: which state tensor failed its digest check.
enum FaultBits : int32_t {
  kFaultParam = 1,
  kFaultMaster = 2,
  kFaultMu = 4,
  kFaultNu = 8,
};

struct AdamWLeaf {
  int64_t n = 0;            // elements
  int64_t chunk_elems = 0;  // elements per chunk (the same chunks for every tensor of the leaf)
  bool param_bf16 = false;  // parameter and gradient dtype: bf16 (else fp32)
  // fp32 master weights (only with bf16 parameters), stored split: p and a uint16 remainder
  // (split_master in adamw_math.h), so `master` below points to the remainders.
  bool has_master = false;

  // read side: the state as committed by the previous update, and the gradient
  const void* p = nullptr;
  const uint16_t* master = nullptr;
  const float* mu = nullptr;
  const float* nu = nullptr;
  const void* g = nullptr;
  const uint32_t* d_p = nullptr;  // digest tables, uint32 (nchunks, 2)
  const uint32_t* d_master = nullptr;
  const uint32_t* d_mu = nullptr;
  const uint32_t* d_nu = nullptr;

  // write side
  void* p_out = nullptr;
  uint16_t* master_out = nullptr;
  float* mu_out = nullptr;
  float* nu_out = nullptr;
  uint32_t* dn_p = nullptr;
  uint32_t* dn_master = nullptr;
  uint32_t* dn_mu = nullptr;
  uint32_t* dn_nu = nullptr;

  // optional mirror (the device copy): written with the write side, chunk by chunk, only
  // where every tensor of the chunk verified
  bool has_mirror = false;
  void* p_mirror = nullptr;
  uint16_t* master_mirror = nullptr;
  float* mu_mirror = nullptr;
  float* nu_mirror = nullptr;
  uint32_t* dm_p = nullptr;
  uint32_t* dm_master = nullptr;
  uint32_t* dm_mu = nullptr;
  uint32_t* dm_nu = nullptr;

  // per-chunk reports
  int32_t* faults = nullptr;          // FaultBits
  int32_t* grad_nonfinite = nullptr;  // NaN/Inf gradient values

  // Totals over every leaf of a call (all leaves point to the same two counters, or null):
  // [0] chunks with a fault, [1] NaN/Inf gradient values. 64 bits, so that no count of a real
  // model wraps (a count wrapped to 0 would let a faulty step commit). The caller zeroes them
  // first. They spare the caller a reduction over every report map: only chunks with
  // something to report add to them, so the common step adds nothing.
  uint64_t* totals = nullptr;
};

int64_t leaf_chunks(const AdamWLeaf& leaf);

// CPU reference: plain loops, digests through scan::chunk_digest.
// `step` holds lr, 1 - b1^t, 1 - b2^t (host memory).
void adamw_cpu(const AdamWLeaf& leaf, const AdamWHyper& hyper, const float* step);

#if defined(PIMHBM_WITH_CUDA)
// How the device copy's chunk verdict is had before the chunk's first write (results are the
// same bit for bit; the benchmark compares):
//   kRegisters     one read: each thread keeps its groups of the chunk in registers while the
//                  block checks the old digests (chunks of at most 4096 elements; larger ones
//                  fall back to kTwoReadsKeep);
//   kTwoReads      the chunk read twice, both times with evict-first loads;
//   kTwoReadsKeep  read twice, the first time with plain loads so that L2 keeps the lines.
// kDefault: kRegisters where the chunk fits, except with master weights (kTwoReadsKeep: faster
// on the H200 there, see bench/NOTES.md).
enum class MirrorPass { kDefault = 0, kRegisters, kTwoReads, kTwoReadsKeep };

// How the kernel is run: groups of four elements each thread loads before computing them
// (1 or 2; 0 = the default, 1; not used by kRegisters), and the device copy's pass.
// prefetch: without the device copy and with one group in flight, each thread also prefetches
// into L2 the group it will load this many iterations later (0 = off; 2 or 4). An experiment
// (bench/NOTES.md, v5): loads in flight without the registers to hold them.
// stages: without the device copy, each thread's loads go through shared memory in a pipeline
// of this many groups (asynchronous copies: the next stages-1 groups are in flight while one
// is computed; 0 = off, else 2-4; takes precedence over groups_in_flight and prefetch).
// min_blocks: without the device copy, one group in flight and no prefetch, the blocks per SM
// the kernel is compiled to keep resident: 0 = the default, 3 (at most 85 registers); 4 (at
// most 64 registers, a few spills: 32 warps per SM instead of 24; an experiment, v8).
// plain_loads: without the device copy, one group in flight: plain loads instead of
// evict-first ones (bench/NOTES.md, v10); the options above (2 groups, prefetch, stages, 4
// blocks) take precedence and keep their evict-first loads.
struct AdamWLaunch {
  int groups_in_flight = 0;
  MirrorPass mirror_pass = MirrorPass::kDefault;
  int prefetch = 0;
  int stages = 0;
  int min_blocks = 0;
  bool plain_loads = false;
};

// The launch the FFI handler uses when the call does not choose one (kernel = 0): the chunk
// loop with plain loads, 5 % faster than evict-first ones on the H200 (bench/NOTES.md, v10).
// The device copy's passes are unaffected.
inline AdamWLaunch default_launch() {
  AdamWLaunch launch;
  launch.plain_loads = true;
  return launch;
}

// Groups of four elements per thread that kRegisters keeps for chunks of `chunk_elems`
// elements (1, 2 or 4), or 0 when such chunks do not fit.
int resident_groups(int64_t chunk_elems);

// Blocks per SM the update kernel without the device copy can keep resident (one group in
// flight, or the shared-memory pipeline of `stages` stages): for the benchmark's table.
cudaError_t adamw_blocks_per_sm(bool bf16, bool master, int stages, int* blocks,
                                int min_blocks = 0);

// The fused kernel; `step` points to lr, bc1, bc2 in device memory (no host sync).
cudaError_t adamw_cuda(const AdamWLeaf& leaf, const AdamWHyper& hyper, const float* step,
                       cudaStream_t stream, AdamWLaunch options = {});
// Every leaf of a tree: one launch per kind of leaf (fp32, bf16, bf16 + master; with or
// without the mirror), up to 64 leaves each, blocks spread over the chunks of all of them.
cudaError_t adamw_cuda(const AdamWLeaf* leaves, size_t count, const AdamWHyper& hyper,
                       const float* step, cudaStream_t stream, AdamWLaunch options = {});
#endif

}  // namespace pimhbm::update
