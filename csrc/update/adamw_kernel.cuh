// The device code of the fused guarded AdamW update (adamw_cuda.cu), shared with the
// benchmark's launch variants (bench/adamw_variants.cu): loads and stores of groups of four
// elements of every tensor, their digest terms, the update of a group, the block's sums and the
// chunk's tables and reports. Everything here is inlined into the kernels that use it.
//
// One block per chunk; every thread takes groups of four elements with vector loads of every
// tensor, checks the old digests, updates, writes the new state, and digests it -- all in
// registers, one pass over memory. The block sums the digest terms (order-independent, see
// digest.h) and thread 0 writes the chunk's tables and reports.
//
// The math is adamw_math.h, bit for bit the CPU reference's. A ragged last group (chunk length
// not a multiple of 4) is handled by thread 0 with element loads and stores under predicates;
// missing elements read as zero and are never written, as the digest's zero padding expects.
#pragma once

#include <cuda_runtime.h>

#include <vector>

#include "pimhbm/cuda_check.h"
#include "pimhbm/digest.h"
#include "pimhbm/word_muls.cuh"
#include "update/adamw.h"
#include "update/inplace_math.h"

namespace pimhbm::update::kernel {

constexpr int kThreads = 256;

struct Group {    // four elements of every tensor, as raw words
  uint32_t p[4];  // fp32 bits, or bf16 bits in the low half
  uint32_t g[4];
  uint32_t master[4];  // the master weights' 16-bit remainders (adamw_math.h), in the low half
  float mu[4], nu[4];
};

__device__ __forceinline__ float param_value(uint32_t bits, bool bf16) {
  return bf16 ? bf16_to_float(static_cast<uint16_t>(bits)) : __uint_as_float(bits);
}

// The digest's multipliers of group gi's words (digest.h): four fp32 words are the chunk's
// words 4 gi .. 4 gi + 3, four 16-bit values its words 2 gi and 2 gi + 1.
struct GroupMuls {
  uint4 w32;
  uint2 w16;
};
__device__ __forceinline__ GroupMuls group_muls(int64_t gi) {
  const uint32_t w = static_cast<uint32_t>(2 * gi);
  return {word_muls_of_vector(static_cast<uint32_t>(gi)), make_uint2(word_mul(w), word_mul(w + 1))};
}

// Digest terms of four fp32 words (missing elements are zero: no terms).
__device__ __forceinline__ uint64_t terms_f32(const uint32_t (&w)[4], const GroupMuls& m) {
  return vector_terms(make_uint4(w[0], w[1], w[2], w[3]), m.w32);
}

// Digest terms of four 16-bit values (bits in the low halves): two words.
__device__ __forceinline__ uint64_t terms_16(const uint32_t (&w)[4], const GroupMuls& m) {
  return pair_terms((w[0] & 0xFFFFu) | (w[1] & 0xFFFFu) << 16,
                    (w[2] & 0xFFFFu) | (w[3] & 0xFFFFu) << 16, m.w16.x, m.w16.y);
}

// Loads marked evict-first (__ldcs: the data is used once), or plain ones (kept in L2 like any
// other line: for a chunk that is read again soon).
template <bool kEvictFirst>
__device__ __forceinline__ uint4 ldg4(const void* p) {
  return kEvictFirst ? __ldcs(static_cast<const uint4*>(p)) : __ldg(static_cast<const uint4*>(p));
}
template <bool kEvictFirst>
__device__ __forceinline__ uint2 ldg2(const void* p) {
  return kEvictFirst ? __ldcs(static_cast<const uint2*>(p)) : __ldg(static_cast<const uint2*>(p));
}
template <bool kEvictFirst>
__device__ __forceinline__ float4 ldg4f(const float* p) {
  const uint4 v = ldg4<kEvictFirst>(p);
  return make_float4(__uint_as_float(v.x), __uint_as_float(v.y), __uint_as_float(v.z),
                     __uint_as_float(v.w));
}

struct Sums {
  uint64_t old_p = 0, old_master = 0, old_mu = 0, old_nu = 0;
  uint64_t new_p = 0, new_master = 0, new_mu = 0, new_nu = 0;
  uint32_t bad = 0;
};

// Loads group `gi` of the chunk starting at element `first`: all four elements (kFull) or the
// first `live` of them, the rest zero.
template <bool kBF16, bool kMaster, bool kFull, bool kEvictFirst = true>
__device__ __forceinline__ void load_group(const AdamWLeaf& L, int64_t e, int live, Group& x) {
  if constexpr (kFull) {
    if constexpr (kBF16) {
      const uint2 p = ldg2<kEvictFirst>(static_cast<const uint16_t*>(L.p) + e);
      const uint2 g = ldg2<kEvictFirst>(static_cast<const uint16_t*>(L.g) + e);
      x.p[0] = p.x & 0xFFFFu, x.p[1] = p.x >> 16, x.p[2] = p.y & 0xFFFFu, x.p[3] = p.y >> 16;
      x.g[0] = g.x & 0xFFFFu, x.g[1] = g.x >> 16, x.g[2] = g.y & 0xFFFFu, x.g[3] = g.y >> 16;
    } else {
      const uint4 p = ldg4<kEvictFirst>(static_cast<const float*>(L.p) + e);
      const uint4 g = ldg4<kEvictFirst>(static_cast<const float*>(L.g) + e);
      x.p[0] = p.x, x.p[1] = p.y, x.p[2] = p.z, x.p[3] = p.w;
      x.g[0] = g.x, x.g[1] = g.y, x.g[2] = g.z, x.g[3] = g.w;
    }
    const float4 mu = ldg4f<kEvictFirst>(L.mu + e);
    const float4 nu = ldg4f<kEvictFirst>(L.nu + e);
    x.mu[0] = mu.x, x.mu[1] = mu.y, x.mu[2] = mu.z, x.mu[3] = mu.w;
    x.nu[0] = nu.x, x.nu[1] = nu.y, x.nu[2] = nu.z, x.nu[3] = nu.w;
    if constexpr (kMaster) {
      const uint2 r = ldg2<kEvictFirst>(L.master + e);
      x.master[0] = r.x & 0xFFFFu, x.master[1] = r.x >> 16;
      x.master[2] = r.y & 0xFFFFu, x.master[3] = r.y >> 16;
    }
  } else {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const bool on = k < live;
      if constexpr (kBF16) {
        x.p[k] = on ? static_cast<const uint16_t*>(L.p)[e + k] : 0u;
        x.g[k] = on ? static_cast<const uint16_t*>(L.g)[e + k] : 0u;
      } else {
        x.p[k] = on ? static_cast<const uint32_t*>(L.p)[e + k] : 0u;
        x.g[k] = on ? static_cast<const uint32_t*>(L.g)[e + k] : 0u;
      }
      x.mu[k] = on ? L.mu[e + k] : 0.0f;
      x.nu[k] = on ? L.nu[e + k] : 0.0f;
      if constexpr (kMaster) x.master[k] = on ? L.master[e + k] : 0u;
    }
  }
}

// Digest terms of the state of group `gi` as it was read (the old digests); a ragged group's
// missing elements are zero and add nothing.
template <bool kBF16, bool kMaster>
__device__ __forceinline__ void old_terms(const Group& x, int64_t gi, Sums& sum) {
  const GroupMuls m = group_muls(gi);
  uint32_t w[4];
  sum.old_p += kBF16 ? terms_16(x.p, m) : terms_f32(x.p, m);
#pragma unroll
  for (int k = 0; k < 4; ++k) w[k] = __float_as_uint(x.mu[k]);
  sum.old_mu += terms_f32(w, m);
#pragma unroll
  for (int k = 0; k < 4; ++k) w[k] = __float_as_uint(x.nu[k]);
  sum.old_nu += terms_f32(w, m);
  if constexpr (kMaster) sum.old_master += terms_16(x.master, m);
}

// Stores four new values of every tensor (all of them, or the first `live`).
template <bool kBF16, bool kMaster, bool kFull>
__device__ __forceinline__ void store_group(void* p_dst, uint16_t* master_dst, float* mu_dst,
                                            float* nu_dst, int64_t e, int live,
                                            const uint32_t (&p_new)[4], const Group& x) {
  if constexpr (kFull) {
    if constexpr (kBF16) {
      *reinterpret_cast<uint2*>(static_cast<uint16_t*>(p_dst) + e) =
          make_uint2(p_new[0] | p_new[1] << 16, p_new[2] | p_new[3] << 16);
    } else {
      *reinterpret_cast<uint4*>(static_cast<float*>(p_dst) + e) =
          make_uint4(p_new[0], p_new[1], p_new[2], p_new[3]);
    }
    *reinterpret_cast<float4*>(mu_dst + e) = make_float4(x.mu[0], x.mu[1], x.mu[2], x.mu[3]);
    *reinterpret_cast<float4*>(nu_dst + e) = make_float4(x.nu[0], x.nu[1], x.nu[2], x.nu[3]);
    if constexpr (kMaster) {
      *reinterpret_cast<uint2*>(master_dst + e) =
          make_uint2(x.master[0] | x.master[1] << 16, x.master[2] | x.master[3] << 16);
    }
  } else {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      if (k < live) {
        if constexpr (kBF16) {
          static_cast<uint16_t*>(p_dst)[e + k] = static_cast<uint16_t>(p_new[k]);
        } else {
          static_cast<uint32_t*>(p_dst)[e + k] = p_new[k];
        }
        mu_dst[e + k] = x.mu[k];
        nu_dst[e + k] = x.nu[k];
        if constexpr (kMaster) master_dst[e + k] = static_cast<uint16_t>(x.master[k]);
      }
    }
  }
}

// Updates group `gi` (already loaded into x), stores it to the write side (and to the device
// copy when `to_copy`, a block-uniform flag) and adds its new digest terms -- and its old ones
// too when kOld (single-pass kernel).
template <bool kBF16, bool kMaster, bool kFull, bool kOld>
__device__ __forceinline__ void process_group(const AdamWLeaf& L, const AdamWHyper& h,
                                              const AdamWStep& s, int64_t first, int64_t gi,
                                              int live, Group& x, Sums& sum, bool to_copy) {
  const int64_t e = first + 4 * gi;
  if constexpr (kOld) old_terms<kBF16, kMaster>(x, gi, sum);

  // Update; missing elements (ragged end) become zero bits and are not stored.
  uint32_t p_new[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const bool on = kFull || k < live;
    const float g = param_value(x.g[k], kBF16);
    float wt = kMaster
                   ? join_master(static_cast<uint16_t>(x.p[k]), static_cast<uint16_t>(x.master[k]))
                   : param_value(x.p[k], kBF16);
    adamw_element(g, wt, x.mu[k], x.nu[k], h, s);
    // A non-finite gradient value makes its moments non-finite; so do eps 0 where a moment is
    // 0, and an overflow: one count of the elements whose new values are not all finite.
    sum.bad += (on && !new_values_finite(wt, x.mu[k], x.nu[k], kBF16)) ? 1u : 0u;
    x.mu[k] = on ? x.mu[k] : 0.0f;
    x.nu[k] = on ? x.nu[k] : 0.0f;
    if constexpr (kMaster) {
      const SplitMaster split = split_master(wt);
      x.master[k] = on ? split.r : 0u;
      p_new[k] = on ? split.p : 0u;
    } else {
      p_new[k] = on ? (kBF16 ? float_to_bf16(wt) : __float_as_uint(wt)) : 0u;
    }
  }
  store_group<kBF16, kMaster, kFull>(L.p_out, L.master_out, L.mu_out, L.nu_out, e, live, p_new, x);
  if (to_copy) {
    store_group<kBF16, kMaster, kFull>(L.p_copy, L.master_copy, L.mu_copy, L.nu_copy, e, live,
                                       p_new, x);
  }

  // New digests.
  const GroupMuls m = group_muls(gi);
  uint32_t w[4];
  sum.new_p += kBF16 ? terms_16(p_new, m) : terms_f32(p_new, m);
#pragma unroll
  for (int k = 0; k < 4; ++k) w[k] = __float_as_uint(x.mu[k]);
  sum.new_mu += terms_f32(w, m);
#pragma unroll
  for (int k = 0; k < 4; ++k) w[k] = __float_as_uint(x.nu[k]);
  sum.new_nu += terms_f32(w, m);
  if constexpr (kMaster) sum.new_master += terms_16(x.master, m);
}

__device__ __forceinline__ void warp_sum(Sums& s) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    s.old_p += __shfl_xor_sync(0xFFFFFFFFu, s.old_p, off);
    s.old_master += __shfl_xor_sync(0xFFFFFFFFu, s.old_master, off);
    s.old_mu += __shfl_xor_sync(0xFFFFFFFFu, s.old_mu, off);
    s.old_nu += __shfl_xor_sync(0xFFFFFFFFu, s.old_nu, off);
    s.new_p += __shfl_xor_sync(0xFFFFFFFFu, s.new_p, off);
    s.new_master += __shfl_xor_sync(0xFFFFFFFFu, s.new_master, off);
    s.new_mu += __shfl_xor_sync(0xFFFFFFFFu, s.new_mu, off);
    s.new_nu += __shfl_xor_sync(0xFFFFFFFFu, s.new_nu, off);
    s.bad += __shfl_xor_sync(0xFFFFFFFFu, s.bad, off);
  }
}

// Sums over the block, returned to every thread (the device copy's decision is block-uniform).
__device__ __forceinline__ Sums block_sum(Sums s) {
  __shared__ Sums shared[kThreads / 32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  warp_sum(s);
  if (lane == 0) shared[warp] = s;
  __syncthreads();
  s = lane < static_cast<int>(blockDim.x >> 5) ? shared[lane] : Sums{};
  warp_sum(s);
  __syncthreads();  // `shared` is reused by the next reduction
  return s;
}

__device__ __forceinline__ bool table_matches(const uint32_t* t, int64_t c, uint64_t d) {
  return d == digest_join(t[2 * c], t[2 * c + 1]);
}
__device__ __forceinline__ void table_write(uint32_t* t, int64_t c, uint64_t d) {
  t[2 * c] = digest_lo(d);
  t[2 * c + 1] = digest_hi(d);
}

// Which state tensors of chunk c failed their digest check, from the old digest sums.
template <bool kMaster>
__device__ __forceinline__ int32_t chunk_faults(const AdamWLeaf& L, int64_t c, int64_t count,
                                                int psize, const Sums& t) {
  const auto len = [&](int size) { return static_cast<uint64_t>(count * size); };
  const uint64_t cc = static_cast<uint64_t>(c);
  int32_t faults = 0;
  faults |= table_matches(L.d_p, c, finalize(t.old_p, len(psize), cc)) ? 0 : kFaultParam;
  faults |= table_matches(L.d_mu, c, finalize(t.old_mu, len(4), cc)) ? 0 : kFaultMu;
  faults |= table_matches(L.d_nu, c, finalize(t.old_nu, len(4), cc)) ? 0 : kFaultNu;
  if constexpr (kMaster) {
    faults |= table_matches(L.d_master, c, finalize(t.old_master, len(2), cc)) ? 0 : kFaultMaster;
  }
  return faults;
}

// Thread 0 of the block: the chunk's new digest tables (and the device copy's, where the
// chunk verified) and its reports. `old`: the sums over the state as read; `t`: over the new state.
template <bool kMaster>
__device__ __forceinline__ void finish_chunk(const AdamWLeaf& L, int64_t c, int64_t count,
                                             int psize, const Sums& old, const Sums& t,
                                             bool to_copy) {
  const auto len = [&](int size) { return static_cast<uint64_t>(count * size); };
  const uint64_t cc = static_cast<uint64_t>(c);
  const int32_t faults = chunk_faults<kMaster>(L, c, count, psize, old);
  const uint64_t dp = finalize(t.new_p, len(psize), cc);
  const uint64_t dmu = finalize(t.new_mu, len(4), cc);
  const uint64_t dnu = finalize(t.new_nu, len(4), cc);
  table_write(L.dn_p, c, dp);
  table_write(L.dn_mu, c, dmu);
  table_write(L.dn_nu, c, dnu);
  if (to_copy) {
    table_write(L.dc_p, c, dp);
    table_write(L.dc_mu, c, dmu);
    table_write(L.dc_nu, c, dnu);
  }
  if constexpr (kMaster) {
    const uint64_t dw = finalize(t.new_master, len(2), cc);
    table_write(L.dn_master, c, dw);
    if (to_copy) table_write(L.dc_master, c, dw);
  }
  L.faults[c] = faults;
  L.grad_nonfinite[c] = static_cast<int32_t>(t.bad);
  // Only chunks with something to report touch the totals. (A saturating 32-bit count -- a
  // compare-and-swap loop -- made ptxas spill in every kernel; a 64-bit add does not.)
  if (L.totals != nullptr) {
    auto* totals = reinterpret_cast<unsigned long long*>(L.totals);
    if (faults != 0) atomicAdd(&totals[0], 1ull);
    if (t.bad != 0) atomicAdd(&totals[1], static_cast<unsigned long long>(t.bad));
  }
}

// Where chunk c of a leaf lies: its first element, its length (the last chunk may be short),
// its whole groups of four, and the elements past them.
struct ChunkSpan {
  int64_t first, count, full_groups;
  int rem;
};
__device__ __forceinline__ ChunkSpan chunk_span(const AdamWLeaf& L, int64_t c) {
  const int64_t first = c * L.chunk_elems;
  const int64_t count = min(L.chunk_elems, L.n - first);
  return {first, count, count >> 2, static_cast<int>(count & 3)};
}

// Several leaves in one launch: block b takes global chunk b (and b + gridDim.x, ...), which
// falls in leaf i when first_chunk[i] <= b < first_chunk[i + 1]. One launch instead of one per
// leaf saves a launch and the last partial wave of blocks per leaf. The table travels in the
// kernel's parameters (CUDA 12.1+ allows 32 KiB of them on Volta and later).
constexpr int kMaxLeaves = 64;
struct LeafTable {
  AdamWLeaf leaf[kMaxLeaves];
  int64_t first_chunk[kMaxLeaves + 1];
  int count;
};
static_assert(sizeof(LeafTable) < 32000, "the leaf table must fit the kernel parameters");

__device__ __forceinline__ int leaf_of(const LeafTable& T, int64_t gc) {
  int i = 0;
  while (i + 1 < T.count && gc >= T.first_chunk[i + 1]) ++i;  // block-uniform
  return i;
}

// The device copy written from registers: every thread loads all of its groups of the chunk
// (at most kG, so a chunk has at most 4 * kG * kThreads elements), the block decides the
// chunk's verdict from the old digests, then the same registers are updated and stored -- one
// read of the chunk, no reliance on L2.
template <bool kBF16, bool kMaster, int kG>
__device__ __forceinline__ void resident_chunk(const AdamWLeaf& L, const AdamWHyper& h,
                                               const AdamWStep& s, int64_t c) {
  constexpr int psize = kBF16 ? 2 : 4;
  const auto [first, count, full_groups, rem] = chunk_span(L, c);

  // Group gi = threadIdx.x + k * kThreads: whole (live 4), the ragged last one (live rem), or
  // past the end (live 0: nothing loaded, nothing stored, no digest term).
  Group x[kG];
  int live[kG];
  Sums old;
#pragma unroll
  for (int k = 0; k < kG; ++k) {
    const int64_t gi = threadIdx.x + static_cast<int64_t>(k) * kThreads;
    live[k] = gi < full_groups ? 4 : (gi == full_groups ? rem : 0);
    if (live[k] == 4) {
      load_group<kBF16, kMaster, true>(L, first + 4 * gi, 4, x[k]);
    } else {
      load_group<kBF16, kMaster, false>(L, first + 4 * gi, live[k], x[k]);
    }
  }
#pragma unroll
  for (int k = 0; k < kG; ++k) {
    const int64_t gi = threadIdx.x + static_cast<int64_t>(k) * kThreads;
    if (live[k] > 0) old_terms<kBF16, kMaster>(x[k], gi, old);
  }
  old = block_sum(old);
  const bool to_copy = chunk_faults<kMaster>(L, c, count, psize, old) == 0;  // block-uniform

  Sums sum;
#pragma unroll
  for (int k = 0; k < kG; ++k) {
    const int64_t gi = threadIdx.x + static_cast<int64_t>(k) * kThreads;
    if (live[k] == 4) {
      process_group<kBF16, kMaster, true, false>(L, h, s, first, gi, 4, x[k], sum, to_copy);
    } else if (live[k] > 0) {
      process_group<kBF16, kMaster, false, false>(L, h, s, first, gi, live[k], x[k], sum, to_copy);
    }
  }
  const Sums t = block_sum(sum);
  if (threadIdx.x == 0) finish_chunk<kMaster>(L, c, count, psize, old, t, to_copy);
}

// Every chunk of the table, block b taking chunks b, b + gridDim.x, ...: chunk(leaf, c) for
// each (the body of every update kernel, which differ in what they do with a chunk).
template <typename Chunk>
__device__ __forceinline__ void for_each_chunk(const LeafTable& T, Chunk chunk) {
  for (int64_t gc = blockIdx.x; gc < T.first_chunk[T.count]; gc += gridDim.x) {
    const int i = leaf_of(T, gc);
    chunk(T.leaf[i], gc - T.first_chunk[i]);
  }
}

// Launches launch(table, kind) over the leaves, leaves of the same kind (kind_of(leaf); kinds
// compare with ==) in one table of up to kMaxLeaves, in the order given; empty tables are
// not launched.
template <typename KindOf, typename Launch>
cudaError_t launch_by_kind(const AdamWLeaf* leaves, size_t count, KindOf kind_of, Launch launch) {
  std::vector<bool> done(count, false);
  for (size_t i = 0; i < count; ++i) {
    if (done[i]) continue;
    const auto kind = kind_of(leaves[i]);
    LeafTable T{};
    T.count = 0;
    T.first_chunk[0] = 0;
    const auto flush = [&]() -> cudaError_t {
      const bool empty = T.count == 0 || T.first_chunk[T.count] == 0;
      const cudaError_t err = empty ? cudaSuccess : launch(T, kind);
      T.count = 0;
      return err;
    };
    for (size_t j = i; j < count; ++j) {
      if (done[j] || !(kind_of(leaves[j]) == kind)) continue;
      const int64_t nchunks = leaf_chunks(leaves[j]);
      done[j] = true;
      if (nchunks == 0) continue;
      T.leaf[T.count] = leaves[j];
      T.first_chunk[T.count + 1] = T.first_chunk[T.count] + nchunks;
      if (++T.count == kMaxLeaves) PIMHBM_CUDA_RETURN_IF_ERROR(flush());
    }
    PIMHBM_CUDA_RETURN_IF_ERROR(flush());
  }
  return cudaSuccess;
}

}  // namespace pimhbm::update::kernel
