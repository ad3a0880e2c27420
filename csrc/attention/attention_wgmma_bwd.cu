// The backward pass on wgmma (attention_wgmma.h): the library's deterministic shape (delta, then
// dK/dV per key block and dQ per query block, each output written once by one block from sums
// in a fixed order, no atomics) with every product a warpgroup's wgmma on the two operand
// shapes the forward kernel uses:
//   dK/dV, a block of two warpgroups per (128 keys, kv head, batch), each warpgroup 64 keys,
//   looping over the group's query heads and their 64-query tiles in order:
//     S^T = K Q^T and dP^T = V dO^T   (both operands in shared memory, K-major)
//     dV += P^T dO and dK += dS^T Q   (P^T, dS^T from registers; dO, Q MN-major)
//   dQ, a block of two warpgroups per (128 queries, head, batch), each warpgroup 64 queries,
//   looping over 64-key tiles in order:
//     S = Q K^T and dP = dO V^T       (both operands in shared memory, K-major)
//     dQ += dS K                      (dS from registers; K MN-major: the same tile as for S)
// Tiles sit in shared memory in wgmma's 128-byte swizzle (attention_wgmma.cuh); rows past the
// end are zero-filled and never written.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "attention/attention_device.cuh"
#include "attention/attention_wgmma.cuh"
#include "attention/attention_wgmma.h"
#include "attention/wgmma.cuh"
#include "pimhbm/cuda_check.h"

namespace pimhbm::attention::hopper {
namespace {

using namespace device;  // NOLINT(google-build-using-namespace): the kernels' own helpers

constexpr int kTile = 64;               // dQ's key tiles, dK/dV's query tiles
constexpr int kDkvKeys = kQRows;        // a dK/dV block's keys: 64 a warpgroup
using Scores = float[1][kTile / 8][4];  // a warp's 16 rows x kTile: one row tile
using Operand = uint32_t[1][kTile / 16][4];

// acc (+)= A B^T for a warpgroup's 64 rows of `a` (rows at `a_rows` of a tile of A_ROWS rows)
// and the kTile rows of `b` (a tile of kTile rows): both K-major. Issued, not committed.
template <int D, int A_ROWS>
__device__ __forceinline__ void scores(float (&acc)[kTile / 8][4], const uint16_t* a, int a_rows,
                                       const uint16_t* b) {
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks) {  // 16 columns
    wgmma::mma_ss<kTile>(acc, k_major<A_ROWS>(a, a_rows, ks), k_major<kTile>(b, 0, ks), ks > 0);
  }
}

// acc += A B: A (64 x kTile) from registers, B the kTile rows of `b` read MN-major. Issued, not
// committed.
template <int D>
__device__ __forceinline__ void times_rows(float (&acc)[D / 8][4], const Operand& a,
                                           const uint16_t* b) {
#pragma unroll
  for (int ks = 0; ks < kTile / 16; ++ks) {  // 16 rows of b
    wgmma::mma_rs<D>(acc, a[0][ks], mn_major<kTile>(b, ks), 1);
  }
}

// Waits for every product issued, and keeps the compiler's reads of `accs` after the wait.
template <int N0, int N1>
__device__ __forceinline__ void wait_all(float (&acc0)[N0 / 8][4], float (&acc1)[N1 / 8][4]) {
  wgmma::wait<0>();
  wgmma::fence_operand<N0>(acc0);
  wgmma::fence_operand<N1>(acc1);
}

// ---- dQ -------------------------------------------------------------------------------------

template <int D>
struct DqSmem {
  uint16_t* base;
  __device__ uint16_t* q() const { return base; }
  __device__ uint16_t* d_o() const { return base + kQRows * D; }
  __device__ uint16_t* k(int tile) const { return base + (2 * kQRows + (tile % 2) * kTile) * D; }
  __device__ uint16_t* v(int tile) const {
    return base + (2 * kQRows + (2 + tile % 2) * kTile) * D;
  }
  static constexpr int bytes() { return (2 * kQRows + 4 * kTile) * D * 2 + kSmemSlack; }
};

// dS = P (dP - delta) of key tile k0 for the warp's rows from row0, P from the scores s (log2
// units after the scale) and the rows' lse (times log2 e); masked keys give 0. In place in s.
__device__ __forceinline__ void dq_scores(Scores& s, const Scores& dp, const Dims& d, int k0,
                                          int row0, const float (&lse2)[2],
                                          const float (&delta)[2]) {
  const bool edge = needs_mask(d, k0, kTile, row0);
  int end[2];  // keys from end[half] on are masked for the lane's row of that half
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = row0 + acc_row(2 * half);
    end[half] = edge ? keys_seen(d, row) - k0 : kTile;
  }
#pragma unroll
  for (int n = 0; n < kTile / 8; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float p = fast_exp2(s[0][n][e] * d.scale_log2 - lse2[e / 2]);
      s[0][n][e] = acc_col(n, e) < end[e / 2] ? p * (dp[0][n][e] - delta[e / 2]) : 0.0f;
    }
  }
}

template <int D>
__global__ void __launch_bounds__(kThreads, 1) dq_kernel(Args a) {
  extern __shared__ __align__(128) uint16_t smem[];
  const DqSmem<D> sm{tiles_base(smem)};
  const Dims& d = a.dims;
  const int group = threadIdx.x / 128, warp = (threadIdx.x / 32) % 4;
  const int q0 = (tiles(d.seq, kQRows) - 1 - blockIdx.x) * kQRows;  // the longest rows first
  const int h = blockIdx.y, b = blockIdx.z, row0 = q0 + 64 * group + 16 * warp;
  const int64_t q_stride = static_cast<int64_t>(d.heads) * D;
  const int64_t kv_stride = static_cast<int64_t>(d.kv_heads) * D;
  const int64_t q_base = head_base<D>(b, h, d.seq, d.heads);
  const int64_t kv_base = head_base<D>(b, h / d.group, d.seq, d.kv_heads);
  const int kblocks = tiles(d.causal ? min(d.seq, q0 + kQRows) : d.seq, kTile);
  auto load_kv = [&](int j) {
    load_tile<D, kTile>(sm.k(j), a.k + kv_base, j * kTile, d.seq, kv_stride);
    load_tile<D, kTile>(sm.v(j), a.v + kv_base, j * kTile, d.seq, kv_stride);
  };
  load_tile<D, kQRows>(sm.q(), a.q + q_base, q0, d.seq, q_stride);
  load_tile<D, kQRows>(sm.d_o(), a.d_o + q_base, q0, d.seq, q_stride);
  load_kv(0);
  cp_async_commit();
  // The rows' lse and delta are read while the tiles arrive.
  float lse2[2], delta[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = row0 + acc_row(2 * half);
    const int64_t at = row_index(d, b, h, row);
    lse2[half] = row < d.seq ? a.lse[at] * kLog2e : 0.0f;
    delta[half] = row < d.seq ? a.delta[at] : 0.0f;
  }
  float dq[1][D / 8][4] = {};  // one row tile: the shape store_row takes
  for (int j = 0; j < kblocks; ++j) {
    publish_copies();  // tile j is in; every group is done with tile j - 1's stage
    if (j + 1 < kblocks) load_kv(j + 1);
    cp_async_commit();
    Scores s, dp;
    wgmma::begin();
    scores<D, kQRows>(s[0], sm.q(), 64 * group, sm.k(j));
    scores<D, kQRows>(dp[0], sm.d_o(), 64 * group, sm.v(j));
    wgmma::commit();
    wait_all<kTile, kTile>(s[0], dp[0]);
    dq_scores(s, dp, d, j * kTile, row0, lse2, delta);
    Operand ds;
    to_operand<1, kTile>(ds, s);
    wgmma::begin();
    times_rows<D>(dq[0], ds, sm.k(j));
    wgmma::commit();
    wgmma::wait<0>();
    wgmma::fence_operand<D>(dq[0]);
  }
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = row0 + acc_row(2 * half);
    if (row < d.seq) store_row<D, 1>(a.dq + q_base + row * q_stride, dq, 0, half, d.scale);
  }
}

// ---- dK/dV ----------------------------------------------------------------------------------

template <int D>
struct DkvSmem {
  uint16_t* base;
  __device__ uint16_t* k() const { return base; }
  __device__ uint16_t* v() const { return base + kDkvKeys * D; }
  __device__ uint16_t* q(int step) const { return base + (2 * kDkvKeys + (step % 2) * kTile) * D; }
  __device__ uint16_t* d_o(int step) const {
    return base + (2 * kDkvKeys + (2 + step % 2) * kTile) * D;
  }
  // Per stage, the query tile's lse (times log2 e; +inf past the end) and delta.
  __device__ float* rows(int step) const {
    return reinterpret_cast<float*>(base + (2 * kDkvKeys + 4 * kTile) * D) + (step % 2) * 2 * kTile;
  }
  static constexpr int bytes() {
    return (2 * kDkvKeys + 4 * kTile) * D * 2 + 4 * kTile * 4 + kSmemSlack;
  }
};

// P^T of query tile q0 for the warp's keys from key0 (st: S^T, the keys' rows; lse2 the tile's
// lse times log2 e), masked ones 0 (queries past the end have lse +inf: 0 too). In place.
__device__ __forceinline__ void probabilities_t(Scores& st, const Dims& d, int key0, int q0,
                                                const float* lse2) {
  const bool diagonal = d.causal && key0 + 15 > q0;  // some key of the warp after some query
  int first[2];  // queries before first[half] are masked for the lane's key of that half
#pragma unroll
  for (int half = 0; half < 2; ++half) first[half] = diagonal ? key0 + acc_row(2 * half) - q0 : 0;
#pragma unroll
  for (int n = 0; n < kTile / 8; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int col = acc_col(n, e);
      const float p = fast_exp2(st[0][n][e] * d.scale_log2 - lse2[col]);
      st[0][n][e] = col >= first[e / 2] ? p : 0.0f;
    }
  }
}

// A query row's lse (+inf past the end) and delta, as read: nothing is computed from them until
// they are stored, so that reading them waits for nothing.
struct RowValues {
  float lse = INFINITY, delta = 0.0f;
};

// The steps of a dK/dV block: the group's query heads in order, each over its query tiles from
// the first that the block's keys see.
template <int D>
struct DkvSteps {
  const Args& a;
  const DkvSmem<D>& sm;
  int b, hk, qb_first, qblocks, count;

  __device__ int head(int step) const { return hk * a.dims.group + step / qblocks; }
  __device__ int q0(int step) const { return (qb_first + step % qblocks) * kTile; }

  // Q and dO of the step's query tile into its stage (cp.async, not committed).
  __device__ void load_tiles(int step) const {
    const Dims& d = a.dims;
    const int64_t q_base = head_base<D>(b, head(step), d.seq, d.heads);
    const int64_t q_stride = static_cast<int64_t>(d.heads) * D;
    load_tile<D, kTile>(sm.q(step), a.q + q_base, q0(step), d.seq, q_stride);
    load_tile<D, kTile>(sm.d_o(step), a.d_o + q_base, q0(step), d.seq, q_stride);
  }

  // The step's row values for threads below kTile, read from global memory a step before they
  // are stored to shared memory, so that no step's first product waits for them.
  __device__ RowValues read_rows(int step) const {
    RowValues r;
    const int row = q0(step) + threadIdx.x;
    if (threadIdx.x < kTile && step < count && row < a.dims.seq) {
      const int64_t at = row_index(a.dims, b, head(step), row);
      r.lse = a.lse[at];
      r.delta = a.delta[at];
    }
    return r;
  }
  __device__ void store_rows(int step, const RowValues& r) const {
    if (threadIdx.x < kTile) {
      sm.rows(step)[threadIdx.x] = r.lse * kLog2e;
      sm.rows(step)[kTile + threadIdx.x] = r.delta;
    }
  }
};

// One step's products for the warpgroup's 64 keys (the warp's from key0) and query tile q0:
// S^T and dP^T, then dV += P^T dO (running while dS^T is worked out) and dK += dS^T Q.
template <int D>
__device__ __forceinline__ void dkdv_turn(const DkvSmem<D>& sm, const Dims& d, int group, int key0,
                                          int q0, int step, float (&dk)[D / 8][4],
                                          float (&dv)[D / 8][4]) {
  const float* lse2 = sm.rows(step);
  const float* delta = lse2 + kTile;
  Scores st, dpt;  // S^T and dP^T: the warp's 16 keys x the tile's queries
  wgmma::begin();
  scores<D, kDkvKeys>(st[0], sm.k(), 64 * group, sm.q(step));
  scores<D, kDkvKeys>(dpt[0], sm.v(), 64 * group, sm.d_o(step));
  wgmma::commit();
  wait_all<kTile, kTile>(st[0], dpt[0]);
  probabilities_t(st, d, key0, q0, lse2);
  Operand pt, dst;
  to_operand<1, kTile>(pt, st);
  wgmma::begin();
  times_rows<D>(dv, pt, sm.d_o(step));
  wgmma::commit();
#pragma unroll
  for (int n = 0; n < kTile / 8; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) st[0][n][e] *= dpt[0][n][e] - delta[acc_col(n, e)];
  }
  to_operand<1, kTile>(dst, st);
  wgmma::begin();
  times_rows<D>(dk, dst, sm.q(step));
  wgmma::commit();
  wait_all<D, D>(dv, dk);
}

template <int D>
__global__ void __launch_bounds__(kThreads, 1) dkdv_kernel(Args a) {
  extern __shared__ __align__(128) uint16_t smem[];
  const DkvSmem<D> sm{tiles_base(smem)};
  const Dims& d = a.dims;
  const int group = threadIdx.x / 128, warp = (threadIdx.x / 32) % 4;
  const int k0 = blockIdx.x * kDkvKeys, hk = blockIdx.y, b = blockIdx.z;
  const int key0 = k0 + 64 * group + 16 * warp;  // this warp's first key
  const int64_t kv_stride = static_cast<int64_t>(d.kv_heads) * D;
  const int64_t kv_base = head_base<D>(b, hk, d.seq, d.kv_heads);
  const int qb_first = d.causal ? k0 / kTile : 0, qblocks = tiles(d.seq, kTile) - qb_first;
  const DkvSteps<D> steps{a, sm, b, hk, qb_first, qblocks, d.group * qblocks};
  load_tile<D, kDkvKeys>(sm.k(), a.k + kv_base, k0, d.seq, kv_stride);
  load_tile<D, kDkvKeys>(sm.v(), a.v + kv_base, k0, d.seq, kv_stride);
  steps.load_tiles(0);
  cp_async_commit();
  steps.store_rows(0, steps.read_rows(0));
  RowValues ahead = steps.read_rows(1);
  float dk[1][D / 8][4] = {}, dv[1][D / 8][4] = {};  // one row tile: the shape store_row takes
  for (int it = 0; it < steps.count; ++it) {
    publish_copies();  // step it is in; every group is done with step it - 1's stage
    if (it + 1 < steps.count) {
      steps.load_tiles(it + 1);
      steps.store_rows(it + 1, ahead);
      ahead = steps.read_rows(it + 2);
    }
    cp_async_commit();
    dkdv_turn<D>(sm, d, group, key0, steps.q0(it), it, dk[0], dv[0]);
  }
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int key = key0 + acc_row(2 * half);
    if (key >= d.seq) continue;
    store_row<D, 1>(a.dk + kv_base + key * kv_stride, dk, 0, half, d.scale);
    store_row<D, 1>(a.dv + kv_base + key * kv_stride, dv, 0, half, 1.0f);
  }
}

// ---- launches -------------------------------------------------------------------------------

template <int D>
cudaError_t backward_d(const Backward& c, cudaStream_t stream) {
  const Args a = backward_args(c);
  const unsigned batch = static_cast<unsigned>(c.shape.batch);
  PIMHBM_CUDA_RETURN_IF_ERROR(launch(dkdv_kernel<D>,
                                     dim3(tiles(a.dims.seq, kDkvKeys), a.dims.kv_heads, batch),
                                     kThreads, DkvSmem<D>::bytes(), stream, a));
  return launch(dq_kernel<D>, dim3(tiles(a.dims.seq, kQRows), a.dims.heads, batch), kThreads,
                DqSmem<D>::bytes(), stream, a);
}

}  // namespace
}  // namespace pimhbm::attention::hopper

namespace pimhbm::attention {

cudaError_t backward_wgmma(const Backward& call, cudaStream_t stream) {
  if (!wgmma_head_dim(call.shape.head_dim)) return cudaErrorInvalidValue;
  PIMHBM_CUDA_RETURN_IF_ERROR(hopper::check_sm90());
  if (call.shape.q_elems() == 0) return cudaSuccess;
  PIMHBM_CUDA_RETURN_IF_ERROR(delta_cuda(call, stream));
  return call.shape.head_dim == 64 ? hopper::backward_d<64>(call, stream)
                                   : hopper::backward_d<128>(call, stream);
}

}  // namespace pimhbm::attention
