// The checks before the in-place update on the GPU (precheck.h): a segment of 8 lanes a chunk
// (a warp four chunks at a time), its p and g read as 16-byte vectors, the digest terms and the
// non-finite squares summed over the segment by shuffles. Memory-bound: 4 bytes a bf16
// parameter, read once. (A whole warp a chunk spent 15 shuffles on every 1 KB chunk and kept
// two vectors a lane in flight: 2.8 TB/s at the 8B layer, bench/NOTES.md.)
#include <cuda_runtime.h>

#include <algorithm>
#include <cub/block/block_reduce.cuh>

#include "pimhbm/cuda_check.h"
#include "pimhbm/digest.h"
#include "pimhbm/word_muls.cuh"
#include "update/precheck.h"

namespace pimhbm::update {
namespace {

constexpr int kWarps = 8;  // a block: 256 threads
constexpr int kMaxLeaves = 64;
constexpr int kMaxBlocks = 4096;

struct Table {
  PrecheckLeaf leaf[kMaxLeaves];
  int count;
};
static_assert(sizeof(Table) < 32000, "the leaf table must fit the kernel parameters");

constexpr int kSegment = 8;  // lanes a chunk
constexpr int kBatch = 4;    // vectors of p and of g a lane asks for at once (a bf16 chunk of 256)
// Word multipliers in shared memory: chunks of up to 2 KiB (512 bf16 or fp32 elements: the
// in-place update's); the words past them take word_mul itself.
constexpr int kMulVectors = 128;

// Sums over the lane's segment of kSegment lanes (every lane of the warp takes part).
template <typename T>
__device__ __forceinline__ T segment_sum(T v) {
#pragma unroll
  for (int off = kSegment / 2; off > 0; off >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, off);
  return v;
}

// Bytes [at, at + 16) of a chunk of `len` bytes, zero past its end (which is never read).
__device__ __noinline__ uint4 tail_vector(const uint8_t* chunk, int64_t at, int64_t len) {
  uint32_t w[4] = {0, 0, 0, 0};
  for (int k = 0; k < 16 && at + k < len; ++k) {
    w[k / 4] |= static_cast<uint32_t>(chunk[at + k]) << (8 * (k % 4));
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

template <bool kBF16>
__device__ __forceinline__ int32_t nonfinite_squares(const uint4 v) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
  int32_t bad = 0;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    if constexpr (kBF16) {
      bad += square_nonfinite(w[k] & 0xFFFFu, true) ? 1 : 0;
      bad += square_nonfinite(w[k] >> 16, true) ? 1 : 0;
    } else {
      bad += square_nonfinite(w[k], false) ? 1 : 0;
    }
  }
  return bad;
}

// What a thread found in the chunks it wrote, for the call's totals.
struct Found {
  unsigned long long damaged = 0;
  unsigned long long nonfinite = 0;
};

// Chunk c of leaf L, by the kSegment lanes of a segment (`part`: the lane's place in it); the
// segment's first lane writes its two results and counts them in `found`. Past the leaf's
// chunks (`c` >= chunks) the lanes only take part in the sums.
template <bool kBF16, bool kGrads>
__device__ __forceinline__ void check_chunk(const PrecheckLeaf& L, int64_t c, int64_t chunks,
                                            int part, const uint4 (&muls)[kMulVectors],
                                            Found& found) {
  constexpr int64_t kSize = kBF16 ? 2 : 4;
  const int64_t first = c * L.chunk_elems;
  const int64_t len = c < chunks ? min(L.chunk_elems, L.n - first) * kSize : 0;
  const uint8_t* p = static_cast<const uint8_t*>(L.p) + first * kSize;
  const uint8_t* g = kGrads ? static_cast<const uint8_t*>(L.g) + first * kSize : nullptr;
  const uint64_t key_chunk = static_cast<uint64_t>(precheck_base(L) + c);
  const int64_t vectors = (len + 15) / 16;
  uint64_t acc = 0;
  int32_t bad = 0;
  if (16 * vectors == len) {
    // Whole vectors (every chunk but a ragged last one not a multiple of 16 bytes): kBatch of
    // p's and of g's asked for at once, before any is used (for a bf16 chunk of 256, all of the
    // lane's share).
    const uint4* p4 = reinterpret_cast<const uint4*>(p);
    const uint4* g4 = reinterpret_cast<const uint4*>(g);
    for (int64_t v0 = part; v0 < vectors; v0 += kBatch * kSegment) {
      uint4 pv[kBatch], gv[kBatch];
#pragma unroll
      for (int k = 0; k < kBatch; ++k) {
        const int64_t v = v0 + k * kSegment;
        pv[k] = v < vectors ? __ldg(p4 + v) : make_uint4(0, 0, 0, 0);
        if constexpr (kGrads) gv[k] = v < vectors ? __ldg(g4 + v) : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int k = 0; k < kBatch; ++k) {
        const int64_t v = v0 + k * kSegment;
        if (v >= vectors) break;
        acc += vector_terms(
            pv[k], v < kMulVectors ? muls[v] : word_muls_of_vector(static_cast<uint32_t>(v)));
        if constexpr (kGrads) bad += nonfinite_squares<kBF16>(gv[k]);
      }
    }
  } else {
    for (int64_t v = part; v < vectors; v += kSegment) {
      const bool whole = 16 * (v + 1) <= len;
      const uint4 pv =
          whole ? __ldg(reinterpret_cast<const uint4*>(p) + v) : tail_vector(p, 16 * v, len);
      const uint4 m = v < kMulVectors ? muls[v] : word_muls_of_vector(static_cast<uint32_t>(v));
      acc += vector_terms(pv, m);  // past the end the words are zero: no terms
      if constexpr (kGrads) {
        const uint4 gv =
            whole ? __ldg(reinterpret_cast<const uint4*>(g) + v) : tail_vector(g, 16 * v, len);
        bad += nonfinite_squares<kBF16>(gv);
      }
    }
  }
  acc = segment_sum(acc);
  if constexpr (kGrads) bad = segment_sum(bad);
  if (part == 0 && c < chunks) {
    const uint64_t d = finalize(acc, static_cast<uint64_t>(len), key_chunk);
    const int32_t damaged = d != digest_join(L.d_p[2 * c], L.d_p[2 * c + 1]) ? 1 : 0;
    L.damaged[c] = damaged;
    L.nonfinite[c] = bad;
    found.damaged += static_cast<unsigned long long>(damaged);
    found.nonfinite += static_cast<unsigned long long>(bad);
  }
}

using Reduce = cub::BlockReduce<unsigned long long, 32 * kWarps>;

// Every warp takes every warps-th run of four chunks of each leaf in turn; then the block's
// counts go into the totals, two atomics a block. kGrads: the call's leaves have gradients (a
// kernel of its own each way, so that p's digests alone do not pay the registers of both).
template <bool kGrads>
__global__ void __launch_bounds__(32 * kWarps)
    precheck_kernel(const __grid_constant__ Table T, unsigned long long* totals) {
  __shared__ uint4 muls[kMulVectors];
  __shared__ typename Reduce::TempStorage temp;
  Found found;
  fill_word_muls(muls);
  constexpr int kPerWarp = 32 / kSegment;
  const int lane = threadIdx.x & 31;
  const int64_t warp = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarps;
  for (int i = 0; i < T.count; ++i) {
    const PrecheckLeaf& L = T.leaf[i];
    const int64_t chunks = precheck_chunks(L);
    for (int64_t c0 = kPerWarp * warp; c0 < chunks; c0 += kPerWarp * warps) {
      const int64_t c = c0 + lane / kSegment;
      if (L.bf16) {
        check_chunk<true, kGrads>(L, c, chunks, lane % kSegment, muls, found);
      } else {
        check_chunk<false, kGrads>(L, c, chunks, lane % kSegment, muls, found);
      }
    }
  }
  const unsigned long long damaged = Reduce(temp).Sum(found.damaged);
  __syncthreads();
  const unsigned long long nonfinite = Reduce(temp).Sum(found.nonfinite);
  if (threadIdx.x == 0) {
    if (damaged != 0) atomicAdd(&totals[0], damaged);
    if (nonfinite != 0) atomicAdd(&totals[1], nonfinite);
  }
}

cudaError_t launch(const Table& T, int64_t chunks, unsigned long long* totals,
                   cudaStream_t stream) {
  const bool grads = T.leaf[0].g != nullptr;  // every leaf of a call alike (precheck.h)
  const int64_t warps = (chunks + 32 / kSegment - 1) / (32 / kSegment);
  const int blocks = static_cast<int>(std::min<int64_t>((warps + kWarps - 1) / kWarps, kMaxBlocks));
  if (blocks == 0) return cudaSuccess;
  if (grads) {
    precheck_kernel<true><<<blocks, 32 * kWarps, 0, stream>>>(T, totals);
  } else {
    precheck_kernel<false><<<blocks, 32 * kWarps, 0, stream>>>(T, totals);
  }
  PIMHBM_CUDA_RETURN_LAUNCH_ERROR();
  return cudaSuccess;
}

}  // namespace

cudaError_t precheck_cuda(const PrecheckLeaf* leaves, size_t count, uint64_t* totals,
                          cudaStream_t stream) {
  PIMHBM_CUDA_RETURN_IF_ERROR(
      cudaMemsetAsync(totals, 0, kPrecheckTotals * sizeof(uint64_t), stream));
  auto* sums = reinterpret_cast<unsigned long long*>(totals);
  Table T{};
  int64_t chunks = 0;
  for (size_t i = 0; i < count; ++i) {
    // One kernel a call: with the gradients or without (precheck.h).
    if ((leaves[i].g == nullptr) != (leaves[0].g == nullptr)) return cudaErrorInvalidValue;
    if (precheck_chunks(leaves[i]) == 0) continue;
    T.leaf[T.count++] = leaves[i];
    chunks = std::max(chunks, precheck_chunks(leaves[i]));
    if (T.count == kMaxLeaves) {
      PIMHBM_CUDA_RETURN_IF_ERROR(launch(T, chunks, sums, stream));
      T.count = 0, chunks = 0;
    }
  }
  return T.count > 0 ? launch(T, chunks, sums, stream) : cudaSuccess;
}

}  // namespace pimhbm::update
