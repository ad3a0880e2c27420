// The forward pass on wgmma (attention_wgmma.h): a block of two warpgroups per (128 query rows,
// head, batch), each warpgroup 64 rows; key tiles of 128 in order. S = Q K^T reads Q and K from
// shared memory (both K-major), O += P V takes P from registers (each warp's converted scores,
// as in the mma.sync kernel) and V from shared memory (MN-major). Q, K and V sit in shared
// memory in wgmma's 128-byte swizzle (attention_wgmma.cuh), filled by cp.async; rows
// past the sequence's end are zero-filled, never read from global memory, and never written.
// The online softmax and the epilogue are the mma.sync kernel's (attention_device.cuh): each
// warp's 16 rows of a wgmma tile have the layout of its m16n8 tiles.
//
// Shared memory: Q (128 rows), two stages of K and two or three of V (128 keys each): 160 or
// 192 KiB at head dim 128, and 1 KiB of slack for the tiles' alignment: one block an SM.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <type_traits>

#include "attention/attention_device.cuh"
#include "attention/attention_wgmma.cuh"
#include "attention/attention_wgmma.h"
#include "attention/wgmma.cuh"
#include "pimhbm/cuda_check.h"

namespace pimhbm::attention::hopper {
namespace {

using namespace device;  // NOLINT(google-build-using-namespace): the kernels' own helpers

constexpr int kKeys = 128;  // a key tile

// Where a block's tiles live in shared memory: Q, then K's two stages, then V's stages.
template <int D, int kVStages>
struct Smem {
  uint16_t* base;
  __device__ uint16_t* q() const { return base; }
  __device__ uint16_t* k(int tile) const { return base + (kQRows + (tile % 2) * kKeys) * D; }
  __device__ uint16_t* v(int tile) const {
    return base + (kQRows + (2 + tile % kVStages) * kKeys) * D;
  }
  static constexpr int bytes() { return (kQRows + (2 + kVStages) * kKeys) * D * 2 + kSmemSlack; }
};

// What a warpgroup's key loop needs: its rows, the tensors' bases, the tiles to go over.
struct Rows {
  int row0;   // this warp's first row
  int group;  // this warpgroup
  int kblocks;
  int64_t kv_base, kv_stride;
};

// S = Q K^T for this warpgroup's 64 rows and key tile `tile` (issued and committed, not waited).
template <int D, typename Sm>
__device__ __forceinline__ void issue_scores(float (&s)[kKeys / 8][4], const Sm& sm, const Rows& r,
                                             int tile) {
  wgmma::begin();
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks) {  // 16 columns
    wgmma::mma_ss<kKeys>(s, k_major<kQRows>(sm.q(), 64 * r.group, ks),
                         k_major<kKeys>(sm.k(tile), 0, ks), ks > 0);
  }
  wgmma::commit();
}

// O += P V for key tile `tile` (issued and committed, not waited); p must stay untouched until
// the product is waited for.
template <int D, typename Sm>
__device__ __forceinline__ void issue_values(float (&o)[D / 8][4],
                                             const uint32_t (&p)[kKeys / 16][4], const Sm& sm,
                                             int tile) {
  wgmma::begin();
#pragma unroll
  for (int ks = 0; ks < kKeys / 16; ++ks) {  // 16 keys
    wgmma::mma_rs<D>(o, p[ks], mn_major<kKeys>(sm.v(tile), ks), 1);
  }
  wgmma::commit();
}

// The scores of key tile `tile` in log2 units, masked ones -inf. Where the tile needs a mask
// (warp-uniform), each row's first masked key is worked out once, so that each score costs a
// compare and a select.
__device__ __forceinline__ void scale_and_mask(float (&s)[kKeys / 8][4], const Dims& d,
                                               const Rows& r, int tile) {
  const int k0 = tile * kKeys;
  if (!needs_mask(d, k0, kKeys, r.row0)) {
#pragma unroll
    for (int n = 0; n < kKeys / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) s[n][e] *= d.scale_log2;
    }
    return;
  }
  int end[2];  // keys from end[half] on are masked for the lane's row of that half
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = r.row0 + acc_row(2 * half);
    end[half] = keys_seen(d, row) - k0;
  }
#pragma unroll
  for (int n = 0; n < kKeys / 8; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      s[n][e] = acc_col(n, e) < end[e / 2] ? s[n][e] * d.scale_log2 : -INFINITY;
    }
  }
}

// K or V of tile `tile` into its stage.
template <int D, typename Sm>
__device__ __forceinline__ void load_k(const Args& a, const Sm& sm, const Rows& r, int tile) {
  load_tile<D, kKeys>(sm.k(tile), a.k + r.kv_base, tile * kKeys, a.dims.seq, r.kv_stride);
}
template <int D, typename Sm>
__device__ __forceinline__ void load_v(const Args& a, const Sm& sm, const Rows& r, int tile) {
  load_tile<D, kKeys>(sm.v(tile), a.v + r.kv_base, tile * kKeys, a.dims.seq, r.kv_stride);
}

// kSerial: each tile's two products waited for in turn; K and V of the next tile arrive
// meanwhile (two stages of each).
template <int D>
using SerialSmem = Smem<D, 2>;

template <int D>
__device__ __forceinline__ void key_loop_serial(const Args& a, const SerialSmem<D>& sm,
                                                const Rows& r, float (&o)[D / 8][4], float (&m)[2],
                                                float (&l)[2]) {
  load_k<D>(a, sm, r, 0);
  load_v<D>(a, sm, r, 0);
  cp_async_commit();
  for (int j = 0; j < r.kblocks; ++j) {
    publish_copies();  // tile j is in; every group is done with tile j - 1's stage
    if (j + 1 < r.kblocks) {
      load_k<D>(a, sm, r, j + 1);
      load_v<D>(a, sm, r, j + 1);
    }
    cp_async_commit();
    float s[1][kKeys / 8][4];  // one row tile: the shape to_operand takes
    issue_scores<D>(s[0], sm, r, j);
    wgmma::wait<0>();
    wgmma::fence_operand<kKeys>(s[0]);
    scale_and_mask(s[0], a.dims, r, j);
    softmax_tile<D, kKeys>(s[0], m, l, o);
    uint32_t p[1][kKeys / 16][4];
    to_operand<1, kKeys>(p, s);
    issue_values<D>(o, p[0], sm, j);
    wgmma::wait<0>();
    wgmma::fence_operand<D>(o);
  }
}

// kScoresAhead: S of tile j + 1 runs on the tensor cores while P V of tile j does, and P V of
// tile j while the softmax of tile j + 1 does (FlashAttention-3's overlap within a warpgroup).
// V has three stages: when a group passes the barrier of turn j, every group is past S of
// tile j and P V of tile j - 2, so K of tile j + 2 and V of tile j + 1 may come in while P V
// of tile j - 1 still reads its stage.
template <int D>
using AheadSmem = Smem<D, 3>;

// Turn j, whose scores are in s: the softmax while P V of tile j - 1 may still run, the next
// copies (their branches also keep the compiler from moving the wait below above the softmax:
// it schedules a wait first in its block), then the output rows rescaled once that product is
// done and P packed.
template <int D>
__device__ __forceinline__ void softmax_ahead(const Args& a, const AheadSmem<D>& sm, const Rows& r,
                                              int j, float (&s)[1][kKeys / 8][4],
                                              uint32_t (&p)[1][kKeys / 16][4], float (&o)[D / 8][4],
                                              float (&m)[2], float (&l)[2]) {
  publish_copies();  // K of tile j + 1 and V of tile j are in
  scale_and_mask(s[0], a.dims, r, j);
  float alpha[2];
  softmax_scores<kKeys>(s[0], m, l, alpha);
  if (j + 2 < r.kblocks) load_k<D>(a, sm, r, j + 2);
  if (j + 1 < r.kblocks) load_v<D>(a, sm, r, j + 1);
  cp_async_commit();
  wgmma::wait<0>();
  wgmma::fence_operand<D>(o);
  rescale_rows<D>(o, alpha);
  to_operand<1, kKeys>(p, s);
}

template <int D>
__device__ __forceinline__ void key_loop_scores_ahead(const Args& a, const AheadSmem<D>& sm,
                                                      const Rows& r, float (&o)[D / 8][4],
                                                      float (&m)[2], float (&l)[2]) {
  load_k<D>(a, sm, r, 0);
  load_v<D>(a, sm, r, 0);
  if (r.kblocks > 1) load_k<D>(a, sm, r, 1);
  cp_async_commit();
  publish_copies();
  float s[1][kKeys / 8][4];  // one row tile: the shape to_operand takes
  issue_scores<D>(s[0], sm, r, 0);
  wgmma::wait<0>();
  wgmma::fence_operand<kKeys>(s[0]);
  uint32_t p[1][kKeys / 16][4];
  const int last = r.kblocks - 1;  // its own turn: no product is issued under a condition
  for (int j = 0; j < last; ++j) {
    softmax_ahead<D>(a, sm, r, j, s, p, o, m, l);
    issue_scores<D>(s[0], sm, r, j + 1);
    issue_values<D>(o, p[0], sm, j);
    wgmma::wait<1>();  // S of tile j + 1; P V of tile j runs on
    wgmma::fence_operand<kKeys>(s[0]);
  }
  softmax_ahead<D>(a, sm, r, last, s, p, o, m, l);
  issue_values<D>(o, p[0], sm, last);
  wgmma::wait<0>();
  wgmma::fence_operand<D>(o);
}

template <WgmmaSchedule kSchedule, int D>
using SmemOf = std::conditional_t<kSchedule == WgmmaSchedule::kSerial, SerialSmem<D>, AheadSmem<D>>;

template <int D, WgmmaSchedule kSchedule>
__global__ void __launch_bounds__(kThreads, 1) forward_kernel(Args a) {
  extern __shared__ __align__(128) uint16_t smem[];
  const SmemOf<kSchedule, D> sm{tiles_base(smem)};
  const Dims& d = a.dims;
  const int group = threadIdx.x / 128, warp = (threadIdx.x / 32) % 4;
  const int q0 = (tiles(d.seq, kQRows) - 1 - blockIdx.x) * kQRows;  // the longest rows first
  const int h = blockIdx.y, b = blockIdx.z;
  const int64_t q_stride = static_cast<int64_t>(d.heads) * D;
  const int64_t q_base = head_base<D>(b, h, d.seq, d.heads);
  const Rows r{
      q0 + 64 * group + 16 * warp, group, tiles(d.causal ? min(d.seq, q0 + kQRows) : d.seq, kKeys),
      head_base<D>(b, h / d.group, d.seq, d.kv_heads), static_cast<int64_t>(d.kv_heads) * D};
  load_tile<D, kQRows>(sm.q(), a.q + q_base, q0, d.seq, q_stride);  // joins K's first group

  float o[1][D / 8][4] = {};  // one row tile: the shape store_row takes
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  if constexpr (kSchedule == WgmmaSchedule::kSerial) {
    key_loop_serial<D>(a, sm, r, o[0], m, l);
  } else {
    key_loop_scores_ahead<D>(a, sm, r, o[0], m, l);
  }
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    finish_row<D, 1>(a, o, 0, half, m[half], l[half], r.row0 + acc_row(2 * half), b, h, q_base,
                     q_stride);
  }
}

template <int D, WgmmaSchedule kSchedule>
cudaError_t forward_d(const Forward& c, cudaStream_t stream) {
  const Args a = forward_args(c);
  const dim3 grid(tiles(a.dims.seq, kQRows), a.dims.heads, static_cast<unsigned>(c.shape.batch));
  return launch(forward_kernel<D, kSchedule>, grid, kThreads, SmemOf<kSchedule, D>::bytes(), stream,
                a);
}

template <int D>
cudaError_t by_schedule(const Forward& c, WgmmaSchedule schedule, cudaStream_t stream) {
  return schedule == WgmmaSchedule::kSerial ? forward_d<D, WgmmaSchedule::kSerial>(c, stream)
                                            : forward_d<D, WgmmaSchedule::kScoresAhead>(c, stream);
}

}  // namespace
}  // namespace pimhbm::attention::hopper

namespace pimhbm::attention {

cudaError_t wgmma_takes(int64_t d, bool* takes) {
  *takes = false;
  if (!wgmma_head_dim(d)) return cudaSuccess;
  const cudaError_t err = hopper::check_sm90();
  if (err == cudaErrorNotSupported) return cudaSuccess;
  PIMHBM_CUDA_RETURN_IF_ERROR(err);
  *takes = true;
  return cudaSuccess;
}

cudaError_t forward_wgmma(const Forward& call, WgmmaSchedule schedule, cudaStream_t stream) {
  if (!wgmma_head_dim(call.shape.head_dim)) return cudaErrorInvalidValue;
  PIMHBM_CUDA_RETURN_IF_ERROR(hopper::check_sm90());
  if (call.shape.q_elems() == 0) return cudaSuccess;
  return call.shape.head_dim == 64 ? hopper::by_schedule<64>(call, schedule, stream)
                                   : hopper::by_schedule<128>(call, schedule, stream);
}

}  // namespace pimhbm::attention
