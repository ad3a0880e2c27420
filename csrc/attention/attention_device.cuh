// The pieces both attention kernels' families share: the problem's dimensions and the kernels'
// parameter, cp.async, the exp2 and bf16 packing they use, the 16-row accumulator layout of a
// warp's tensor-core products (mma.sync's m16n8 tiles, and each warp's quarter of a wgmma
// m64 tile: the same layout), and the online softmax over it.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "attention/attention.h"
#include "pimhbm/cuda_check.h"

namespace pimhbm::attention::device {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

__host__ __device__ constexpr int tiles(int n, int rows) { return (n + rows - 1) / rows; }

struct Dims {
  int seq, heads, kv_heads, group;
  bool causal;
  float scale, scale_log2;  // 1 / sqrt(head_dim), and times log2(e)
};

inline Dims dims_of(const Shape& s) {
  return Dims{static_cast<int>(s.seq),
              static_cast<int>(s.heads),
              static_cast<int>(s.kv_heads),
              static_cast<int>(s.group()),
              s.causal,
              s.scale(),
              s.scale() * kLog2e};
}

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

// 2^x from the special-function unit alone (ex2.approx.ftz: within 2 ulp, -inf gives 0);
// exp2f wraps the same instruction in range fix-ups this kernel's arguments never need.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// A warp's accumulator of a 16 x N product is float[N / 8][4]: tile n, element e holds row
// lane / 4 + 8 (e / 2), column 8 n + 2 (lane % 4) + e % 2.
__device__ __forceinline__ int lane_id() { return threadIdx.x % 32; }
__device__ __forceinline__ int acc_row(int e) { return lane_id() / 4 + 8 * (e / 2); }
__device__ __forceinline__ int acc_col(int n, int e) { return 8 * n + 2 * (lane_id() % 4) + e % 2; }

// 16 x N accumulators as the bf16 left operands of the next product: the layouts line up, so
// each lane converts its own values.
template <int M, int N>
__device__ __forceinline__ void to_operand(uint32_t (&a)[M][N / 16][4],
                                           const float (&c)[M][N / 8][4]) {
#pragma unroll
  for (int m = 0; m < M; ++m) {
#pragma unroll
    for (int kk = 0; kk < N / 16; ++kk) {
      a[m][kk][0] = pack_bf16(c[m][2 * kk][0], c[m][2 * kk][1]);
      a[m][kk][1] = pack_bf16(c[m][2 * kk][2], c[m][2 * kk][3]);
      a[m][kk][2] = pack_bf16(c[m][2 * kk + 1][0], c[m][2 * kk + 1][1]);
      a[m][kk][3] = pack_bf16(c[m][2 * kk + 1][2], c[m][2 * kk + 1][3]);
    }
  }
}

// Stores the row of row tile m, half `half` (rows acc_row(0) or acc_row(2)) scaled by `factor`
// as bf16.
template <int D, int M>
__device__ __forceinline__ void store_row(uint16_t* out, const float (&acc)[M][D / 8][4], int m,
                                          int half, float factor) {
  const int t = lane_id() % 4;
#pragma unroll
  for (int n = 0; n < D / 8; ++n) {
    *reinterpret_cast<uint32_t*>(out + 8 * n + 2 * t) =
        pack_bf16(factor * acc[m][n][2 * half], factor * acc[m][n][2 * half + 1]);
  }
}

struct Args {
  const uint16_t *q, *k, *v, *o, *d_o;
  const float* lse;
  uint16_t *out, *dq, *dk, *dv;
  float *lse_out, *delta;
  Dims dims;
};
// Past 128 bytes the compiler reads the parameter through its address and branches around the
// masks instead of selecting: the forward kernel ran ~25 % slower (bench/NOTES.md).
static_assert(sizeof(Args) <= 128, "the kernels' parameter must stay within 128 bytes");

inline Args forward_args(const Forward& c) {
  Args a{};
  a.q = c.q, a.k = c.k, a.v = c.v, a.out = c.o, a.lse_out = c.lse, a.dims = dims_of(c.shape);
  return a;
}

inline Args backward_args(const Backward& c) {
  Args a{};
  a.q = c.q, a.k = c.k, a.v = c.v, a.o = c.o, a.d_o = c.d_o, a.lse = c.lse;
  a.delta = c.delta, a.dq = c.dq, a.dk = c.dk, a.dv = c.dv, a.dims = dims_of(c.shape);
  return a;
}

// Where (batch b, head h)'s rows start in a [batch, seq, heads, D] tensor.
template <int D>
__device__ __forceinline__ int64_t head_base(int b, int h, int seq, int heads) {
  return (static_cast<int64_t>(b) * seq * heads + h) * D;
}

// Whether a tile of keys [k0, k0 + keys) needs the mask for rows from q0 on: it crosses the
// diagonal, or the sequence's end.
__device__ __forceinline__ bool needs_mask(const Dims& d, int k0, int keys, int q0) {
  return k0 + keys > d.seq || (d.causal && k0 + keys - 1 > q0);
}

__device__ __forceinline__ bool masked(const Dims& d, int key, int row) {
  return key >= d.seq || (d.causal && key > row);
}

// How many keys query row `row` sees: keys from here on are masked for it.
__device__ __forceinline__ int keys_seen(const Dims& d, int row) {
  return d.causal ? min(d.seq, row + 1) : d.seq;
}

// Where (batch b, head h, position row)'s entry of lse or delta is ([batch, heads, seq]).
__device__ __forceinline__ int64_t row_index(const Dims& d, int b, int h, int row) {
  return (static_cast<int64_t>(b) * d.heads + h) * d.seq + row;
}

// The online softmax of one key tile, for a row tile's two rows a lane (halves 0 and 1: rows
// acc_row(0) and acc_row(2)), in two parts so that a kernel can run the first while a product
// still writes the output rows. The first: s holds the tile's scores in log2 units (masked ones
// -inf) and becomes P; the running maxima m and the lane's partial sums l move on, and `alpha`
// is what the output rows must be scaled by.
template <int N>
__device__ __forceinline__ void softmax_scores(float (&s)[N / 8][4], float (&m)[2], float (&l)[2],
                                               float (&alpha)[2]) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    float mx = -INFINITY;
#pragma unroll
    for (int n = 0; n < N / 8; ++n) mx = fmaxf(mx, fmaxf(s[n][2 * half], s[n][2 * half + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));  // the row's four lanes
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m_new = fmaxf(m[half], mx);
    const float base = m_new == -INFINITY ? 0.0f : m_new;  // a row with no key yet stays 0
    alpha[half] = fast_exp2(m[half] - base);
    m[half] = m_new;
    l[half] *= alpha[half];
#pragma unroll
    for (int n = 0; n < N / 8; ++n) {
      s[n][2 * half] = fast_exp2(s[n][2 * half] - base);
      s[n][2 * half + 1] = fast_exp2(s[n][2 * half + 1] - base);
      l[half] += s[n][2 * half] + s[n][2 * half + 1];
    }
  }
}

// The second part: the output rows scaled by the first part's alpha.
template <int D>
__device__ __forceinline__ void rescale_rows(float (&acc)[D / 8][4], const float (&alpha)[2]) {
#pragma unroll
  for (int n = 0; n < D / 8; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[n][e] *= alpha[e / 2];
  }
}

// Both parts in one.
template <int D, int N>
__device__ __forceinline__ void softmax_tile(float (&s)[N / 8][4], float (&m)[2], float (&l)[2],
                                             float (&acc)[D / 8][4]) {
  float alpha[2];
  softmax_scores<N>(s, m, l, alpha);
  rescale_rows<D>(acc, alpha);
}

// The forward pass's end for a lane's row of half `half` of row tile `mi` (row `row`): the
// softmax's sum over the row's four lanes, the output row divided by it, and the row's lse
// (natural log). Every lane must call it (the sum's shuffles); rows past the end are not written.
template <int D, int M>
__device__ __forceinline__ void finish_row(const Args& a, const float (&acc)[M][D / 8][4], int mi,
                                           int half, float m, float l, int row, int b, int h,
                                           int64_t out_row0, int64_t row_stride) {
  float sum = l;
  sum += __shfl_xor_sync(0xffffffffu, sum, 1);
  sum += __shfl_xor_sync(0xffffffffu, sum, 2);
  if (row >= a.dims.seq) return;
  store_row<D, M>(a.out + out_row0 + row * row_stride, acc, mi, half, 1.0f / sum);
  if (lane_id() % 4 == 0) a.lse_out[row_index(a.dims, b, h, row)] = m * kLn2 + logf(sum);
}

// One launch of `kernel` with `smem` bytes of dynamic shared memory (the limit raised first).
template <typename Kernel>
cudaError_t launch(Kernel kernel, dim3 grid, int threads, int smem, cudaStream_t stream,
                   const Args& a) {
  PIMHBM_CUDA_RETURN_IF_ERROR(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  kernel<<<grid, threads, smem, stream>>>(a);
  PIMHBM_CUDA_RETURN_LAUNCH_ERROR();
  return cudaSuccess;
}

}  // namespace pimhbm::attention::device
