// The losing launch variants of the guarded update (adamw_variants.cuh), built from the
// library's device code. Each kernel here is one of them; `launch_kind` picks it from an
// AdamWVariant the way the library's launcher picks its own.
#include <cuda_runtime.h>

#include <algorithm>

#include "adamw_variants.cuh"
#include "pimhbm/cuda_check.h"
#include "update/adamw_kernel.cuh"

namespace pimhbm::bench {
namespace {

using namespace update::kernel;  // NOLINT: the library's building blocks
using update::AdamWLeaf;

// A hint that group e (elements e..e+3) of every tensor will be read soon: the lines go to L2
// without taking registers, so a thread's next loads wait on L2 instead of DRAM. A warp's
// prefetch covers its 32 groups' lines, like its load would.
__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}
template <bool kBF16, bool kMaster>
__device__ __forceinline__ void prefetch_group(const AdamWLeaf& L, int64_t e) {
  constexpr int psize = kBF16 ? 2 : 4;
  prefetch_l2(static_cast<const char*>(L.p) + e * psize);
  prefetch_l2(static_cast<const char*>(L.g) + e * psize);
  prefetch_l2(L.mu + e);
  prefetch_l2(L.nu + e);
  if constexpr (kMaster) prefetch_l2(L.master + e);
}

// Asynchronous copies global -> shared (sm_80+): the copy runs while the thread computes; it
// waits for a copy only when it needs the data. 16-byte copies bypass L1 (.cg); 8-byte ones
// (bf16 groups) must go through it (.ca).
template <int kBytes>
__device__ __forceinline__ void cp_async(void* dst, const void* src) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  if constexpr (kBytes == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(src) : "memory");
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;" ::"r"(s), "l"(src), "n"(kBytes)
                 : "memory");
  }
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;" ::: "memory");
}
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {  // all but the newest kPending groups done
  asm volatile("cp.async.wait_group %0;" ::"n"(kPending) : "memory");
}

// One stage of the pipeline: a group of every tensor for every thread of the block, tensor by
// tensor, thread by thread (a warp's 16-byte reads of shared memory are conflict-free).
template <bool kBF16, bool kMaster>
struct Stage {
  static constexpr int kPBytes = kBF16 ? 8 : 16;  // four elements of the parameter / gradient
  static constexpr int kG = kPBytes * kThreads;   // offsets of the tensors in the stage
  static constexpr int kMu = 2 * kG;
  static constexpr int kNu = kMu + 16 * kThreads;
  static constexpr int kMaster_ = kNu + 16 * kThreads;
  static constexpr int kBytes = kMaster_ + (kMaster ? 8 * kThreads : 0);
};

template <bool kBF16, bool kMaster>
__device__ __forceinline__ void stage_issue(char* st, const AdamWLeaf& L, int64_t e) {
  using S = Stage<kBF16, kMaster>;
  constexpr int psize = kBF16 ? 2 : 4;
  const int t = threadIdx.x;
  cp_async<S::kPBytes>(st + t * S::kPBytes, static_cast<const char*>(L.p) + e * psize);
  cp_async<S::kPBytes>(st + S::kG + t * S::kPBytes, static_cast<const char*>(L.g) + e * psize);
  cp_async<16>(st + S::kMu + 16 * t, L.mu + e);
  cp_async<16>(st + S::kNu + 16 * t, L.nu + e);
  if constexpr (kMaster) cp_async<8>(st + S::kMaster_ + 8 * t, L.master + e);
}

template <bool kBF16, bool kMaster>
__device__ __forceinline__ void stage_read(const char* st, Group& x) {
  using S = Stage<kBF16, kMaster>;
  const int t = threadIdx.x;
  if constexpr (kBF16) {
    const uint2 p = *reinterpret_cast<const uint2*>(st + t * S::kPBytes);
    const uint2 g = *reinterpret_cast<const uint2*>(st + S::kG + t * S::kPBytes);
    x.p[0] = p.x & 0xFFFFu, x.p[1] = p.x >> 16, x.p[2] = p.y & 0xFFFFu, x.p[3] = p.y >> 16;
    x.g[0] = g.x & 0xFFFFu, x.g[1] = g.x >> 16, x.g[2] = g.y & 0xFFFFu, x.g[3] = g.y >> 16;
  } else {
    const uint4 p = *reinterpret_cast<const uint4*>(st + t * S::kPBytes);
    const uint4 g = *reinterpret_cast<const uint4*>(st + S::kG + t * S::kPBytes);
    x.p[0] = p.x, x.p[1] = p.y, x.p[2] = p.z, x.p[3] = p.w;
    x.g[0] = g.x, x.g[1] = g.y, x.g[2] = g.z, x.g[3] = g.w;
  }
  const float4 mu = *reinterpret_cast<const float4*>(st + S::kMu + 16 * t);
  const float4 nu = *reinterpret_cast<const float4*>(st + S::kNu + 16 * t);
  x.mu[0] = mu.x, x.mu[1] = mu.y, x.mu[2] = mu.z, x.mu[3] = mu.w;
  x.nu[0] = nu.x, x.nu[1] = nu.y, x.nu[2] = nu.z, x.nu[3] = nu.w;
  if constexpr (kMaster) {
    const uint2 r = *reinterpret_cast<const uint2*>(st + S::kMaster_ + 8 * t);
    x.master[0] = r.x & 0xFFFFu, x.master[1] = r.x >> 16;
    x.master[2] = r.y & 0xFFFFu, x.master[3] = r.y >> 16;
  }
}

// The update without the device copy, its loads staged through shared memory: while a thread
// computes group j, its groups j+1 .. j+kStages-1 are being copied in. Each thread reads back
// only what it copied itself, so no barrier is needed; a stage is refilled only after the
// thread's own reads of it have been used (program order).
template <bool kBF16, bool kMaster, int kStages>
__device__ __forceinline__ void staged_chunk(const AdamWLeaf& L, const AdamWHyper& h,
                                             const AdamWStep& s, int64_t c, char* smem) {
  using S = Stage<kBF16, kMaster>;
  constexpr int psize = kBF16 ? 2 : 4;
  const auto [first, count, full_groups, rem] = chunk_span(L, c);

  Sums sum;
#pragma unroll
  for (int k = 0; k < kStages - 1; ++k) {  // fill: the thread's first kStages-1 groups
    const int64_t gi = threadIdx.x + static_cast<int64_t>(k) * kThreads;
    if (gi < full_groups) stage_issue<kBF16, kMaster>(smem + k * S::kBytes, L, first + 4 * gi);
    cp_async_commit();  // always, so that the count of groups stays the same in every thread
  }
  int slot = 0;
  for (int64_t gi = threadIdx.x; gi < full_groups; gi += kThreads) {
    const int64_t ahead = gi + static_cast<int64_t>(kStages - 1) * kThreads;
    const int ahead_slot = slot == 0 ? kStages - 1 : slot - 1;  // the stage used last iteration
    if (ahead < full_groups) {
      stage_issue<kBF16, kMaster>(smem + ahead_slot * S::kBytes, L, first + 4 * ahead);
    }
    cp_async_commit();
    cp_async_wait<kStages - 1>();  // group gi has arrived
    Group x;
    stage_read<kBF16, kMaster>(smem + slot * S::kBytes, x);
    process_group<kBF16, kMaster, true, true>(L, h, s, first, gi, 4, x, sum, false);
    slot = slot + 1 == kStages ? 0 : slot + 1;
  }
  cp_async_wait<0>();  // nothing in flight into shared memory past the chunk
  if (rem != 0) {      // block-uniform: only a tensor's last chunk can be ragged
    const int tail_live = threadIdx.x == 0 ? rem : 0;
    Group x;
    load_group<kBF16, kMaster, false>(L, first + 4 * full_groups, tail_live, x);
    process_group<kBF16, kMaster, false, true>(L, h, s, first, full_groups, tail_live, x, sum,
                                               false);
  }
  const Sums t = block_sum(sum);
  if (threadIdx.x == 0) finish_chunk<kMaster>(L, c, count, psize, t, t, false);
}

// kInFlight: groups whose loads a thread issues before it computes the first of them (more
// bytes in flight per thread, more registers).
// kCopy: also write the device copy, reading the chunk twice (phase A for the verdict, phase B
// for the update; the library's update_chunk). kKeepA: phase A's loads are plain ones, so that
// L2 keeps the lines for phase B (evict-first loads may lose them); phase B's are evict-first.
// kPrefetch: iterations of the block's loop ahead whose groups each thread prefetches into L2
// (0: none).
// kEvictFirst: the update's loads (without the device copy) marked evict-first, or plain ones.
template <bool kBF16, bool kMaster, int kInFlight, bool kCopy, bool kKeepA, int kPrefetch = 0,
          bool kEvictFirst = true>
__device__ __forceinline__ void two_pass_chunk(const AdamWLeaf& L, const AdamWHyper& h,
                                               const AdamWStep& s, int64_t c) {
  constexpr int psize = kBF16 ? 2 : 4;
  const int64_t bd = blockDim.x;
  const auto [first, count, full_groups, rem] = chunk_span(L, c);
  const int tail_live = threadIdx.x == 0 ? rem : 0;

  Sums old;
  bool to_copy = false;
  if constexpr (kCopy) {  // phase A: the chunk's verdict
    for (int64_t gi = threadIdx.x; gi < full_groups; gi += bd) {
      Group x;
      load_group<kBF16, kMaster, true, !kKeepA>(L, first + 4 * gi, 4, x);
      old_terms<kBF16, kMaster>(x, gi, old);
    }
    if (rem != 0) {  // block-uniform
      Group x;
      load_group<kBF16, kMaster, false>(L, first + 4 * full_groups, tail_live, x);
      old_terms<kBF16, kMaster>(x, full_groups, old);
    }
    old = block_sum(old);
    to_copy = chunk_faults<kMaster>(L, c, count, psize, old) == 0;  // same in every thread
  }

  Sums sum;
  int64_t gi = threadIdx.x;
  if constexpr (kPrefetch > 0) {  // the first iterations' groups
#pragma unroll
    for (int k = 1; k < kPrefetch; ++k) {
      if (gi + k * kInFlight * bd < full_groups) {
        prefetch_group<kBF16, kMaster>(L, first + 4 * (gi + k * kInFlight * bd));
      }
    }
  }
  for (; gi + (kInFlight - 1) * bd < full_groups; gi += kInFlight * bd) {
    if constexpr (kPrefetch > 0) {
      const int64_t ahead = gi + kPrefetch * kInFlight * bd;
      if (ahead < full_groups) prefetch_group<kBF16, kMaster>(L, first + 4 * ahead);
    }
    Group x[kInFlight];
#pragma unroll
    for (int k = 0; k < kInFlight; ++k) {
      load_group<kBF16, kMaster, true, kEvictFirst>(L, first + 4 * (gi + k * bd), 4, x[k]);
    }
#pragma unroll
    for (int k = 0; k < kInFlight; ++k) {
      process_group<kBF16, kMaster, true, !kCopy>(L, h, s, first, gi + k * bd, 4, x[k], sum,
                                                  to_copy);
    }
  }
  for (; gi < full_groups; gi += bd) {  // what is left: fewer than kInFlight groups
    Group x;
    load_group<kBF16, kMaster, true, kEvictFirst>(L, first + 4 * gi, 4, x);
    process_group<kBF16, kMaster, true, !kCopy>(L, h, s, first, gi, 4, x, sum, to_copy);
  }
  if (rem != 0) {  // block-uniform: only a tensor's last chunk can be ragged
    Group x;
    load_group<kBF16, kMaster, false>(L, first + 4 * full_groups, tail_live, x);
    process_group<kBF16, kMaster, false, !kCopy>(L, h, s, first, full_groups, tail_live, x,
                                                 sum, to_copy);
  }
  const Sums t = block_sum(sum);
  if (threadIdx.x == 0) finish_chunk<kMaster>(L, c, count, psize, kCopy ? old : t, t, to_copy);
}

// Every chunk of the table through two_pass_chunk (the kernels' body; for_each_chunk with a
// lambda would lay out the prefetching kernels' PTX differently from what was measured).
template <bool kBF16, bool kMaster, int kInFlight, bool kCopy, bool kKeepA, int kPrefetch,
          bool kEvictFirst>
__device__ __forceinline__ void every_chunk(const LeafTable& T, const AdamWHyper& h,
                                            const float* step) {
  const AdamWStep s = adamw_step(step);
  for (int64_t gc = blockIdx.x; gc < T.first_chunk[T.count]; gc += gridDim.x) {
    const int i = leaf_of(T, gc);
    two_pass_chunk<kBF16, kMaster, kInFlight, kCopy, kKeepA, kPrefetch, kEvictFirst>(
        T.leaf[i], h, s, gc - T.first_chunk[i]);
  }
}

// The chunk loop with one or two groups in flight: at least 3 blocks per SM with one (at most
// 85 registers), as the library's kernel.
template <bool kBF16, bool kMaster, int kInFlight, bool kCopy, bool kKeepA, int kPrefetch = 0,
          bool kEvictFirst = true>
__global__ void __launch_bounds__(kThreads, kInFlight == 1 ? 3 : 1)
    variant_kernel(const __grid_constant__ LeafTable T, const AdamWHyper h,
                   const float* __restrict__ step) {
  every_chunk<kBF16, kMaster, kInFlight, kCopy, kKeepA, kPrefetch, kEvictFirst>(T, h, step);
}

// The same with at least 4 blocks per SM (at most 64 registers; ptxas spills 36 bytes for
// fp32, 52 for bf16, 180 with master weights): more warps to hide the loads behind, at the
// price of the spills (v8).
template <bool kBF16, bool kMaster>
__global__ void __launch_bounds__(kThreads, 4)
    variant_kernel_4_blocks(const __grid_constant__ LeafTable T, const AdamWHyper h,
                            const float* __restrict__ step) {
  every_chunk<kBF16, kMaster, 1, false, false, 0, true>(T, h, step);
}

// The staged pipeline: kStages stages of Stage<>::kBytes each in dynamic shared memory.
template <bool kBF16, bool kMaster, int kStages>
__global__ void __launch_bounds__(kThreads, 3)
    variant_staged_kernel(const __grid_constant__ LeafTable T, const AdamWHyper h,
                          const float* __restrict__ step) {
  extern __shared__ __align__(16) char stage_mem[];
  const AdamWStep s = adamw_step(step);
  for (int64_t gc = blockIdx.x; gc < T.first_chunk[T.count]; gc += gridDim.x) {
    const int i = leaf_of(T, gc);
    staged_chunk<kBF16, kMaster, kStages>(T.leaf[i], h, s, gc - T.first_chunk[i], stage_mem);
  }
}

// The device copy from registers, also with master weights (the library reads those twice).
template <bool kBF16, bool kMaster, int kG>
__global__ void __launch_bounds__(kThreads)
    variant_resident_kernel(const __grid_constant__ LeafTable T, const AdamWHyper h,
                            const float* __restrict__ step) {
  const AdamWStep s = adamw_step(step);
  for_each_chunk(
      T, [&](const AdamWLeaf& L, int64_t c) { resident_chunk<kBF16, kMaster, kG>(L, h, s, c); });
}

using Kernel = void (*)(LeafTable, AdamWHyper, const float*);

// Above 48 KiB of dynamic shared memory a kernel must opt in (once per kernel and device); the
// largest carve-out lets three blocks' stages share an SM (the driver's own choice may not).
cudaError_t allow_shared_memory(Kernel kernel, int bytes) {
  PIMHBM_CUDA_RETURN_IF_ERROR(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  return cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                              cudaSharedmemCarveoutMaxShared);
}

// The pipeline kernel of `stages` stages (2-4), opted into the shared memory it needs (up to
// 64 KiB, returned in `bytes`).
template <bool kBF16, bool kMaster>
cudaError_t staged_kernel(int stages, Kernel* kernel, int* bytes) {
  *kernel = stages == 2   ? variant_staged_kernel<kBF16, kMaster, 2>
            : stages == 3 ? variant_staged_kernel<kBF16, kMaster, 3>
                          : variant_staged_kernel<kBF16, kMaster, 4>;
  *bytes = stages * Stage<kBF16, kMaster>::kBytes;
  return allow_shared_memory(*kernel, *bytes);
}

// The launch a kind of leaf gets from a variant: the kind (bf16, master, copy) and the options
// that apply to it.
struct Plan {
  bool bf16, master, copy;
  CopyPass pass;     // with the copy: kRegisters, kTwoReads or kTwoReadsKeep
  int in_flight;     // groups in flight (two-pass kernels)
  int resident;      // groups kept in registers (kRegisters)
  int prefetch;      // iterations prefetched ahead (no copy, one group in flight)
  int stages;        // groups staged through shared memory (no copy; 0 = off)
  int min_blocks;    // blocks per SM compiled for (no copy, one group; 0 = 3)
  bool plain_loads;  // no copy, one group: plain loads
  bool operator==(const Plan& o) const {
    return bf16 == o.bf16 && master == o.master && copy == o.copy && pass == o.pass &&
           in_flight == o.in_flight && resident == o.resident && prefetch == o.prefetch &&
           stages == o.stages && min_blocks == o.min_blocks && plain_loads == o.plain_loads;
  }
};

Plan plan_for(const AdamWLeaf& leaf, const AdamWVariant& v) {
  Plan p{leaf.param_bf16,
         leaf.has_master,
         leaf.has_copy,
         v.copy_pass,
         v.groups_in_flight == 2 ? 2 : 1,
         update::resident_groups(leaf.chunk_elems),
         v.prefetch,
         v.stages,
         v.min_blocks,
         v.plain_loads};
  if (p.pass == CopyPass::kDefault) {
    p.pass = p.resident != 0 && !p.master ? CopyPass::kRegisters : CopyPass::kTwoReadsKeep;
  } else if (p.pass == CopyPass::kRegisters && p.resident == 0) {
    p.pass = CopyPass::kTwoReadsKeep;
  }
  return p;
}

// The kernel of a plan without the device copy (staged kernels aside).
template <bool kBF16, bool kMaster>
Kernel no_copy_kernel(const Plan& p) {
  if (p.in_flight == 2) return variant_kernel<kBF16, kMaster, 2, false, false>;
  if (p.prefetch == 2) return variant_kernel<kBF16, kMaster, 1, false, false, 2>;
  if (p.prefetch == 4) return variant_kernel<kBF16, kMaster, 1, false, false, 4>;
  if (p.min_blocks == 4) return variant_kernel_4_blocks<kBF16, kMaster>;
  if (p.plain_loads) return variant_kernel<kBF16, kMaster, 1, false, false, 0, false>;
  return variant_kernel<kBF16, kMaster, 1, false, false>;
}

// The kernel of a plan with the device copy.
template <bool kBF16, bool kMaster>
Kernel copy_kernel(const Plan& p) {
  if (p.pass == CopyPass::kRegisters) {
    return p.resident == 1   ? variant_resident_kernel<kBF16, kMaster, 1>
           : p.resident == 2 ? variant_resident_kernel<kBF16, kMaster, 2>
                             : variant_resident_kernel<kBF16, kMaster, 4>;
  }
  const bool keep = p.pass == CopyPass::kTwoReadsKeep;
  if (p.in_flight == 2) {
    return keep ? variant_kernel<kBF16, kMaster, 2, true, true>
                : variant_kernel<kBF16, kMaster, 2, true, false>;
  }
  return keep ? variant_kernel<kBF16, kMaster, 1, true, true>
              : variant_kernel<kBF16, kMaster, 1, true, false>;
}

template <bool kBF16, bool kMaster>
cudaError_t launch_kind(const LeafTable& T, const Plan& p, const AdamWHyper& h, const float* step,
                        cudaStream_t stream) {
  const int blocks = static_cast<int>(std::min<int64_t>(T.first_chunk[T.count], 0x7FFFFFFF));
  Kernel kernel;
  int bytes = 0;
  if (!p.copy && p.stages != 0) {
    PIMHBM_CUDA_RETURN_IF_ERROR((staged_kernel<kBF16, kMaster>(p.stages, &kernel, &bytes)));
  } else {
    kernel = p.copy ? copy_kernel<kBF16, kMaster>(p) : no_copy_kernel<kBF16, kMaster>(p);
  }
  kernel<<<blocks, kThreads, bytes, stream>>>(T, h, step);
  PIMHBM_CUDA_RETURN_LAUNCH_ERROR();
  return cudaSuccess;
}

cudaError_t launch_table(const LeafTable& T, const Plan& p, const AdamWHyper& h, const float* step,
                         cudaStream_t stream) {
  if (p.bf16 && p.master) return launch_kind<true, true>(T, p, h, step, stream);
  if (p.bf16) return launch_kind<true, false>(T, p, h, step, stream);
  return launch_kind<false, false>(T, p, h, step, stream);
}

bool in_range(const AdamWVariant& v) {
  return v.groups_in_flight >= 0 && v.groups_in_flight <= 2 &&
         (v.prefetch == 0 || v.prefetch == 2 || v.prefetch == 4) &&
         (v.stages == 0 || (v.stages >= 2 && v.stages <= 4)) &&
         (v.min_blocks == 0 || v.min_blocks == 3 || v.min_blocks == 4);
}

template <bool kBF16, bool kMaster>
cudaError_t occupancy_kind(const AdamWVariant& v, int* blocks) {
  const Plan p{kBF16, kMaster, false,    CopyPass::kDefault, 1,
               0,     0,       v.stages, v.min_blocks,       v.plain_loads};
  Kernel kernel = no_copy_kernel<kBF16, kMaster>(p);
  int bytes = 0;
  if (v.stages != 0) {
    PIMHBM_CUDA_RETURN_IF_ERROR((staged_kernel<kBF16, kMaster>(v.stages, &kernel, &bytes)));
  }
  return cudaOccupancyMaxActiveBlocksPerMultiprocessor(blocks, kernel, kThreads, bytes);
}

const char* pass_name(CopyPass pass) {
  switch (pass) {
    case CopyPass::kRegisters:
      return "registers";
    case CopyPass::kTwoReads:
      return "two reads";
    case CopyPass::kTwoReadsKeep:
      return "two reads, first kept in L2";
    default:
      return "default pass";
  }
}

}  // namespace

std::string describe(const AdamWVariant& v) {
  std::string out = std::to_string(v.groups_in_flight == 2 ? 2 : 1) + " group(s) in flight";
  if (v.copy_pass != CopyPass::kDefault) out += std::string(", ") + pass_name(v.copy_pass);
  if (v.prefetch != 0) out += ", L2 prefetch " + std::to_string(v.prefetch) + " ahead";
  if (v.stages != 0) out += ", " + std::to_string(v.stages) + " stages in smem";
  if (v.min_blocks != 0) out += ", compiled for " + std::to_string(v.min_blocks) + " blocks/SM";
  if (v.plain_loads) out += ", plain loads";
  return out;
}

cudaError_t adamw_variant(const AdamWLeaf* leaves, size_t count, const AdamWHyper& hyper,
                          const float* step, cudaStream_t stream, const AdamWVariant& v) {
  if (!in_range(v)) return cudaErrorInvalidValue;
  return launch_by_kind(
      leaves, count, [&](const AdamWLeaf& leaf) { return plan_for(leaf, v); },
      [&](const LeafTable& T, const Plan& p) { return launch_table(T, p, hyper, step, stream); });
}

cudaError_t variant_blocks_per_sm(bool bf16, bool master, const AdamWVariant& v, int* blocks) {
  if (!in_range(v)) return cudaErrorInvalidValue;
  if (bf16 && master) return occupancy_kind<true, true>(v, blocks);
  if (bf16) return occupancy_kind<true, false>(v, blocks);
  return occupancy_kind<false, false>(v, blocks);
}

}  // namespace pimhbm::bench
