// Launch variants of the fused guarded AdamW update that lost to the library's own kernels
// (csrc/update/adamw_cuda.cu; the measurements are in bench/NOTES.md). They are kept here, out
// of the library, so that the kernel benchmark can still time them beside the library's kernel
// and check that they give the same bits (adamw_variants_test.cu); llm.c keeps its losing
// kernels in dev/ the same way. Every variant is built from the library's device code
// (csrc/update/adamw_kernel.cuh), so a change there reaches them too.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <string>

#include "update/adamw.h"

namespace pimhbm::bench {

// How the device copy's chunk verdict is had before the chunk's first write:
//   kRegisters     one read: each thread keeps its groups of the chunk in registers while the
//                  block checks the old digests (chunks of at most 4096 elements; larger ones
//                  fall back to kTwoReadsKeep);
//   kTwoReads      the chunk read twice, both times with evict-first loads;
//   kTwoReadsKeep  read twice, the first time with plain loads so that L2 keeps the lines.
// kDefault: the library's choice (kRegisters where the chunk fits, except with master weights:
// kTwoReadsKeep).
enum class CopyPass { kDefault = 0, kRegisters, kTwoReads, kTwoReadsKeep };

// A launch of the update.
// groups_in_flight: groups of four elements each thread loads before computing them (1 or 2;
// 0 = 1; not used by kRegisters).
// prefetch: without the device copy and with one group in flight, each thread also prefetches
// into L2 the group it will load this many iterations later (0 = off; 2 or 4; v5): loads in
// flight without the registers to hold them.
// stages: without the device copy, each thread's loads go through shared memory in a pipeline
// of this many groups (asynchronous copies: the next stages-1 groups are in flight while one
// is computed; 0 = off, else 2-4; takes precedence over groups_in_flight and prefetch).
// min_blocks: without the device copy, one group in flight and no prefetch, the blocks per SM
// the kernel is compiled to keep resident: 0 = 3; 3; 4 (at most 64 registers, a few spills:
// 32 warps per SM instead of 24; v8).
// plain_loads: without the device copy, one group in flight: plain loads instead of
// evict-first ones (the library's choice, v10); the options above (2 groups, prefetch, stages,
// 4 blocks) take precedence and keep their evict-first loads.
struct AdamWVariant {
  int groups_in_flight = 0;
  CopyPass copy_pass = CopyPass::kDefault;
  int prefetch = 0;
  int stages = 0;
  int min_blocks = 0;
  bool plain_loads = false;
};

// The variant that is the library's own launch: the same bits, the same shape of kernel.
inline AdamWVariant library_launch() {
  AdamWVariant v;
  v.plain_loads = true;
  return v;
}

// "2 groups in flight, 3 stages, ..." for a table row or a test's message.
std::string describe(const AdamWVariant& v);

// The update of every leaf through the variant (cudaErrorInvalidValue for options out of
// range, before anything runs); leaves of a kind go in one launch, as in the library.
cudaError_t adamw_variant(const update::AdamWLeaf* leaves, size_t count, const AdamWHyper& hyper,
                          const float* step, cudaStream_t stream, const AdamWVariant& v);
inline cudaError_t adamw_variant(const update::AdamWLeaf& leaf, const AdamWHyper& hyper,
                                 const float* step, cudaStream_t stream, const AdamWVariant& v) {
  return adamw_variant(&leaf, 1, hyper, step, stream, v);
}

// Blocks per SM the variant's kernel without the device copy keeps resident (for the table).
cudaError_t variant_blocks_per_sm(bool bf16, bool master, const AdamWVariant& v, int* blocks);

}  // namespace pimhbm::bench
