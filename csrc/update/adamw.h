// The guarded AdamW update of one parameter tensor, in one pass over memory.
//
// It reads the current state (parameter, optional fp32 master weight stored as the parameter
// and a 16-bit remainder, fp32 moments) and the gradient, checks every chunk of the state
// against the digest table written by the previous update, counts the elements whose gradient
// or new values are not finite, and writes the updated state -- with its new digest tables --
// into the other copy of the state (the write side). Nothing is written to the read side, so a
// step that must not commit leaves it bit-identical: the caller decides commit or skip after
// every tensor is done (restore.h), on the device.
//
// Optionally it also writes the new state into a device copy (a backup for chunk-level
// repair) -- but only for chunks whose read side verified, so that a damaged chunk never
// overwrites its last good copy. (On the GPU this needs the chunk's verdict before its first
// write: see adamw_cuda below.)
#pragma once

#include <cstdint>

#include "pimhbm/adamw_math.h"

#if defined(PIMHBM_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

// The hyperparameter attributes of every update op's FFI binding (AdamWHyper's fields, in
// order): a suffix of the binding's chain, after its operands and results.
#define PIMHBM_ADAMW_HYPER_ATTRS \
  .Attr<float>("b1")             \
      .Attr<float>("b2")         \
      .Attr<float>("one_minus_b1") \
      .Attr<float>("one_minus_b2") \
      .Attr<float>("eps")        \
      .Attr<float>("eps_root")   \
      .Attr<float>("weight_decay")

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

  // optional device copy: written with the write side, chunk by chunk, only where every
  // tensor of the chunk verified
  bool has_copy = false;
  void* p_copy = nullptr;
  uint16_t* master_copy = nullptr;
  float* mu_copy = nullptr;
  float* nu_copy = nullptr;
  uint32_t* dc_p = nullptr;
  uint32_t* dc_master = nullptr;
  uint32_t* dc_mu = nullptr;
  uint32_t* dc_nu = nullptr;

  // per-chunk reports
  int32_t* faults = nullptr;          // FaultBits
  // elements whose new values are not all finite: a NaN/Inf gradient value, or eps 0 where a
  // moment is 0, or an overflow (the step then commits nothing)
  int32_t* grad_nonfinite = nullptr;

  // Totals over every leaf of a call (all leaves point to the same two counters, or null):
  // [0] chunks with a fault, [1] the elements grad_nonfinite counts. 64 bits, so that no count of
  // a real model wraps (a count wrapped to 0 would let a faulty step commit). The caller zeroes
  // them first. They spare the caller a reduction over every report map: only chunks with
  // something to report add to them, so the common step adds nothing.
  uint64_t* totals = nullptr;
};

int64_t leaf_chunks(const AdamWLeaf& leaf);

// CPU reference: plain loops, digests through scan::chunk_digest.
// `step` holds lr, 1 - b1^t, 1 - b2^t (host memory).
void adamw_cpu(const AdamWLeaf& leaf, const AdamWHyper& hyper, const float* step);

#if defined(PIMHBM_WITH_CUDA)
// The fused kernel; `step` points to lr, bc1, bc2 in device memory (no host sync).
//   Without the device copy: the chunk loop, one group of four elements per thread at a time,
//   with plain loads (5 % faster than evict-first ones on the H200: bench/NOTES.md, v10).
//   With it, the chunk's verdict must be known before its first write: each thread keeps its
//   groups of the chunk in registers while the block checks the old digests (chunks of at most
//   4096 elements), except with master weights -- their five tensors per group take 128
//   registers there -- and for larger chunks, where the chunk is read twice, the first time
//   with plain loads so that L2 keeps the lines for the second (bench/NOTES.md, v3).
// The launch variants that lost to these live in bench/adamw_variants.cuh.
cudaError_t adamw_cuda(const AdamWLeaf& leaf, const AdamWHyper& hyper, const float* step,
                       cudaStream_t stream);
// Every leaf of a tree: one launch per kind of leaf (fp32, bf16, bf16 + master; with or
// without the device copy), up to 64 leaves each, blocks spread over the chunks of all of them.
cudaError_t adamw_cuda(const AdamWLeaf* leaves, size_t count, const AdamWHyper& hyper,
                       const float* step, cudaStream_t stream);

// Groups of four elements per thread that the device copy's one-read pass keeps for chunks of
// `chunk_elems` elements (1, 2 or 4), or 0 when such chunks do not fit.
int resident_groups(int64_t chunk_elems);
#endif

}  // namespace pimhbm::update
