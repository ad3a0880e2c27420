// The fused guarded AdamW update on the GPU: the chunk loop without the device copy, and with
// it the two ways of having a chunk's verdict before its first write (adamw.h, adamw_cuda).
// The device code they share with the benchmark's variants is adamw_kernel.cuh.
#include <cuda_runtime.h>

#include <algorithm>

#include "pimhbm/cuda_check.h"
#include "update/adamw.h"
#include "update/adamw_kernel.cuh"

namespace pimhbm::update {
namespace {

using namespace kernel;  // NOLINT: the building blocks of every kernel below

// One chunk, one group of four elements per thread at a time. kCopy: also write the device
// copy, chunk by chunk where the chunk verified. The chunk's verdict must be known before its
// first write, so the kernel first reads the chunk's state to check its digests (phase A) and
// then reads it again -- from L2, a chunk is 48-64 KiB -- to update it (phase B). Phase A's
// loads are plain ones, so that L2 keeps the lines for phase B; phase B's are evict-first.
// Without the copy the update's loads are plain ones (bench/NOTES.md, v10).
template <bool kBF16, bool kMaster, bool kCopy>
__device__ __forceinline__ void update_chunk(const AdamWLeaf& L, const AdamWHyper& h,
                                             const AdamWStep& s, int64_t c) {
  constexpr int psize = kBF16 ? 2 : 4;
  constexpr bool kEvictFirst = kCopy;
  const int64_t bd = blockDim.x;
  const auto [first, count, full_groups, rem] = chunk_span(L, c);
  const int tail_live = threadIdx.x == 0 ? rem : 0;

  Sums old;
  bool to_copy = false;
  if constexpr (kCopy) {  // phase A: the chunk's verdict
    for (int64_t gi = threadIdx.x; gi < full_groups; gi += bd) {
      Group x;
      load_group<kBF16, kMaster, true, false>(L, first + 4 * gi, 4, x);
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
  for (; gi < full_groups; gi += bd) {
    Group x;
    load_group<kBF16, kMaster, true, kEvictFirst>(L, first + 4 * gi, 4, x);
    process_group<kBF16, kMaster, true, !kCopy>(L, h, s, first, gi, 4, x, sum, to_copy);
  }
  // This loop never runs: the one above leaves gi >= full_groups. It stays because nvcc lays the
  // loop above out differently without it -- other registers and spills (ptxas -v, CUDA 13.0:
  // fp32 76 registers instead of 72) -- and the kernel was measured in this form.
  for (; gi < full_groups; gi += bd) {
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

// At least 3 blocks per SM (at most 85 registers). Without the bound the leaf table's dynamic
// indexing lets the compiler keep the leaf's pointers in registers: 100 with master weights,
// 2 blocks per SM, 8 % slower (bench/NOTES.md, v4).
template <bool kBF16, bool kMaster, bool kCopy>
__global__ void __launch_bounds__(kThreads, 3)
    adamw_kernel(const __grid_constant__ LeafTable T, const AdamWHyper h,
                 const float* __restrict__ step) {
  const AdamWStep s = adamw_step(step);
  for_each_chunk(
      T, [&](const AdamWLeaf& L, int64_t c) { update_chunk<kBF16, kMaster, kCopy>(L, h, s, c); });
}

// The device copy from registers: kG groups of four elements per thread (resident_chunk).
template <bool kBF16, bool kMaster, int kG>
__global__ void __launch_bounds__(kThreads)
    adamw_resident_kernel(const __grid_constant__ LeafTable T, const AdamWHyper h,
                          const float* __restrict__ step) {
  const AdamWStep s = adamw_step(step);
  for_each_chunk(
      T, [&](const AdamWLeaf& L, int64_t c) { resident_chunk<kBF16, kMaster, kG>(L, h, s, c); });
}

// The kernel a leaf needs: its parameters' kind, whether it has the device copy, and with the
// copy the groups each thread keeps in registers (0: the chunk is read twice).
struct Kind {
  bool bf16, master, copy;
  int resident;
  bool operator==(const Kind& o) const {
    return bf16 == o.bf16 && master == o.master && copy == o.copy && resident == o.resident;
  }
};

Kind kind_of(const AdamWLeaf& leaf) {
  // Registers where the chunk fits, except with master weights, whose five tensors per group
  // take 128 registers there and run faster read twice (bench/NOTES.md, v3).
  const int resident = leaf.has_copy && !leaf.has_master ? resident_groups(leaf.chunk_elems) : 0;
  return {leaf.param_bf16, leaf.has_master, leaf.has_copy, resident};
}

template <bool kBF16, bool kMaster>
cudaError_t launch_kind(const LeafTable& T, const Kind& k, const AdamWHyper& h, const float* step,
                        cudaStream_t stream) {
  const int blocks = static_cast<int>(std::min<int64_t>(T.first_chunk[T.count], 0x7FFFFFFF));
  if (!k.copy) {
    adamw_kernel<kBF16, kMaster, false><<<blocks, kThreads, 0, stream>>>(T, h, step);
  } else if (k.resident == 0) {
    adamw_kernel<kBF16, kMaster, true><<<blocks, kThreads, 0, stream>>>(T, h, step);
  } else if constexpr (!kMaster) {
    if (k.resident == 1) {
      adamw_resident_kernel<kBF16, false, 1><<<blocks, kThreads, 0, stream>>>(T, h, step);
    } else if (k.resident == 2) {
      adamw_resident_kernel<kBF16, false, 2><<<blocks, kThreads, 0, stream>>>(T, h, step);
    } else {
      adamw_resident_kernel<kBF16, false, 4><<<blocks, kThreads, 0, stream>>>(T, h, step);
    }
  }
  PIMHBM_CUDA_RETURN_LAUNCH_ERROR();
  return cudaSuccess;
}

cudaError_t launch_table(const LeafTable& T, const Kind& k, const AdamWHyper& h, const float* step,
                         cudaStream_t stream) {
  if (k.bf16 && k.master) return launch_kind<true, true>(T, k, h, step, stream);
  if (k.bf16) return launch_kind<true, false>(T, k, h, step, stream);
  return launch_kind<false, false>(T, k, h, step, stream);
}

}  // namespace

int resident_groups(int64_t chunk_elems) {
  const int64_t groups = (chunk_elems + 4 * kThreads - 1) / (4 * kThreads);  // per thread
  return groups <= 1 ? 1 : groups <= 2 ? 2 : groups <= 4 ? 4 : 0;
}

cudaError_t adamw_cuda(const AdamWLeaf* leaves, size_t count, const AdamWHyper& hyper,
                       const float* step, cudaStream_t stream) {
  return launch_by_kind(leaves, count, kind_of, [&](const LeafTable& T, const Kind& k) {
    return launch_table(T, k, hyper, step, stream);
  });
}

cudaError_t adamw_cuda(const AdamWLeaf& leaf, const AdamWHyper& hyper, const float* step,
                       cudaStream_t stream) {
  return adamw_cuda(&leaf, 1, hyper, step, stream);
}

}  // namespace pimhbm::update
