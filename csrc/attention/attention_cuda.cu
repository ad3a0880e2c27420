// Attention on the GPU: tiles of 64 queries by 64 keys, four warps a block, each warp 16 rows
// of the tile, bf16 tensor-core products (mma.sync m16n8k16, fp32 accumulation) on operands
// loaded from shared memory by ldmatrix; tiles arrive by cp.async while the previous one is in
// use. Rows past the sequence's end are zero-filled in shared memory, never read from global
// memory, and never written.
//
// forward: a block per (query tile, head, batch), the online softmax over key tiles in order.
// backward: delta (a warp per row), then dK/dV (a block per (key tile, kv head, batch), looping
// over the query heads of its group and their query tiles in order) and dQ (a block per
// (query tile, head, batch), looping over key tiles in order): every output written once, by
// one block, from sums in a fixed order.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <type_traits>

#include "attention/attention.h"
#include "attention/attention_device.cuh"
#include "pimhbm/cuda_check.h"

namespace pimhbm::attention {
namespace {

using namespace device;  // NOLINT(google-build-using-namespace): the kernels' own helpers

constexpr int kWarps = 4;  // a block's warps; each owns 16 M rows of the block's row tile
constexpr int kThreads = 32 * kWarps;

// The tilings (rows a warp owns = 16 M; tiles of kv rows they loop over). The forward pass and
// dQ own 32 query rows a warp (M = 2: each loaded fragment of K or V serves two row tiles);
// dK/dV own 16 key rows a warp (their two accumulators fill the registers) over 64-query tiles.
// The forward pass's key tiles: 64 keys, 32 at head dim 128 (64 would spill its registers).
template <int D>
__host__ __device__ constexpr int fwd_keys() {
  return D == 128 ? 32 : 64;
}
constexpr int kFwdM = 2;
constexpr int kDqM = 2, kDqKeys = 32;
constexpr int kDkvKeys = 16 * kWarps, kDkvQueries = 64;

// Shared-memory rows are D + 8 elements apart: the padding puts ldmatrix's 8 rows in 32 banks.
template <int D>
__host__ __device__ constexpr int stride_of() {
  return D + 8;
}

// ---- PTX ------------------------------------------------------------------------------------

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const uint16_t* p) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const uint16_t* p) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}

// c (16 x 8, fp32) += a (16 x 16, bf16, row) * b (16 x 8, bf16, col).
__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                    uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// ---- warp-level products (accumulators in the layout of attention_device.cuh) -------------

// One step (columns 16 kk .. 16 kk + 15 of K) of acc += A B^T for M row tiles: A's tile m is
// the 16 rows at `a` + 16 m rows, B is N rows at `b`, row-major in shared memory with row
// stride `stride`. Each fragment of B loaded serves all M tiles.
template <int M, int N>
__device__ __forceinline__ void abt_step(float (&acc)[M][N / 8][4], const uint16_t* a,
                                         const uint16_t* b, int stride, int kk) {
  const int lane = lane_id();
  uint32_t af[M][4];
#pragma unroll
  for (int m = 0; m < M; ++m) {
    ldmatrix_x4(af[m], a + (16 * m + lane % 16) * stride + kk * 16 + (lane / 16) * 8);
  }
#pragma unroll
  for (int np = 0; np < N / 16; ++np) {
    uint32_t bf[4];
    ldmatrix_x4(
        bf, b + (np * 16 + lane % 8 + (lane / 16) * 8) * stride + kk * 16 + ((lane / 8) % 2) * 8);
#pragma unroll
    for (int m = 0; m < M; ++m) {
      mma(acc[m][2 * np], af[m], bf[0], bf[1]);
      mma(acc[m][2 * np + 1], af[m], bf[2], bf[3]);
    }
  }
}

// acc += A B^T (both K wide).
template <int M, int K, int N>
__device__ __forceinline__ void mma_abt(float (&acc)[M][N / 8][4], const uint16_t* a,
                                        const uint16_t* b, int stride) {
#pragma unroll
  for (int kk = 0; kk < K / 16; ++kk) abt_step<M, N>(acc, a, b, stride, kk);
}

// Two products acc1 += A1 B1^T and acc2 += A2 B2^T in one pass over K: twice the independent
// accumulators between an accumulator's dependent tensor-core operations.
template <int M, int K, int N>
__device__ __forceinline__ void mma_abt_pair(float (&acc1)[M][N / 8][4], const uint16_t* a1,
                                             const uint16_t* b1, float (&acc2)[M][N / 8][4],
                                             const uint16_t* a2, const uint16_t* b2, int stride) {
#pragma unroll
  for (int kk = 0; kk < K / 16; ++kk) {
    abt_step<M, N>(acc1, a1, b1, stride, kk);
    abt_step<M, N>(acc2, a2, b2, stride, kk);
  }
}

// acc += A B for M row tiles: A (16 x K each) as bf16 fragments in registers, B K rows at `b`,
// N wide, row-major in shared memory.
template <int M, int K, int N>
__device__ __forceinline__ void mma_ab(float (&acc)[M][N / 8][4], const uint32_t (&a)[M][K / 16][4],
                                       const uint16_t* b, int stride) {
  const int lane = lane_id();
#pragma unroll
  for (int kk = 0; kk < K / 16; ++kk) {
#pragma unroll
    for (int dp = 0; dp < N / 16; ++dp) {
      uint32_t bf[4];
      ldmatrix_x4_trans(
          bf, b + (kk * 16 + lane % 8 + ((lane / 8) % 2) * 8) * stride + dp * 16 + (lane / 16) * 8);
#pragma unroll
      for (int m = 0; m < M; ++m) {
        mma(acc[m][2 * dp], a[m][kk], bf[0], bf[1]);
        mma(acc[m][2 * dp + 1], a[m][kk], bf[2], bf[3]);
      }
    }
  }
}

// ---- tiles ----------------------------------------------------------------------------------

// Rows [row0, row0 + ROWS) of the matrix at `base` (row stride `row_stride` elements, D wide)
// into `tile`; rows at or past `seq` are zero-filled.
template <int D, int ROWS>
__device__ __forceinline__ void load_tile(uint16_t* tile, const uint16_t* base, int row0, int seq,
                                          int64_t row_stride) {
  constexpr int kPieces = D / 8;  // 16 bytes each
  for (int i = threadIdx.x; i < ROWS * kPieces; i += kThreads) {
    const int r = i / kPieces, c = i % kPieces;
    const bool inside = row0 + r < seq;
    const uint16_t* src = inside ? base + (row0 + r) * row_stride + c * 8 : base;
    cp_async16(tile + r * stride_of<D>() + c * 8, src, inside);
  }
}

// A double-buffered loop's turn: asks for the tiles of step + 1 (`issue`, which commits them as
// one group; past the last step an empty group, so that the count in flight stays one), then
// waits for this step's and for every thread's view of them.
template <typename Issue>
__device__ __forceinline__ void next_tiles(Issue& issue, int step, int steps) {
  if (step + 1 < steps) {
    issue(step + 1);
  } else {
    cp_async_commit();
  }
  cp_async_wait<1>();
  __syncthreads();
}

// ---- forward --------------------------------------------------------------------------------

template <int D>
constexpr int forward_smem() {
  return (16 * kFwdM * kWarps + 2 * fwd_keys<D>()) * stride_of<D>() * 2;
}

// A block per (query tile of 16 M kWarps rows, head, batch): its key tiles in order, K of the
// next one arriving while V of this one is in use.
template <int D>
__global__ void __launch_bounds__(kThreads) forward_kernel(Args a) {
  constexpr int M = kFwdM, N = fwd_keys<D>(), S = stride_of<D>(), kQRows = 16 * M * kWarps;
  extern __shared__ __align__(16) uint16_t smem[];
  uint16_t *sq = smem, *sk = smem + kQRows * S, *sv = sk + N * S;
  const Dims& d = a.dims;
  const int warp = threadIdx.x / 32;
  const int q0 = (tiles(d.seq, kQRows) - 1 - blockIdx.x) * kQRows;  // the longest rows first
  const int h = blockIdx.y, b = blockIdx.z, row0 = q0 + 16 * M * warp;
  const int64_t q_stride = static_cast<int64_t>(d.heads) * D;
  const int64_t kv_stride = static_cast<int64_t>(d.kv_heads) * D;
  const int64_t q_base = head_base<D>(b, h, d.seq, d.heads);
  const int64_t kv_base = head_base<D>(b, h / d.group, d.seq, d.kv_heads);
  const int kblocks = tiles(d.causal ? min(d.seq, q0 + kQRows) : d.seq, N);

  load_tile<D, kQRows>(sq, a.q + q_base, q0, d.seq, q_stride);
  load_tile<D, N>(sk, a.k + kv_base, 0, d.seq, kv_stride);
  cp_async_commit();
  float acc[M][D / 8][4] = {};
  float m[M][2], l[M][2];
#pragma unroll
  for (int mi = 0; mi < M; ++mi) m[mi][0] = m[mi][1] = -INFINITY, l[mi][0] = l[mi][1] = 0.0f;
  for (int j = 0; j < kblocks; ++j) {
    const int k0 = j * N;
    load_tile<D, N>(sv, a.v + kv_base, k0, d.seq, kv_stride);
    cp_async_commit();
    cp_async_wait<1>();  // K_j
    __syncthreads();
    float s[M][N / 8][4] = {};
    mma_abt<M, D, N>(s, sq + 16 * M * warp * S, sk, S);
    __syncthreads();  // every warp is done with K_j
    if (j + 1 < kblocks) load_tile<D, N>(sk, a.k + kv_base, k0 + N, d.seq, kv_stride);
    cp_async_commit();
    const bool edge = needs_mask(d, k0, N, q0);
#pragma unroll
    for (int mi = 0; mi < M; ++mi) {
#pragma unroll
      for (int n = 0; n < N / 8; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const bool out = edge && masked(d, k0 + acc_col(n, e), row0 + 16 * mi + acc_row(e));
          s[mi][n][e] = out ? -INFINITY : s[mi][n][e] * d.scale_log2;
        }
      }
      softmax_tile<D, N>(s[mi], m[mi], l[mi], acc[mi]);
    }
    uint32_t p[M][N / 16][4];
    to_operand<M, N>(p, s);
    cp_async_wait<1>();  // V_j
    __syncthreads();
    mma_ab<M, N, D>(acc, p, sv, S);
    __syncthreads();  // every warp is done with V_j
  }
#pragma unroll
  for (int mi = 0; mi < M; ++mi) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      finish_row<D, M>(a, acc, mi, half, m[mi][half], l[mi][half],
                       row0 + 16 * mi + acc_row(2 * half), b, h, q_base, q_stride);
    }
  }
}

// ---- backward -------------------------------------------------------------------------------

// delta = rowsum(dO * O): a warp a (batch, position, head) row.
template <int D>
__global__ void delta_kernel(Args a, int64_t rows) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (row >= rows) return;  // uniform across the warp
  const uint32_t* o = reinterpret_cast<const uint32_t*>(a.o + row * D);
  const uint32_t* g = reinterpret_cast<const uint32_t*>(a.d_o + row * D);
  float sum = 0.0f;
  for (int i = lane_id(); i < D / 2; i += 32) {
    const uint32_t x = o[i], y = g[i];
    sum += __uint_as_float(x << 16) * __uint_as_float(y << 16) +
           __uint_as_float(x & 0xFFFF0000u) * __uint_as_float(y & 0xFFFF0000u);
  }
  for (int w = 16; w > 0; w /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, w);
  if (lane_id() != 0) return;
  const Dims& d = a.dims;
  const int64_t h = row % d.heads, t = (row / d.heads) % d.seq;
  const int64_t b = row / (d.heads * static_cast<int64_t>(d.seq));
  a.delta[(b * d.heads + h) * d.seq + t] = sum;
}

template <int D>
constexpr int dkdv_smem() {
  return (2 * kDkvKeys + 4 * kDkvQueries) * stride_of<D>() * 2 + 4 * kDkvQueries * 4;
}

// dK and dV of one key tile (a block per (key tile, kv head, batch)): the query tiles of each
// query head of the kv head's group, in order, two of them in flight.
template <int D>
__global__ void __launch_bounds__(kThreads) dkdv_kernel(Args a) {
  constexpr int N = kDkvQueries, S = stride_of<D>(), E = N * S;
  extern __shared__ __align__(16) uint16_t smem[];
  uint16_t *sk = smem, *sv = smem + kDkvKeys * S;
  uint16_t *sq = sv + kDkvKeys * S, *sdo = sq + 2 * E;   // 2 buffers each
  float* srows = reinterpret_cast<float*>(sdo + 2 * E);  // per buffer: lse log2(e), delta
  const Dims& d = a.dims;
  const int warp = threadIdx.x / 32, k0 = blockIdx.x * kDkvKeys, hk = blockIdx.y, b = blockIdx.z;
  const int64_t q_stride = static_cast<int64_t>(d.heads) * D;
  const int64_t kv_stride = static_cast<int64_t>(d.kv_heads) * D;
  const int64_t kv_base = head_base<D>(b, hk, d.seq, d.kv_heads);
  const int qb_first = d.causal ? k0 / N : 0, qblocks = tiles(d.seq, N) - qb_first;
  const int steps = d.group * qblocks;
  auto issue = [&](int step) {
    const int buf = step % 2, h = hk * d.group + step / qblocks;
    const int q0 = (qb_first + step % qblocks) * N;
    const int64_t q_base = head_base<D>(b, h, d.seq, d.heads);
    load_tile<D, N>(sq + buf * E, a.q + q_base, q0, d.seq, q_stride);
    load_tile<D, N>(sdo + buf * E, a.d_o + q_base, q0, d.seq, q_stride);
    if (threadIdx.x < N) {
      const int row = q0 + threadIdx.x;
      const int64_t at = row_index(d, b, h, row);
      srows[buf * 2 * N + threadIdx.x] = row < d.seq ? a.lse[at] * kLog2e : INFINITY;
      srows[buf * 2 * N + N + threadIdx.x] = row < d.seq ? a.delta[at] : 0.0f;
    }
    cp_async_commit();
  };

  load_tile<D, kDkvKeys>(sk, a.k + kv_base, k0, d.seq, kv_stride);
  load_tile<D, kDkvKeys>(sv, a.v + kv_base, k0, d.seq, kv_stride);
  issue(0);
  float dk[1][D / 8][4] = {}, dv[1][D / 8][4] = {};
  for (int it = 0; it < steps; ++it) {
    next_tiles(issue, it, steps);
    const int buf = it % 2, q0 = (qb_first + it % qblocks) * N;
    const uint16_t *tq = sq + buf * E, *tdo = sdo + buf * E;
    const float *lse2 = srows + buf * 2 * N, *delta = lse2 + N;
    const bool diagonal = d.causal && q0 < k0 + kDkvKeys && k0 < q0 + N;
    float p[1][N / 8][4] = {}, dp[1][N / 8][4] = {};  // the warp's 16 keys x the queries
    mma_abt_pair<1, D, N>(p, sk + 16 * warp * S, tq, dp, sv + 16 * warp * S, tdo, S);  // S^T, dP^T
#pragma unroll
    for (int n = 0; n < N / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = k0 + 16 * warp + acc_row(e), col = acc_col(n, e);
        const bool out = diagonal && key > q0 + col;  // rows past the end: lse is +inf
        p[0][n][e] = out ? 0.0f : fast_exp2(p[0][n][e] * d.scale_log2 - lse2[col]);
      }
    }
    uint32_t op[1][N / 16][4];
    to_operand<1, N>(op, p);
    mma_ab<1, N, D>(dv, op, tdo, S);  // dV += P^T dO
#pragma unroll
    for (int n = 0; n < N / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) p[0][n][e] *= dp[0][n][e] - delta[acc_col(n, e)];
    }
    to_operand<1, N>(op, p);
    mma_ab<1, N, D>(dk, op, tq, S);  // dK += dS^T Q
    __syncthreads();                 // every warp is done with this buffer
  }
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int key = k0 + 16 * warp + acc_row(2 * half);
    if (key >= d.seq) continue;
    store_row<D, 1>(a.dk + kv_base + key * kv_stride, dk, 0, half, d.scale);
    store_row<D, 1>(a.dv + kv_base + key * kv_stride, dv, 0, half, 1.0f);
  }
}

template <int D>
constexpr int dq_smem() {
  return (2 * 16 * kDqM * kWarps + 4 * kDqKeys) * stride_of<D>() * 2;
}

// dQ of one query tile (a block per (query tile, head, batch)): its key tiles in order, two of
// them in flight.
template <int D>
__global__ void __launch_bounds__(kThreads) dq_kernel(Args a) {
  constexpr int M = kDqM, N = kDqKeys, S = stride_of<D>(), E = N * S;
  constexpr int kQRows = 16 * M * kWarps;
  extern __shared__ __align__(16) uint16_t smem[];
  uint16_t *sq = smem, *sdo = smem + kQRows * S;
  uint16_t *sk = sdo + kQRows * S, *sv = sk + 2 * E;  // 2 buffers each
  const Dims& d = a.dims;
  const int warp = threadIdx.x / 32;
  const int q0 = (tiles(d.seq, kQRows) - 1 - blockIdx.x) * kQRows;
  const int h = blockIdx.y, b = blockIdx.z, row0 = q0 + 16 * M * warp;
  const int64_t q_stride = static_cast<int64_t>(d.heads) * D;
  const int64_t kv_stride = static_cast<int64_t>(d.kv_heads) * D;
  const int64_t q_base = head_base<D>(b, h, d.seq, d.heads);
  const int64_t kv_base = head_base<D>(b, h / d.group, d.seq, d.kv_heads);
  const int kblocks = tiles(d.causal ? min(d.seq, q0 + kQRows) : d.seq, N);
  float lse2[M][2], delta[M][2];
#pragma unroll
  for (int mi = 0; mi < M; ++mi) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = row0 + 16 * mi + acc_row(2 * half);
      const int64_t at = row_index(d, b, h, row);
      lse2[mi][half] = row < d.seq ? a.lse[at] * kLog2e : 0.0f;
      delta[mi][half] = row < d.seq ? a.delta[at] : 0.0f;
    }
  }
  auto issue = [&](int j) {
    load_tile<D, N>(sk + (j % 2) * E, a.k + kv_base, j * N, d.seq, kv_stride);
    load_tile<D, N>(sv + (j % 2) * E, a.v + kv_base, j * N, d.seq, kv_stride);
    cp_async_commit();
  };

  load_tile<D, kQRows>(sq, a.q + q_base, q0, d.seq, q_stride);
  load_tile<D, kQRows>(sdo, a.d_o + q_base, q0, d.seq, q_stride);
  issue(0);
  float dq[M][D / 8][4] = {};
  for (int j = 0; j < kblocks; ++j) {
    next_tiles(issue, j, kblocks);
    const uint16_t *tk = sk + (j % 2) * E, *tv = sv + (j % 2) * E;
    const int k0 = j * N;
    const bool edge = needs_mask(d, k0, N, q0);
    float p[M][N / 8][4] = {}, dp[M][N / 8][4] = {};  // S = Q K^T, dP = dO V^T
    mma_abt_pair<M, D, N>(p, sq + 16 * M * warp * S, tk, dp, sdo + 16 * M * warp * S, tv, S);
#pragma unroll
    for (int mi = 0; mi < M; ++mi) {
#pragma unroll
      for (int n = 0; n < N / 8; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const bool out = edge && masked(d, k0 + acc_col(n, e), row0 + 16 * mi + acc_row(e));
          p[mi][n][e] = out ? 0.0f : fast_exp2(p[mi][n][e] * d.scale_log2 - lse2[mi][e / 2]);
        }
      }
    }
#pragma unroll
    for (int mi = 0; mi < M; ++mi) {
#pragma unroll
      for (int n = 0; n < N / 8; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) p[mi][n][e] *= dp[mi][n][e] - delta[mi][e / 2];
      }
    }
    uint32_t op[M][N / 16][4];
    to_operand<M, N>(op, p);
    mma_ab<M, N, D>(dq, op, tk, S);  // dQ += dS K
    __syncthreads();                 // every warp is done with this buffer
  }
#pragma unroll
  for (int mi = 0; mi < M; ++mi) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = row0 + 16 * mi + acc_row(2 * half);
      if (row < d.seq) store_row<D, M>(a.dq + q_base + row * q_stride, dq, mi, half, d.scale);
    }
  }
}

// ---- launches -------------------------------------------------------------------------------

template <int D>
cudaError_t forward_d(const Forward& c, cudaStream_t stream) {
  const Args a = forward_args(c);
  const dim3 grid(tiles(a.dims.seq, 16 * kFwdM * kWarps), a.dims.heads,
                  static_cast<unsigned>(c.shape.batch));
  return launch(forward_kernel<D>, grid, kThreads, forward_smem<D>(), stream, a);
}

template <int D>
cudaError_t delta_d(const Backward& c, cudaStream_t stream) {
  const int64_t rows = c.shape.rows();
  constexpr int kRowsPerBlock = 8;
  delta_kernel<D><<<static_cast<unsigned>((rows + kRowsPerBlock - 1) / kRowsPerBlock),
                    32 * kRowsPerBlock, 0, stream>>>(backward_args(c), rows);
  PIMHBM_CUDA_RETURN_LAUNCH_ERROR();
  return cudaSuccess;
}

template <int D>
cudaError_t backward_d(const Backward& c, cudaStream_t stream) {
  PIMHBM_CUDA_RETURN_IF_ERROR(delta_d<D>(c, stream));
  const Args a = backward_args(c);
  const unsigned batch = static_cast<unsigned>(c.shape.batch);
  PIMHBM_CUDA_RETURN_IF_ERROR(launch(dkdv_kernel<D>,
                                     dim3(tiles(a.dims.seq, kDkvKeys), a.dims.kv_heads, batch),
                                     kThreads, dkdv_smem<D>(), stream, a));
  return launch(dq_kernel<D>, dim3(tiles(a.dims.seq, 16 * kDqM * kWarps), a.dims.heads, batch),
                kThreads, dq_smem<D>(), stream, a);
}

// `run` instantiated for the call's head dim (a std::integral_constant); supported_head_dim()
// is checked before a call gets here.
template <typename Run>
cudaError_t by_head_dim(int64_t head_dim, Run run) {
  switch (head_dim) {
    case 16:
      return run(std::integral_constant<int, 16>{});
    case 32:
      return run(std::integral_constant<int, 32>{});
    case 64:
      return run(std::integral_constant<int, 64>{});
    case 128:
      return run(std::integral_constant<int, 128>{});
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace

cudaError_t forward_cuda(const Forward& call, cudaStream_t stream) {
  if (call.shape.q_elems() == 0) return cudaSuccess;
  return by_head_dim(call.shape.head_dim,
                     [&](auto d) { return forward_d<decltype(d)::value>(call, stream); });
}

cudaError_t backward_cuda(const Backward& call, cudaStream_t stream) {
  if (call.shape.q_elems() == 0) return cudaSuccess;
  return by_head_dim(call.shape.head_dim,
                     [&](auto d) { return backward_d<decltype(d)::value>(call, stream); });
}

cudaError_t delta_cuda(const Backward& call, cudaStream_t stream) {
  if (call.shape.q_elems() == 0) return cudaSuccess;
  return by_head_dim(call.shape.head_dim,
                     [&](auto d) { return delta_d<decltype(d)::value>(call, stream); });
}

}  // namespace pimhbm::attention
