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

#include "attention/attention.h"
#include "pimhbm/cuda_check.h"

namespace pimhbm::attention {
namespace {

constexpr int kRows = 64;  // a tile's queries or keys
constexpr int kWarps = 4;  // each owns 16 rows of its block's tile
constexpr int kThreads = 32 * kWarps;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

template <int D>
struct Tile {
  static constexpr int kStride = D + 8;  // the padding puts ldmatrix's 8 rows in 32 banks
  static constexpr int kElems = kRows * kStride;
  static constexpr int kBytes = kElems * 2;
};

struct Dims {
  int seq, heads, kv_heads, group, blocks;  // blocks: tiles along the sequence
  bool causal;
  float scale, scale_log2;  // 1 / sqrt(head_dim), and times log2(e)
};

Dims dims_of(const Shape& s) {
  return Dims{static_cast<int>(s.seq),      static_cast<int>(s.heads),
              static_cast<int>(s.kv_heads), static_cast<int>(s.group()),
              static_cast<int>((s.seq + kRows - 1) / kRows),
              s.causal,                     s.scale(),
              s.scale() * kLog2e};
}

// ---- PTX ------------------------------------------------------------------------------------

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool inside) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const int bytes = inside ? 16 : 0;  // 0: the 16 bytes are zero-filled, nothing is read
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

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

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// ---- warp-level products --------------------------------------------------------------------
// A warp's accumulator of a 16 x N product is float[N / 8][4]: tile n, element e holds row
// lane / 4 + 8 (e / 2), column 8 n + 2 (lane % 4) + e % 2.

__device__ __forceinline__ int lane_id() { return threadIdx.x % 32; }
__device__ __forceinline__ int acc_row(int e) { return lane_id() / 4 + 8 * (e / 2); }
__device__ __forceinline__ int acc_col(int n, int e) { return 8 * n + 2 * (lane_id() % 4) + e % 2; }

// acc += A B^T: A is 16 rows at `a`, B is N rows at `b`, both K wide, row-major in shared
// memory with row stride `stride`.
template <int K, int N>
__device__ __forceinline__ void mma_abt(float (&acc)[N / 8][4], const uint16_t* a,
                                        const uint16_t* b, int stride) {
  const int lane = lane_id();
#pragma unroll
  for (int kk = 0; kk < K / 16; ++kk) {
    uint32_t af[4];
    ldmatrix_x4(af, a + (lane % 16) * stride + kk * 16 + (lane / 16) * 8);
#pragma unroll
    for (int np = 0; np < N / 16; ++np) {
      uint32_t bf[4];
      ldmatrix_x4(bf, b + (np * 16 + lane % 8 + (lane / 16) * 8) * stride + kk * 16 +
                          ((lane / 8) % 2) * 8);
      mma(acc[2 * np], af, bf[0], bf[1]);
      mma(acc[2 * np + 1], af, bf[2], bf[3]);
    }
  }
}

// acc += A B: A (16 x K) as bf16 fragments in registers, B K rows at `b`, N wide, row-major in
// shared memory.
template <int K, int N>
__device__ __forceinline__ void mma_ab(float (&acc)[N / 8][4], const uint32_t (&a)[K / 16][4],
                                       const uint16_t* b, int stride) {
  const int lane = lane_id();
#pragma unroll
  for (int kk = 0; kk < K / 16; ++kk) {
#pragma unroll
    for (int dp = 0; dp < N / 16; ++dp) {
      uint32_t bf[4];
      ldmatrix_x4_trans(bf, b + (kk * 16 + lane % 8 + ((lane / 8) % 2) * 8) * stride + dp * 16 +
                                (lane / 16) * 8);
      mma(acc[2 * dp], a[kk], bf[0], bf[1]);
      mma(acc[2 * dp + 1], a[kk], bf[2], bf[3]);
    }
  }
}

// A 16 x N accumulator as the bf16 left operand of the next product: the layouts line up, so
// each lane converts its own values.
template <int N>
__device__ __forceinline__ void to_operand(uint32_t (&a)[N / 16][4], const float (&c)[N / 8][4]) {
#pragma unroll
  for (int kk = 0; kk < N / 16; ++kk) {
    a[kk][0] = pack_bf16(c[2 * kk][0], c[2 * kk][1]);
    a[kk][1] = pack_bf16(c[2 * kk][2], c[2 * kk][3]);
    a[kk][2] = pack_bf16(c[2 * kk + 1][0], c[2 * kk + 1][1]);
    a[kk][3] = pack_bf16(c[2 * kk + 1][2], c[2 * kk + 1][3]);
  }
}

// ---- tiles ----------------------------------------------------------------------------------

// Rows [row0, row0 + 64) of the matrix at `base` (row stride `row_stride` elements, D wide)
// into `tile`; rows at or past `seq` are zero-filled.
template <int D>
__device__ __forceinline__ void load_tile(uint16_t* tile, const uint16_t* base, int row0, int seq,
                                          int64_t row_stride) {
  constexpr int kPieces = D / 8;  // 16 bytes each
  for (int i = threadIdx.x; i < kRows * kPieces; i += kThreads) {
    const int r = i / kPieces, c = i % kPieces;
    const bool inside = row0 + r < seq;
    const uint16_t* src = inside ? base + (row0 + r) * row_stride + c * 8 : base;
    cp_async16(tile + r * Tile<D>::kStride + c * 8, src, inside);
  }
}

// Stores row `row` (of 16 x D accumulator rows e / 2) scaled by `factor` as bf16.
template <int D>
__device__ __forceinline__ void store_row(uint16_t* out, const float (&acc)[D / 8][4], int half,
                                          float factor) {
  const int t = lane_id() % 4;
#pragma unroll
  for (int n = 0; n < D / 8; ++n) {
    *reinterpret_cast<uint32_t*>(out + 8 * n + 2 * t) =
        pack_bf16(factor * acc[n][2 * half], factor * acc[n][2 * half + 1]);
  }
}

struct Args {
  const uint16_t *q, *k, *v, *o, *d_o;
  const float* lse;
  uint16_t *out, *dq, *dk, *dv;
  float *lse_out, *delta;
  Dims dims;
};

// Where (batch b, head h)'s rows start in a [batch, seq, heads, D] tensor.
template <int D>
__device__ __forceinline__ int64_t head_base(int b, int h, int seq, int heads) {
  return (static_cast<int64_t>(b) * seq * heads + h) * D;
}

}  // namespace

namespace {

// ---- forward --------------------------------------------------------------------------------

// One key tile of the online softmax of the lane's two rows (halves 0 and 1: rows acc_row(0)
// and acc_row(2)): s holds the tile's scores in log2 units (masked ones -inf) and becomes P;
// the running maxima m, the lane's partial sums l and the output rows acc are rescaled.
template <int D>
__device__ __forceinline__ void softmax_tile(float (&s)[kRows / 8][4], float (&m)[2],
                                             float (&l)[2], float (&acc)[D / 8][4]) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    float mx = -INFINITY;
#pragma unroll
    for (int n = 0; n < kRows / 8; ++n) mx = fmaxf(mx, fmaxf(s[n][2 * half], s[n][2 * half + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));  // the row's four lanes
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m_new = fmaxf(m[half], mx);
    const float base = m_new == -INFINITY ? 0.0f : m_new;  // a row with no key yet stays 0
    const float alpha = exp2f(m[half] - base);
    m[half] = m_new;
    l[half] *= alpha;
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      acc[n][2 * half] *= alpha;
      acc[n][2 * half + 1] *= alpha;
    }
#pragma unroll
    for (int n = 0; n < kRows / 8; ++n) {
      s[n][2 * half] = exp2f(s[n][2 * half] - base);
      s[n][2 * half + 1] = exp2f(s[n][2 * half + 1] - base);
      l[half] += s[n][2 * half] + s[n][2 * half + 1];
    }
  }
}

template <int D>
__global__ void __launch_bounds__(kThreads) forward_kernel(Args a) {
  constexpr int S = Tile<D>::kStride, E = Tile<D>::kElems;
  extern __shared__ __align__(16) uint16_t smem[];
  uint16_t *sq = smem, *sk = smem + E, *sv = smem + 2 * E;
  const Dims& d = a.dims;
  const int warp = threadIdx.x / 32;
  const int q0 = (d.blocks - 1 - blockIdx.x) * kRows;  // the longest rows of keys first
  const int h = blockIdx.y, b = blockIdx.z, row0 = q0 + 16 * warp;
  const int64_t q_stride = static_cast<int64_t>(d.heads) * D;
  const int64_t kv_stride = static_cast<int64_t>(d.kv_heads) * D;
  const int64_t q_base = head_base<D>(b, h, d.seq, d.heads);
  const int64_t kv_base = head_base<D>(b, h / d.group, d.seq, d.kv_heads);
  const int kv_end = d.causal ? min(d.seq, q0 + kRows) : d.seq;
  const int kblocks = (kv_end + kRows - 1) / kRows;

  load_tile<D>(sq, a.q + q_base, q0, d.seq, q_stride);
  load_tile<D>(sk, a.k + kv_base, 0, d.seq, kv_stride);
  cp_async_commit();
  float acc[D / 8][4] = {};
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  for (int j = 0; j < kblocks; ++j) {
    const int k0 = j * kRows;
    load_tile<D>(sv, a.v + kv_base, k0, d.seq, kv_stride);
    cp_async_commit();
    cp_async_wait<1>();  // K_j
    __syncthreads();
    float s[kRows / 8][4] = {};
    mma_abt<D, kRows>(s, sq + 16 * warp * S, sk, S);
    __syncthreads();  // every warp is done with K_j
    if (j + 1 < kblocks) load_tile<D>(sk, a.k + kv_base, k0 + kRows, d.seq, kv_stride);
    cp_async_commit();
    const bool edge = j == kblocks - 1;  // the diagonal, or the sequence's end
#pragma unroll
    for (int n = 0; n < kRows / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = k0 + acc_col(n, e), row = row0 + acc_row(e);
        const bool masked = edge && (col >= d.seq || (d.causal && col > row));
        s[n][e] = masked ? -INFINITY : s[n][e] * d.scale_log2;
      }
    }
    softmax_tile<D>(s, m, l, acc);
    uint32_t p[kRows / 16][4];
    to_operand<kRows>(p, s);
    cp_async_wait<1>();  // V_j
    __syncthreads();
    mma_ab<kRows, D>(acc, p, sv, S);
    __syncthreads();  // every warp is done with V_j
  }
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    l[half] += __shfl_xor_sync(0xffffffffu, l[half], 1);
    l[half] += __shfl_xor_sync(0xffffffffu, l[half], 2);
    const int row = row0 + acc_row(2 * half);
    if (row >= d.seq) continue;
    store_row<D>(a.out + q_base + row * q_stride, acc, half, 1.0f / l[half]);
    if (lane_id() % 4 == 0) {
      a.lse_out[(static_cast<int64_t>(b) * d.heads + h) * d.seq + row] =
          m[half] * kLn2 + logf(l[half]);
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
  const int64_t h = row % d.heads, t = (row / d.heads) % d.seq, b = row / (d.heads * static_cast<int64_t>(d.seq));
  a.delta[(b * d.heads + h) * d.seq + t] = sum;
}

// dK and dV of one key tile: the query tiles of each query head of the kv head's group, in
// order, two of them in flight.
template <int D>
__global__ void __launch_bounds__(kThreads) dkdv_kernel(Args a) {
  constexpr int S = Tile<D>::kStride, E = Tile<D>::kElems;
  extern __shared__ __align__(16) uint16_t smem[];
  uint16_t *sk = smem, *sv = smem + E, *sq = smem + 2 * E, *sdo = smem + 4 * E;  // 2 buffers
  float* srows = reinterpret_cast<float*>(smem + 6 * E);  // per buffer: lse * log2(e), delta
  const Dims& d = a.dims;
  const int warp = threadIdx.x / 32, k0 = blockIdx.x * kRows, hk = blockIdx.y, b = blockIdx.z;
  const int64_t q_stride = static_cast<int64_t>(d.heads) * D;
  const int64_t kv_stride = static_cast<int64_t>(d.kv_heads) * D;
  const int64_t kv_base = head_base<D>(b, hk, d.seq, d.kv_heads);
  const int qb_first = d.causal ? blockIdx.x : 0, qblocks = d.blocks - qb_first;
  const int steps = d.group * qblocks;
  auto issue = [&](int step) {
    const int buf = step % 2, h = hk * d.group + step / qblocks;
    const int q0 = (qb_first + step % qblocks) * kRows;
    const int64_t q_base = head_base<D>(b, h, d.seq, d.heads);
    load_tile<D>(sq + buf * E, a.q + q_base, q0, d.seq, q_stride);
    load_tile<D>(sdo + buf * E, a.d_o + q_base, q0, d.seq, q_stride);
    if (threadIdx.x < kRows) {
      const int row = q0 + threadIdx.x;
      const int64_t at = (static_cast<int64_t>(b) * d.heads + h) * d.seq + row;
      srows[buf * 2 * kRows + threadIdx.x] = row < d.seq ? a.lse[at] * kLog2e : INFINITY;
      srows[buf * 2 * kRows + kRows + threadIdx.x] = row < d.seq ? a.delta[at] : 0.0f;
    }
    cp_async_commit();
  };

  load_tile<D>(sk, a.k + kv_base, k0, d.seq, kv_stride);
  load_tile<D>(sv, a.v + kv_base, k0, d.seq, kv_stride);
  issue(0);
  float dk[D / 8][4] = {}, dv[D / 8][4] = {};
  for (int it = 0; it < steps; ++it) {
    if (it + 1 < steps) {
      issue(it + 1);
    } else {
      cp_async_commit();
    }
    cp_async_wait<1>();
    __syncthreads();
    const int buf = it % 2, q0 = (qb_first + it % qblocks) * kRows;
    const uint16_t *tq = sq + buf * E, *tdo = sdo + buf * E;
    const float *lse2 = srows + buf * 2 * kRows, *delta = lse2 + kRows;
    const bool diagonal = d.causal && q0 == k0;
    float p[kRows / 8][4] = {};  // P^T: the warp's 16 keys x the tile's 64 queries
    mma_abt<D, kRows>(p, sk + 16 * warp * S, tq, S);
#pragma unroll
    for (int n = 0; n < kRows / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = k0 + 16 * warp + acc_row(e), col = acc_col(n, e);
        p[n][e] = diagonal && key > q0 + col ? 0.0f : exp2f(p[n][e] * d.scale_log2 - lse2[col]);
      }
    }
    uint32_t op[kRows / 16][4];
    to_operand<kRows>(op, p);
    mma_ab<kRows, D>(dv, op, tdo, S);  // dV += P^T dO
    float dp[kRows / 8][4] = {};
    mma_abt<D, kRows>(dp, sv + 16 * warp * S, tdo, S);  // dP^T = V dO^T
#pragma unroll
    for (int n = 0; n < kRows / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) p[n][e] *= dp[n][e] - delta[acc_col(n, e)];
    }
    to_operand<kRows>(op, p);
    mma_ab<kRows, D>(dk, op, tq, S);  // dK += dS^T Q
    __syncthreads();  // every warp is done with this buffer
  }
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int key = k0 + 16 * warp + acc_row(2 * half);
    if (key >= d.seq) continue;
    store_row<D>(a.dk + kv_base + key * kv_stride, dk, half, d.scale);
    store_row<D>(a.dv + kv_base + key * kv_stride, dv, half, 1.0f);
  }
}

// dQ of one query tile: its key tiles in order, two of them in flight.
template <int D>
__global__ void __launch_bounds__(kThreads) dq_kernel(Args a) {
  constexpr int S = Tile<D>::kStride, E = Tile<D>::kElems;
  extern __shared__ __align__(16) uint16_t smem[];
  uint16_t *sq = smem, *sdo = smem + E, *sk = smem + 2 * E, *sv = smem + 4 * E;  // 2 buffers
  const Dims& d = a.dims;
  const int warp = threadIdx.x / 32;
  const int q0 = (d.blocks - 1 - blockIdx.x) * kRows;
  const int h = blockIdx.y, b = blockIdx.z, row0 = q0 + 16 * warp;
  const int64_t q_stride = static_cast<int64_t>(d.heads) * D;
  const int64_t kv_stride = static_cast<int64_t>(d.kv_heads) * D;
  const int64_t q_base = head_base<D>(b, h, d.seq, d.heads);
  const int64_t kv_base = head_base<D>(b, h / d.group, d.seq, d.kv_heads);
  const int kv_end = d.causal ? min(d.seq, q0 + kRows) : d.seq;
  const int kblocks = (kv_end + kRows - 1) / kRows;
  float lse2[2], delta[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = row0 + acc_row(2 * half);
    const int64_t at = (static_cast<int64_t>(b) * d.heads + h) * d.seq + row;
    lse2[half] = row < d.seq ? a.lse[at] * kLog2e : 0.0f;
    delta[half] = row < d.seq ? a.delta[at] : 0.0f;
  }
  auto issue = [&](int j) {
    load_tile<D>(sk + (j % 2) * E, a.k + kv_base, j * kRows, d.seq, kv_stride);
    load_tile<D>(sv + (j % 2) * E, a.v + kv_base, j * kRows, d.seq, kv_stride);
    cp_async_commit();
  };

  load_tile<D>(sq, a.q + q_base, q0, d.seq, q_stride);
  load_tile<D>(sdo, a.d_o + q_base, q0, d.seq, q_stride);
  issue(0);
  float dq[D / 8][4] = {};
  for (int j = 0; j < kblocks; ++j) {
    if (j + 1 < kblocks) {
      issue(j + 1);
    } else {
      cp_async_commit();
    }
    cp_async_wait<1>();
    __syncthreads();
    const uint16_t *tk = sk + (j % 2) * E, *tv = sv + (j % 2) * E;
    const int k0 = j * kRows;
    const bool edge = j == kblocks - 1;
    float p[kRows / 8][4] = {};
    mma_abt<D, kRows>(p, sq + 16 * warp * S, tk, S);
#pragma unroll
    for (int n = 0; n < kRows / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = k0 + acc_col(n, e), row = row0 + acc_row(e);
        const bool masked = edge && (col >= d.seq || (d.causal && col > row));
        p[n][e] = masked ? 0.0f : exp2f(p[n][e] * d.scale_log2 - lse2[e / 2]);
      }
    }
    float dp[kRows / 8][4] = {};
    mma_abt<D, kRows>(dp, sdo + 16 * warp * S, tv, S);  // dP = dO V^T
#pragma unroll
    for (int n = 0; n < kRows / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) p[n][e] *= dp[n][e] - delta[e / 2];
    }
    uint32_t op[kRows / 16][4];
    to_operand<kRows>(op, p);
    mma_ab<kRows, D>(dq, op, tk, S);  // dQ += dS K
    __syncthreads();  // every warp is done with this buffer
  }
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = row0 + acc_row(2 * half);
    if (row < d.seq) store_row<D>(a.dq + q_base + row * q_stride, dq, half, d.scale);
  }
}

// ---- launches -------------------------------------------------------------------------------

template <typename Kernel>
cudaError_t launch(Kernel kernel, dim3 grid, int smem, cudaStream_t stream, const Args& a) {
  PIMHBM_CUDA_RETURN_IF_ERROR(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  kernel<<<grid, kThreads, smem, stream>>>(a);
  PIMHBM_CUDA_RETURN_LAUNCH_ERROR();
  return cudaSuccess;
}

template <int D>
cudaError_t forward_d(const Forward& c, cudaStream_t stream) {
  Args a{};
  a.q = c.q, a.k = c.k, a.v = c.v, a.out = c.o, a.lse_out = c.lse, a.dims = dims_of(c.shape);
  const dim3 grid(a.dims.blocks, a.dims.heads, static_cast<unsigned>(c.shape.batch));
  return launch(forward_kernel<D>, grid, 3 * Tile<D>::kBytes, stream, a);
}

template <int D>
cudaError_t backward_d(const Backward& c, cudaStream_t stream) {
  Args a{};
  a.q = c.q, a.k = c.k, a.v = c.v, a.o = c.o, a.d_o = c.d_o, a.lse = c.lse;
  a.delta = c.delta, a.dq = c.dq, a.dk = c.dk, a.dv = c.dv, a.dims = dims_of(c.shape);
  const int64_t rows = c.shape.rows();
  constexpr int kRowsPerBlock = 8;
  delta_kernel<D><<<static_cast<unsigned>((rows + kRowsPerBlock - 1) / kRowsPerBlock),
                    32 * kRowsPerBlock, 0, stream>>>(a, rows);
  PIMHBM_CUDA_RETURN_LAUNCH_ERROR();
  const unsigned batch = static_cast<unsigned>(c.shape.batch);
  PIMHBM_CUDA_RETURN_IF_ERROR(launch(dkdv_kernel<D>, dim3(a.dims.blocks, a.dims.kv_heads, batch),
                                     6 * Tile<D>::kBytes + 4 * kRows * 4, stream, a));
  return launch(dq_kernel<D>, dim3(a.dims.blocks, a.dims.heads, batch), 6 * Tile<D>::kBytes,
                stream, a);
}

}  // namespace

cudaError_t forward_cuda(const Forward& call, cudaStream_t stream) {
  if (call.shape.q_elems() == 0) return cudaSuccess;
  return call.shape.head_dim == 64 ? forward_d<64>(call, stream) : forward_d<128>(call, stream);
}

cudaError_t backward_cuda(const Backward& call, cudaStream_t stream) {
  if (call.shape.q_elems() == 0) return cudaSuccess;
  return call.shape.head_dim == 64 ? backward_d<64>(call, stream) : backward_d<128>(call, stream);
}

}  // namespace pimhbm::attention
