// The in-place update on the GPU (inplace.h): one block per parity group, its chunks in order.
// Each thread takes groups of four elements with vector loads of every tensor, updates them in
// registers and stores them back; the block sums the old and the new digest terms of the chunk
// (the sums of adamw_kernel.cuh), decides the chunk's verdict, and folds the chunk's change into
// the group's parity, both kept in shared memory as three words an element (the parameter --
// with bf16 parameters its low half, the master remainder its high half --, mu, nu).
#include <cuda_runtime.h>

#include <algorithm>
#include <vector>

#include "pimhbm/cuda_check.h"
#include "update/adamw_kernel.cuh"
#include "update/inplace.h"
#include "update/inplace_math.h"

namespace pimhbm::update {
namespace {

using kernel::kThreads;
using kernel::Sums;

constexpr int kMaxLeaves = 64;
struct Table {
  InPlaceLeaf leaf[kMaxLeaves];
  int64_t first_group[kMaxLeaves + 1];
  int count;
};
static_assert(sizeof(Table) < 32000, "the leaf table must fit the kernel parameters");

// The change of a chunk and the group's parity, per element: word w of element e at [w * ce + e].
struct Rows {
  uint32_t* acc;    // the group's parity change (null without parity)
  uint32_t* delta;  // the chunk's change
  int64_t ce;
};

template <bool kBF16, bool kMaster>
__device__ __forceinline__ ElemState load_elem(const InPlaceLeaf& L, int64_t i) {
  ElemState x;
  x.p = kBF16 ? static_cast<const uint16_t*>(L.p)[i] : static_cast<const uint32_t*>(L.p)[i];
  x.r = kMaster ? L.master[i] : 0u;
  x.mu = L.mu[i];
  x.nu = L.nu[i];
  return x;
}

// Four elements at e of the state and at ge of the gradient (all in bounds; vector loads).
template <bool kBF16, bool kMaster>
__device__ __forceinline__ void load4(const InPlaceLeaf& L, const void* g, int64_t e, int64_t ge,
                                      ElemState (&x)[4], float (&gv)[4]) {
  uint32_t p[4], gw[4], r[4] = {0, 0, 0, 0};
  if constexpr (kBF16) {
    const uint2 pv = __ldcs(reinterpret_cast<const uint2*>(static_cast<const uint16_t*>(L.p) + e));
    const uint2 gvv = __ldcs(reinterpret_cast<const uint2*>(static_cast<const uint16_t*>(g) + ge));
    p[0] = pv.x & 0xFFFFu, p[1] = pv.x >> 16, p[2] = pv.y & 0xFFFFu, p[3] = pv.y >> 16;
    gw[0] = gvv.x & 0xFFFFu, gw[1] = gvv.x >> 16, gw[2] = gvv.y & 0xFFFFu, gw[3] = gvv.y >> 16;
  } else {
    const uint4 pv = __ldcs(reinterpret_cast<const uint4*>(static_cast<const uint32_t*>(L.p) + e));
    const uint4 gvv = __ldcs(reinterpret_cast<const uint4*>(static_cast<const uint32_t*>(g) + ge));
    p[0] = pv.x, p[1] = pv.y, p[2] = pv.z, p[3] = pv.w;
    gw[0] = gvv.x, gw[1] = gvv.y, gw[2] = gvv.z, gw[3] = gvv.w;
  }
  if constexpr (kMaster) {
    const uint2 rv = __ldcs(reinterpret_cast<const uint2*>(L.master + e));
    r[0] = rv.x & 0xFFFFu, r[1] = rv.x >> 16, r[2] = rv.y & 0xFFFFu, r[3] = rv.y >> 16;
  }
  const float4 mu = __ldcs(reinterpret_cast<const float4*>(L.mu + e));
  const float4 nu = __ldcs(reinterpret_cast<const float4*>(L.nu + e));
  const float mus[4] = {mu.x, mu.y, mu.z, mu.w}, nus[4] = {nu.x, nu.y, nu.z, nu.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    x[k] = ElemState{p[k], r[k], mus[k], nus[k]};
    gv[k] = kernel::param_value(gw[k], kBF16);
  }
}

template <bool kBF16, bool kMaster>
__device__ __forceinline__ void store4(const InPlaceLeaf& L, int64_t e, const ElemState (&x)[4]) {
  if constexpr (kBF16) {
    *reinterpret_cast<uint2*>(static_cast<uint16_t*>(L.p) + e) =
        make_uint2(x[0].p | x[1].p << 16, x[2].p | x[3].p << 16);
  } else {
    *reinterpret_cast<uint4*>(static_cast<uint32_t*>(L.p) + e) =
        make_uint4(x[0].p, x[1].p, x[2].p, x[3].p);
  }
  if constexpr (kMaster) {
    *reinterpret_cast<uint2*>(L.master + e) =
        make_uint2(x[0].r | x[1].r << 16, x[2].r | x[3].r << 16);
  }
  *reinterpret_cast<float4*>(L.mu + e) = make_float4(x[0].mu, x[1].mu, x[2].mu, x[3].mu);
  *reinterpret_cast<float4*>(L.nu + e) = make_float4(x[0].nu, x[1].nu, x[2].nu, x[3].nu);
}

template <bool kBF16, bool kMaster>
__device__ __forceinline__ void store_elem(const InPlaceLeaf& L, int64_t i, const ElemState& x) {
  if constexpr (kBF16) {
    static_cast<uint16_t*>(L.p)[i] = static_cast<uint16_t>(x.p);
  } else {
    static_cast<uint32_t*>(L.p)[i] = x.p;
  }
  if constexpr (kMaster) L.master[i] = static_cast<uint16_t>(x.r);
  L.mu[i] = x.mu;
  L.nu[i] = x.nu;
}

// Digest terms of up to four elements of every tensor (group gi of the chunk; live of them),
// into sums (the old ones: `old` true; the new ones: false).
template <bool kBF16, bool kMaster>
__device__ __forceinline__ void add_terms(const ElemState (&x)[4], int64_t gi, int live,
                                          uint64_t key0, bool old, Sums& sum) {
  const uint64_t key32 = key0 + static_cast<uint64_t>(2 * gi) * kUnitStride;
  const uint64_t key16 = key0 + static_cast<uint64_t>(gi) * kUnitStride;
  const int units32 = (live + 1) / 2, units16 = live > 0 ? 1 : 0;
  uint32_t p[4], r[4], mu[4], nu[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const bool on = k < live;
    p[k] = on ? x[k].p : 0u;
    r[k] = on ? x[k].r : 0u;
    mu[k] = on ? __float_as_uint(x[k].mu) : 0u;
    nu[k] = on ? __float_as_uint(x[k].nu) : 0u;
  }
  const uint64_t tp = kBF16 ? kernel::terms_bf16(p, key16, units16) : kernel::terms_f32(p, key32, units32);
  const uint64_t tmu = kernel::terms_f32(mu, key32, units32);
  const uint64_t tnu = kernel::terms_f32(nu, key32, units32);
  const uint64_t tr = kMaster ? kernel::terms_bf16(r, key16, units16) : 0;
  (old ? sum.old_p : sum.new_p) += tp;
  (old ? sum.old_mu : sum.new_mu) += tmu;
  (old ? sum.old_nu : sum.new_nu) += tnu;
  (old ? sum.old_master : sum.new_master) += tr;
}

template <bool kBF16>
__device__ __forceinline__ uint32_t word0(const ElemState& x) {
  return kBF16 ? (x.p & 0xFFFFu) | (x.r << 16) : x.p;
}

// The change of element i of the chunk into the delta rows.
template <bool kBF16>
__device__ __forceinline__ void note_change(const Rows& rows, int64_t i, const ElemState& before,
                                            const ElemState& after) {
  rows.delta[i] = word0<kBF16>(before) ^ word0<kBF16>(after);
  rows.delta[rows.ce + i] = __float_as_uint(before.mu) ^ __float_as_uint(after.mu);
  rows.delta[2 * rows.ce + i] = __float_as_uint(before.nu) ^ __float_as_uint(after.nu);
}

struct ChunkVerdict {
  int32_t faults;
  uint32_t kept;
};

// Chunk c: checked, updated in place from gradient g (indexed from the chunk's first element),
// its tables written where it verified, its change in rows.delta. Block-uniform result.
template <bool kBF16, bool kMaster, bool kParity>
__device__ ChunkVerdict update_chunk(const InPlaceLeaf& L, int64_t c, const void* g,
                                     const AdamWHyper& h, const AdamWStep& s, const Rows& rows) {
  constexpr int psize = kBF16 ? 2 : 4;
  const int64_t first = c * L.chunk_elems;
  const int64_t count = min(L.chunk_elems, L.n - first);
  const int64_t full = count >> 2;
  const int rem = static_cast<int>(count & 3);
  const uint64_t key0 = chunk_key(static_cast<uint64_t>(c));
  Sums sum;
  for (int64_t gi = threadIdx.x; gi < full; gi += blockDim.x) {
    ElemState x[4], y[4];
    float gv[4];
    load4<kBF16, kMaster>(L, g, first + 4 * gi, 4 * gi, x, gv);
    add_terms<kBF16, kMaster>(x, gi, 4, key0, true, sum);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      y[k] = x[k];
      sum.bad += update_elem(y[k], gv[k], kBF16, kMaster, h, s) ? 0u : 1u;
      if constexpr (kParity) note_change<kBF16>(rows, 4 * gi + k, x[k], y[k]);
    }
    store4<kBF16, kMaster>(L, first + 4 * gi, y);
    add_terms<kBF16, kMaster>(y, gi, 4, key0, false, sum);
  }
  if (rem != 0 && threadIdx.x == 0) {  // the ragged end: element by element, never past it
    ElemState x[4] = {}, y[4] = {};
    for (int k = 0; k < rem; ++k) {
      const int64_t i = 4 * full + k;
      x[k] = load_elem<kBF16, kMaster>(L, first + i);
      y[k] = x[k];
      const float gk = kBF16 ? bf16_to_float(static_cast<const uint16_t*>(g)[i])
                             : static_cast<const float*>(g)[i];
      sum.bad += update_elem(y[k], gk, kBF16, kMaster, h, s) ? 0u : 1u;
      store_elem<kBF16, kMaster>(L, first + i, y[k]);
      if constexpr (kParity) note_change<kBF16>(rows, i, x[k], y[k]);
    }
    add_terms<kBF16, kMaster>(x, full, rem, key0, true, sum);
    add_terms<kBF16, kMaster>(y, full, rem, key0, false, sum);
  }
  const Sums t = kernel::block_sum(sum);
  const auto len = [&](int size) { return static_cast<uint64_t>(count * size); };
  const uint64_t cc = static_cast<uint64_t>(c);
  int32_t faults = 0;
  faults |= kernel::table_matches(L.d_p, c, finalize(t.old_p, len(psize), cc)) ? 0 : kFaultParam;
  faults |= kernel::table_matches(L.d_mu, c, finalize(t.old_mu, len(4), cc)) ? 0 : kFaultMu;
  faults |= kernel::table_matches(L.d_nu, c, finalize(t.old_nu, len(4), cc)) ? 0 : kFaultNu;
  if constexpr (kMaster) {
    faults |= kernel::table_matches(L.d_master, c, finalize(t.old_master, len(2), cc)) ? 0 : kFaultMaster;
  }
  if (faults == 0 && threadIdx.x == 0) {
    kernel::table_write(L.d_p, c, finalize(t.new_p, len(psize), cc));
    kernel::table_write(L.d_mu, c, finalize(t.new_mu, len(4), cc));
    kernel::table_write(L.d_nu, c, finalize(t.new_nu, len(4), cc));
    if constexpr (kMaster) kernel::table_write(L.d_master, c, finalize(t.new_master, len(2), cc));
  }
  return {faults, t.bad};
}

__device__ __forceinline__ void record(const InPlaceLeaf& L, int64_t c, const ChunkVerdict& v,
                                       uint64_t* totals) {
  if (threadIdx.x != 0) return;
  L.faults[c] = v.faults;
  L.kept[c] = static_cast<int32_t>(v.kept);
  auto* t = reinterpret_cast<unsigned long long*>(totals);
  if (v.faults != 0) atomicAdd(&t[0], 1ull);
  if (v.kept != 0) atomicAdd(&t[1], static_cast<unsigned long long>(v.kept));
}

// The chunk's change folded into the group's (after the chunk's barrier in block_sum).
__device__ __forceinline__ void fold_chunk(const Rows& rows, int64_t count) {
  for (int w = 0; w < 3; ++w) {
    for (int64_t i = threadIdx.x; i < count; i += blockDim.x) {
      rows.acc[w * rows.ce + i] ^= rows.delta[w * rows.ce + i];
    }
  }
}

// The group's parity rows XORed with `acc` (one writer: this block).
template <bool kBF16, bool kMaster>
__device__ __forceinline__ void fold_parity(const InPlaceLeaf& L, int64_t grp, const uint32_t* acc,
                                            int64_t ce) {
  __syncthreads();
  if constexpr (kBF16) {
    uint32_t* qp = L.q_p + grp * (ce / 2);
    uint32_t* qr = kMaster ? L.q_master + grp * (ce / 2) : nullptr;
    for (int64_t w = threadIdx.x; w < ce / 2; w += blockDim.x) {
      const uint32_t a = acc[2 * w], b = acc[2 * w + 1];
      qp[w] ^= (a & 0xFFFFu) | (b << 16);
      if constexpr (kMaster) qr[w] ^= (a >> 16) | (b & 0xFFFF0000u);
    }
  } else {
    uint32_t* qp = L.q_p + grp * ce;
    for (int64_t w = threadIdx.x; w < ce; w += blockDim.x) qp[w] ^= acc[w];
  }
  uint32_t* qmu = L.q_mu + grp * ce;
  uint32_t* qnu = L.q_nu + grp * ce;
  for (int64_t w = threadIdx.x; w < ce; w += blockDim.x) {
    qmu[w] ^= acc[ce + w];
    qnu[w] ^= acc[2 * ce + w];
  }
}

// Chunk c's gradient into a stash row, if one is left (block-uniform: the slot is broadcast).
__device__ void stash_chunk(const InPlaceLeaf& L, int64_t c, const Stash& stash, uint64_t* totals,
                            int psize) {
  __shared__ unsigned long long slot;
  if (threadIdx.x == 0) slot = atomicAdd(reinterpret_cast<unsigned long long*>(totals) + 2, 1ull);
  __syncthreads();
  const unsigned long long k = slot;
  __syncthreads();
  if (k >= static_cast<unsigned long long>(stash.capacity)) return;
  const int64_t first = c * L.chunk_elems;
  const int64_t bytes = min(L.chunk_elems, L.n - first) * psize;
  const auto* from = static_cast<const uint8_t*>(L.g) + first * psize;
  auto* to = reinterpret_cast<uint8_t*>(stash.rows + static_cast<int64_t>(k) * L.chunk_elems);
  for (int64_t b = threadIdx.x; b < bytes; b += blockDim.x) to[b] = from[b];
  if (threadIdx.x == 0) {
    stash.index[2 * k] = L.index;
    stash.index[2 * k + 1] = static_cast<int32_t>(c);
  }
}

__device__ __forceinline__ int leaf_of(const Table& T, int64_t gg) {
  int i = 0;
  while (i + 1 < T.count && gg >= T.first_group[i + 1]) ++i;
  return i;
}

template <bool kBF16, bool kMaster, bool kParity>
__global__ void __launch_bounds__(kThreads)
    inplace_kernel(const __grid_constant__ Table T, const AdamWHyper h, const float* step,
                   const int32_t* go, Stash stash, uint64_t* totals) {
  if (*go == 0) return;
  extern __shared__ uint32_t shared_rows[];
  const AdamWStep s = adamw_step(step);
  constexpr int psize = kBF16 ? 2 : 4;
  for (int64_t gg = blockIdx.x; gg < T.first_group[T.count]; gg += gridDim.x) {
    const int i = leaf_of(T, gg);
    const InPlaceLeaf& L = T.leaf[i];
    const int64_t ce = L.chunk_elems, grp = gg - T.first_group[i];
    const Rows rows{shared_rows, shared_rows + 3 * ce, ce};
    const int64_t per = kParity ? L.group : 1;
    const int64_t chunks = inplace_chunks(L);
    if constexpr (kParity) {
      for (int64_t w = threadIdx.x; w < 3 * ce; w += blockDim.x) rows.acc[w] = 0;
    }
    for (int64_t c = grp * per; c < min(chunks, (grp + 1) * per); ++c) {
      const void* g = static_cast<const uint8_t*>(L.g) + c * ce * psize;
      const ChunkVerdict v = update_chunk<kBF16, kMaster, kParity>(L, c, g, h, s, rows);
      record(L, c, v, totals);
      if (v.faults != 0) {
        stash_chunk(L, c, stash, totals, psize);
      } else if constexpr (kParity) {
        fold_chunk(rows, min(ce, L.n - c * ce));
      }
      __syncthreads();  // the delta rows are the next chunk's
    }
    if constexpr (kParity) fold_parity<kBF16, kMaster>(L, grp, rows.acc, ce);
    __syncthreads();
  }
}

template <bool kBF16, bool kMaster, bool kParity>
__global__ void __launch_bounds__(kThreads)
    redo_kernel(const __grid_constant__ Table T, const AdamWHyper h, const float* step,
                StashIn stash, uint64_t* totals) {
  extern __shared__ uint32_t shared_rows[];
  const AdamWStep s = adamw_step(step);
  for (int64_t k = blockIdx.x; k < stash.entries; k += gridDim.x) {
    const int32_t leaf = stash.index[2 * k], c = stash.index[2 * k + 1];
    int i = -1;
    for (int j = 0; j < T.count; ++j) i = T.leaf[j].index == leaf ? j : i;
    if (i < 0 || c < 0 || c >= inplace_chunks(T.leaf[i])) continue;  // block-uniform
    const InPlaceLeaf& L = T.leaf[i];
    const int64_t ce = L.chunk_elems, per = kParity ? L.group : 1;
    bool conflict = false;
    for (int64_t j = 0; j < stash.entries; ++j) {
      const int32_t* o = stash.index + 2 * j;
      conflict |= j != k && o[0] == leaf && o[1] >= 0 && o[1] / per == c / per;
    }
    if (conflict) {
      record(L, c, {kFaultConflict, 0}, totals);
      continue;
    }
    const Rows rows{nullptr, shared_rows, ce};
    if constexpr (kParity) {  // a short chunk leaves the end of its rows unchanged: zero
      for (int64_t w = threadIdx.x; w < 3 * ce; w += blockDim.x) rows.delta[w] = 0;
      __syncthreads();
    }
    const ChunkVerdict v =
        update_chunk<kBF16, kMaster, kParity>(L, c, stash.rows + k * ce, h, s, rows);
    record(L, c, v, totals);
    if constexpr (kParity) {
      if (v.faults == 0) fold_parity<kBF16, kMaster>(L, c / per, rows.delta, ce);
    }
    __syncthreads();
  }
}

struct Kind {
  bool bf16, master, parity;
  bool operator==(const Kind& o) const {
    return bf16 == o.bf16 && master == o.master && parity == o.parity;
  }
};

Kind kind_of(const InPlaceLeaf& L) { return {L.param_bf16, L.has_master, L.group > 0}; }

// Shared memory of a launch: the delta rows, and with a full update's parity the group's.
size_t shared_bytes(const Kind& k, int64_t ce, bool redo) {
  if (!k.parity) return 0;
  return static_cast<size_t>((redo ? 3 : 6) * ce) * sizeof(uint32_t);
}

// Beyond 48 KiB of shared memory a block (static and dynamic together) the kernel must opt in;
// the kernels' static shared memory is under 16 KiB.
template <typename Kernel>
cudaError_t allow_shared(Kernel kernel, size_t bytes) {
  if (bytes <= 32 * 1024) return cudaSuccess;
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                              static_cast<int>(bytes));
}

struct Launch {
  const AdamWHyper& h;
  const float* step;
  const int32_t* go;
  const Stash* stash;
  const StashIn* redo;
  uint64_t* totals;
  cudaStream_t stream;
};

template <bool kBF16, bool kMaster, bool kParity>
cudaError_t launch_kind(const Table& T, const Launch& l) {
  const int64_t ce = T.leaf[0].chunk_elems;
  const Kind k{kBF16, kMaster, kParity};
  if (l.redo != nullptr) {
    if (l.redo->entries == 0) return cudaSuccess;
    const size_t smem = shared_bytes(k, ce, true);
    auto* kernel = redo_kernel<kBF16, kMaster, kParity>;
    PIMHBM_CUDA_RETURN_IF_ERROR(allow_shared(kernel, smem));
    const int blocks = static_cast<int>(std::min<int64_t>(l.redo->entries, 65535));
    kernel<<<blocks, kThreads, smem, l.stream>>>(T, l.h, l.step, *l.redo, l.totals);
  } else {
    const size_t smem = shared_bytes(k, ce, false);
    auto* kernel = inplace_kernel<kBF16, kMaster, kParity>;
    PIMHBM_CUDA_RETURN_IF_ERROR(allow_shared(kernel, smem));
    const int blocks = static_cast<int>(std::min<int64_t>(T.first_group[T.count], 0x7FFFFFFF));
    kernel<<<blocks, kThreads, smem, l.stream>>>(T, l.h, l.step, l.go, *l.stash, l.totals);
  }
  PIMHBM_CUDA_RETURN_LAUNCH_ERROR();
  return cudaSuccess;
}

cudaError_t launch_table(const Table& T, const Kind& k, const Launch& l) {
  if (k.bf16 && k.master) {
    return k.parity ? launch_kind<true, true, true>(T, l) : launch_kind<true, true, false>(T, l);
  }
  if (k.bf16) {
    return k.parity ? launch_kind<true, false, true>(T, l) : launch_kind<true, false, false>(T, l);
  }
  return k.parity ? launch_kind<false, false, true>(T, l) : launch_kind<false, false, false>(T, l);
}

// Leaves of one kind in tables of up to kMaxLeaves, one launch each.
cudaError_t launch_all(const InPlaceLeaf* leaves, size_t count, const Launch& l) {
  std::vector<bool> done(count, false);
  for (size_t i = 0; i < count; ++i) {
    if (done[i]) continue;
    const Kind kind = kind_of(leaves[i]);
    Table T{};
    T.count = 0;
    T.first_group[0] = 0;
    for (size_t j = i; j < count; ++j) {
      if (done[j] || !(kind_of(leaves[j]) == kind)) continue;
      done[j] = true;
      if (inplace_chunks(leaves[j]) == 0) continue;
      T.leaf[T.count] = leaves[j];
      T.first_group[T.count + 1] = T.first_group[T.count] + inplace_groups(leaves[j]);
      if (++T.count == kMaxLeaves) {
        PIMHBM_CUDA_RETURN_IF_ERROR(launch_table(T, kind, l));
        T.count = 0;
      }
    }
    if (T.count > 0) PIMHBM_CUDA_RETURN_IF_ERROR(launch_table(T, kind, l));
  }
  return cudaSuccess;
}

// Every report of every leaf zero, the totals zero (and the stash cleared: rows 0, index -1).
cudaError_t clear(const InPlaceLeaf* leaves, size_t count, uint64_t* totals, const Stash* stash,
                  cudaStream_t stream) {
  PIMHBM_CUDA_RETURN_IF_ERROR(
      cudaMemsetAsync(totals, 0, kInPlaceTotals * sizeof(uint64_t), stream));
  for (size_t i = 0; i < count; ++i) {
    const size_t bytes = static_cast<size_t>(inplace_chunks(leaves[i])) * sizeof(int32_t);
    if (bytes == 0) continue;
    PIMHBM_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(leaves[i].faults, 0, bytes, stream));
    PIMHBM_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(leaves[i].kept, 0, bytes, stream));
  }
  if (stash != nullptr && stash->capacity > 0 && count > 0) {
    const size_t rows = static_cast<size_t>(stash->capacity * leaves[0].chunk_elems) * 4;
    PIMHBM_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(stash->rows, 0, rows, stream));
    PIMHBM_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(
        stash->index, 0xFF, static_cast<size_t>(2 * stash->capacity) * sizeof(int32_t), stream));
  }
  return cudaSuccess;
}

}  // namespace

cudaError_t inplace_cuda(const InPlaceLeaf* leaves, size_t count, const AdamWHyper& hyper,
                         const float* step, const int32_t* go, const Stash& stash,
                         uint64_t* totals, cudaStream_t stream) {
  PIMHBM_CUDA_RETURN_IF_ERROR(clear(leaves, count, totals, &stash, stream));
  return launch_all(leaves, count, Launch{hyper, step, go, &stash, nullptr, totals, stream});
}

cudaError_t redo_cuda(const InPlaceLeaf* leaves, size_t count, const AdamWHyper& hyper,
                      const float* step, const StashIn& stash, uint64_t* totals,
                      cudaStream_t stream) {
  PIMHBM_CUDA_RETURN_IF_ERROR(clear(leaves, count, totals, nullptr, stream));
  return launch_all(leaves, count, Launch{hyper, step, nullptr, nullptr, &stash, totals, stream});
}

}  // namespace pimhbm::update
