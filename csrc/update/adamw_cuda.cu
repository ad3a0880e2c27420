// The fused guarded AdamW kernel: one block per chunk; every thread takes groups of four
// elements with vector loads of every tensor, checks the old digests, updates, writes the new
// state, and digests it -- all in registers, one pass over memory. The block sums the digest
// terms (order-independent, see digest.h) and thread 0 writes the chunk's tables and reports.
//
// The math is adamw_math.h, bit for bit the CPU reference's. A ragged last group (chunk length
// not a multiple of 4) is handled by thread 0 with element loads and stores under predicates;
// missing elements read as zero and are never written, as the digest's zero padding expects.
#include <cuda_runtime.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "pimhbm/cuda_check.h"
#include "pimhbm/digest.h"
#include "update/adamw.h"

namespace pimhbm::update {
namespace {

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

__device__ __forceinline__ bool finite_param(uint32_t bits, bool bf16) {
  return bf16 ? (bits & 0x7FFFu) < 0x7F80u : (bits & 0x7FFFFFFFu) < 0x7F800000u;
}

// Digest terms of four fp32 words: two units (the second present only when `units` >= 2).
__device__ __forceinline__ uint64_t terms_f32(const uint32_t (&w)[4], uint64_t key, int units) {
  const uint64_t a = unit_term(static_cast<uint64_t>(w[1]) << 32 | w[0], key);
  const uint64_t b = unit_term(static_cast<uint64_t>(w[3]) << 32 | w[2], key + kUnitStride);
  return (units >= 1 ? a : 0) + (units >= 2 ? b : 0);
}

// Digest term of four bf16 values: one unit.
__device__ __forceinline__ uint64_t terms_bf16(const uint32_t (&w)[4], uint64_t key, int units) {
  const uint64_t u = static_cast<uint64_t>(w[3] & 0xFFFFu) << 48 |
                     static_cast<uint64_t>(w[2] & 0xFFFFu) << 32 | (w[1] & 0xFFFFu) << 16 |
                     (w[0] & 0xFFFFu);
  const uint64_t t = unit_term(u, key);
  return units >= 1 ? t : 0;
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

// Digest terms of the state of group `gi` as it was read (the old digests).
template <bool kBF16, bool kMaster, bool kFull>
__device__ __forceinline__ void old_terms(const Group& x, int64_t gi, int live, uint64_t key0,
                                          Sums& sum) {
  const uint64_t key32 = key0 + static_cast<uint64_t>(2 * gi) * kUnitStride;
  const uint64_t key16 = key0 + static_cast<uint64_t>(gi) * kUnitStride;
  const int units32 = kFull ? 2 : (live + 1) / 2;
  const int units16 = kFull ? 1 : (live > 0 ? 1 : 0);
  uint32_t w[4];
  sum.old_p += kBF16 ? terms_bf16(x.p, key16, units16) : terms_f32(x.p, key32, units32);
#pragma unroll
  for (int k = 0; k < 4; ++k) w[k] = __float_as_uint(x.mu[k]);
  sum.old_mu += terms_f32(w, key32, units32);
#pragma unroll
  for (int k = 0; k < 4; ++k) w[k] = __float_as_uint(x.nu[k]);
  sum.old_nu += terms_f32(w, key32, units32);
  if constexpr (kMaster) sum.old_master += terms_bf16(x.master, key16, units16);
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

// Updates group `gi` (already loaded into x), stores it to the write side (and to the mirror
// when `to_mirror`, a block-uniform flag) and adds its new digest terms -- and its old ones
// too when kOld (single-pass kernel).
template <bool kBF16, bool kMaster, bool kFull, bool kOld>
__device__ __forceinline__ void process_group(const AdamWLeaf& L, const AdamWHyper& h,
                                              const AdamWStep& s, int64_t first, int64_t gi,
                                              int live, uint64_t key0, Group& x, Sums& sum,
                                              bool to_mirror) {
  const int64_t e = first + 4 * gi;
  if constexpr (kOld) old_terms<kBF16, kMaster, kFull>(x, gi, live, key0, sum);

  // Update; missing elements (ragged end) become zero bits and are not stored.
  uint32_t p_new[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const bool on = kFull || k < live;
    const float g = param_value(x.g[k], kBF16);
    sum.bad += (on && !finite_param(x.g[k], kBF16)) ? 1u : 0u;
    float wt = kMaster
                   ? join_master(static_cast<uint16_t>(x.p[k]), static_cast<uint16_t>(x.master[k]))
                   : param_value(x.p[k], kBF16);
    adamw_element(g, wt, x.mu[k], x.nu[k], h, s);
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
  if (to_mirror) {
    store_group<kBF16, kMaster, kFull>(L.p_mirror, L.master_mirror, L.mu_mirror, L.nu_mirror, e,
                                       live, p_new, x);
  }

  // New digests.
  const uint64_t key32 = key0 + static_cast<uint64_t>(2 * gi) * kUnitStride;
  const uint64_t key16 = key0 + static_cast<uint64_t>(gi) * kUnitStride;
  const int units32 = kFull ? 2 : (live + 1) / 2;
  const int units16 = kFull ? 1 : (live > 0 ? 1 : 0);
  uint32_t w[4];
  sum.new_p += kBF16 ? terms_bf16(p_new, key16, units16) : terms_f32(p_new, key32, units32);
#pragma unroll
  for (int k = 0; k < 4; ++k) w[k] = __float_as_uint(x.mu[k]);
  sum.new_mu += terms_f32(w, key32, units32);
#pragma unroll
  for (int k = 0; k < 4; ++k) w[k] = __float_as_uint(x.nu[k]);
  sum.new_nu += terms_f32(w, key32, units32);
  if constexpr (kMaster) sum.new_master += terms_bf16(x.master, key16, units16);
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

// Sums over the block, returned to every thread (the mirror decision is block-uniform).
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

// Thread 0 of the block: the chunk's new digest tables (and the mirror's, where the chunk
// verified) and its reports. `old`: the sums over the state as read; `t`: over the new state.
template <bool kMaster>
__device__ __forceinline__ void finish_chunk(const AdamWLeaf& L, int64_t c, int64_t count,
                                             int psize, const Sums& old, const Sums& t,
                                             bool to_mirror) {
  const auto len = [&](int size) { return static_cast<uint64_t>(count * size); };
  const uint64_t cc = static_cast<uint64_t>(c);
  const int32_t faults = chunk_faults<kMaster>(L, c, count, psize, old);
  const uint64_t dp = finalize(t.new_p, len(psize), cc);
  const uint64_t dmu = finalize(t.new_mu, len(4), cc);
  const uint64_t dnu = finalize(t.new_nu, len(4), cc);
  table_write(L.dn_p, c, dp);
  table_write(L.dn_mu, c, dmu);
  table_write(L.dn_nu, c, dnu);
  if (to_mirror) {
    table_write(L.dm_p, c, dp);
    table_write(L.dm_mu, c, dmu);
    table_write(L.dm_nu, c, dnu);
  }
  if constexpr (kMaster) {
    const uint64_t dw = finalize(t.new_master, len(2), cc);
    table_write(L.dn_master, c, dw);
    if (to_mirror) table_write(L.dm_master, c, dw);
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
// its whole groups of four, the elements past them, and its digest key.
struct ChunkSpan {
  int64_t first, count, full_groups;
  int rem;
  uint64_t key0;
};
__device__ __forceinline__ ChunkSpan chunk_span(const AdamWLeaf& L, int64_t c) {
  const int64_t first = c * L.chunk_elems;
  const int64_t count = min(L.chunk_elems, L.n - first);
  return {first, count, count >> 2, static_cast<int>(count & 3),
          chunk_key(static_cast<uint64_t>(c))};
}

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
  const auto [first, count, full_groups, rem, key0] = chunk_span(L, c);

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
    process_group<kBF16, kMaster, true, true>(L, h, s, first, gi, 4, key0, x, sum, false);
    slot = slot + 1 == kStages ? 0 : slot + 1;
  }
  cp_async_wait<0>();  // nothing in flight into shared memory past the chunk
  if (rem != 0) {      // block-uniform: only a tensor's last chunk can be ragged
    const int tail_live = threadIdx.x == 0 ? rem : 0;
    Group x;
    load_group<kBF16, kMaster, false>(L, first + 4 * full_groups, tail_live, x);
    process_group<kBF16, kMaster, false, true>(L, h, s, first, full_groups, tail_live, key0, x, sum,
                                               false);
  }
  const Sums t = block_sum(sum);
  if (threadIdx.x == 0) finish_chunk<kMaster>(L, c, count, psize, t, t, false);
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

// kInFlight: groups whose loads a thread issues before it computes the first of them (more
// bytes in flight per thread, more registers).
// kMirror: also write the device copy, chunk by chunk where the chunk verified. The chunk's
// verdict must be known before its first write, so the kernel first reads the chunk's state
// to check its digests (phase A) and then reads it again -- from L2, a chunk is 48-64 KiB --
// to update it (phase B). kKeepA: phase A's loads are plain ones, so that L2 keeps the lines
// for phase B (evict-first loads may lose them); phase B's are evict-first.
// kPrefetch: iterations of the block's loop ahead whose groups each thread prefetches into L2
// (0: none).
// kEvictFirst: the update's loads (without the device copy) marked evict-first, or plain ones.
template <bool kBF16, bool kMaster, int kInFlight, bool kMirror, bool kKeepA, int kPrefetch = 0,
          bool kEvictFirst = true>
__device__ __forceinline__ void two_pass_chunk(const AdamWLeaf& L, const AdamWHyper& h,
                                               const AdamWStep& s, int64_t c) {
  constexpr int psize = kBF16 ? 2 : 4;
  const int64_t bd = blockDim.x;
  const auto [first, count, full_groups, rem, key0] = chunk_span(L, c);
  const int tail_live = threadIdx.x == 0 ? rem : 0;

  Sums old;
  bool to_mirror = false;
  if constexpr (kMirror) {  // phase A: the chunk's verdict
    for (int64_t gi = threadIdx.x; gi < full_groups; gi += bd) {
      Group x;
      load_group<kBF16, kMaster, true, !kKeepA>(L, first + 4 * gi, 4, x);
      old_terms<kBF16, kMaster, true>(x, gi, 4, key0, old);
    }
    if (rem != 0) {  // block-uniform
      Group x;
      load_group<kBF16, kMaster, false>(L, first + 4 * full_groups, tail_live, x);
      old_terms<kBF16, kMaster, false>(x, full_groups, tail_live, key0, old);
    }
    old = block_sum(old);
    to_mirror = chunk_faults<kMaster>(L, c, count, psize, old) == 0;  // same in every thread
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
      process_group<kBF16, kMaster, true, !kMirror>(L, h, s, first, gi + k * bd, 4, key0, x[k], sum,
                                                    to_mirror);
    }
  }
  for (; gi < full_groups; gi += bd) {  // what is left: fewer than kInFlight groups
    Group x;
    load_group<kBF16, kMaster, true, kEvictFirst>(L, first + 4 * gi, 4, x);
    process_group<kBF16, kMaster, true, !kMirror>(L, h, s, first, gi, 4, key0, x, sum, to_mirror);
  }
  if (rem != 0) {  // block-uniform: only a tensor's last chunk can be ragged
    Group x;
    load_group<kBF16, kMaster, false>(L, first + 4 * full_groups, tail_live, x);
    process_group<kBF16, kMaster, false, !kMirror>(L, h, s, first, full_groups, tail_live, key0, x,
                                                   sum, to_mirror);
  }
  const Sums t = block_sum(sum);
  if (threadIdx.x == 0) finish_chunk<kMaster>(L, c, count, psize, kMirror ? old : t, t, to_mirror);
}

// The device copy written from registers: every thread loads all of its groups of the chunk
// (at most kG, so a chunk has at most 4 * kG * kThreads elements), the block decides the
// chunk's verdict from the old digests, then the same registers are updated and stored -- one
// read of the chunk, no reliance on L2.
template <bool kBF16, bool kMaster, int kG>
__device__ __forceinline__ void resident_chunk(const AdamWLeaf& L, const AdamWHyper& h,
                                               const AdamWStep& s, int64_t c) {
  constexpr int psize = kBF16 ? 2 : 4;
  const auto [first, count, full_groups, rem, key0] = chunk_span(L, c);

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
    if (live[k] == 4) {
      old_terms<kBF16, kMaster, true>(x[k], gi, 4, key0, old);
    } else if (live[k] > 0) {
      old_terms<kBF16, kMaster, false>(x[k], gi, live[k], key0, old);
    }
  }
  old = block_sum(old);
  const bool to_mirror = chunk_faults<kMaster>(L, c, count, psize, old) == 0;  // block-uniform

  Sums sum;
#pragma unroll
  for (int k = 0; k < kG; ++k) {
    const int64_t gi = threadIdx.x + static_cast<int64_t>(k) * kThreads;
    if (live[k] == 4) {
      process_group<kBF16, kMaster, true, false>(L, h, s, first, gi, 4, key0, x[k], sum, to_mirror);
    } else if (live[k] > 0) {
      process_group<kBF16, kMaster, false, false>(L, h, s, first, gi, live[k], key0, x[k], sum,
                                                  to_mirror);
    }
  }
  const Sums t = block_sum(sum);
  if (threadIdx.x == 0) finish_chunk<kMaster>(L, c, count, psize, old, t, to_mirror);
}

// Every chunk of the table, block b taking chunks b, b + gridDim.x, ... (the body of the
// chunk-loop kernels below, which differ in their launch bounds and loads).
template <bool kBF16, bool kMaster, int kInFlight, bool kMirror, bool kKeepA, int kPrefetch,
          bool kEvictFirst>
__device__ __forceinline__ void every_chunk(const LeafTable& T, const AdamWHyper& h,
                                            const float* step) {
  const AdamWStep s = adamw_step(step);
  for (int64_t gc = blockIdx.x; gc < T.first_chunk[T.count]; gc += gridDim.x) {
    const int i = leaf_of(T, gc);
    two_pass_chunk<kBF16, kMaster, kInFlight, kMirror, kKeepA, kPrefetch, kEvictFirst>(
        T.leaf[i], h, s, gc - T.first_chunk[i]);
  }
}

// One group in flight: at least 3 blocks per SM (at most 85 registers). Without the bound the
// leaf table's dynamic indexing lets the compiler keep the leaf's pointers in registers: 100
// with master weights, 2 blocks per SM, 8 % slower (bench/NOTES.md, v4).
template <bool kBF16, bool kMaster, int kInFlight, bool kMirror, bool kKeepA, int kPrefetch = 0>
__global__ void __launch_bounds__(kThreads, kInFlight == 1 ? 3 : 1)
    adamw_kernel(const __grid_constant__ LeafTable T, const AdamWHyper h,
                 const float* __restrict__ step) {
  every_chunk<kBF16, kMaster, kInFlight, kMirror, kKeepA, kPrefetch, true>(T, h, step);
}

// The same with at least 4 blocks per SM (at most 64 registers; ptxas spills 36 bytes for
// fp32, 52 for bf16, 180 with master weights): more warps to hide the loads behind, at the
// price of the spills (AdamWLaunch::min_blocks = 4; bench/NOTES.md, v8).
template <bool kBF16, bool kMaster>
__global__ void __launch_bounds__(kThreads, 4)
    adamw_kernel_4_blocks(const __grid_constant__ LeafTable T, const AdamWHyper h,
                          const float* __restrict__ step) {
  every_chunk<kBF16, kMaster, 1, false, false, 0, true>(T, h, step);
}

// The default kernel with plain loads instead of evict-first ones (AdamWLaunch::plain_loads):
// a plain fp32 stream of the same bytes ran 2.5 % faster so (bench/NOTES.md, v3).
template <bool kBF16, bool kMaster>
__global__ void __launch_bounds__(kThreads, 3)
    adamw_kernel_plain_loads(const __grid_constant__ LeafTable T, const AdamWHyper h,
                             const float* __restrict__ step) {
  every_chunk<kBF16, kMaster, 1, false, false, 0, false>(T, h, step);
}

// The staged pipeline: kStages stages of Stage<>::kBytes each in dynamic shared memory.
template <bool kBF16, bool kMaster, int kStages>
__global__ void __launch_bounds__(kThreads, 3)
    adamw_staged_kernel(const __grid_constant__ LeafTable T, const AdamWHyper h,
                        const float* __restrict__ step) {
  extern __shared__ __align__(16) char stage_mem[];
  const AdamWStep s = adamw_step(step);
  for (int64_t gc = blockIdx.x; gc < T.first_chunk[T.count]; gc += gridDim.x) {
    const int i = leaf_of(T, gc);
    staged_chunk<kBF16, kMaster, kStages>(T.leaf[i], h, s, gc - T.first_chunk[i], stage_mem);
  }
}

// Above 48 KiB of dynamic shared memory a kernel must opt in (once per kernel and device); the
// largest carve-out lets three blocks' stages share an SM (the driver's own choice may not).
template <typename Kernel>
cudaError_t allow_shared_memory(Kernel kernel, int bytes) {
  PIMHBM_CUDA_RETURN_IF_ERROR(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  return cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                              cudaSharedmemCarveoutMaxShared);
}

// The pipeline kernel of `stages` stages (2-4), opted into the shared memory it needs (up to
// 64 KiB, returned in `bytes`).
template <bool kBF16, bool kMaster>
cudaError_t staged_kernel(int stages, void (**kernel)(LeafTable, AdamWHyper, const float*),
                          int* bytes) {
  *kernel = stages == 2   ? adamw_staged_kernel<kBF16, kMaster, 2>
            : stages == 3 ? adamw_staged_kernel<kBF16, kMaster, 3>
                          : adamw_staged_kernel<kBF16, kMaster, 4>;
  *bytes = stages * Stage<kBF16, kMaster>::kBytes;
  return allow_shared_memory(*kernel, *bytes);
}

template <bool kBF16, bool kMaster>
cudaError_t launch_staged(int stages, const LeafTable& T, int blocks, const AdamWHyper& h,
                          const float* step, cudaStream_t stream) {
  void (*kernel)(LeafTable, AdamWHyper, const float*);
  int bytes;
  PIMHBM_CUDA_RETURN_IF_ERROR((staged_kernel<kBF16, kMaster>(stages, &kernel, &bytes)));
  kernel<<<blocks, kThreads, bytes, stream>>>(T, h, step);
  PIMHBM_CUDA_RETURN_LAUNCH_ERROR();
  return cudaSuccess;
}

template <bool kBF16, bool kMaster, int kG>
__global__ void __launch_bounds__(kThreads)
    adamw_resident_kernel(const __grid_constant__ LeafTable T, const AdamWHyper h,
                          const float* __restrict__ step) {
  const AdamWStep s = adamw_step(step);
  for (int64_t gc = blockIdx.x; gc < T.first_chunk[T.count]; gc += gridDim.x) {
    const int i = leaf_of(T, gc);
    resident_chunk<kBF16, kMaster, kG>(T.leaf[i], h, s, gc - T.first_chunk[i]);
  }
}

// One launch over the table; the kernel is picked by the kind of its leaves (all the same).
struct Plan {
  bool bf16, master, mirror;
  MirrorPass pass;
  int in_flight, resident;  // groups in flight (two-pass kernels); groups kept (resident)
  int prefetch;             // iterations prefetched ahead (no mirror, one group in flight)
  int stages;               // groups staged through shared memory (no mirror; 0 = off)
  int min_blocks;           // blocks per SM compiled for (no mirror, one group; 0 = 3)
  bool plain_loads;         // the default kernel with plain loads (no mirror, one group)
};

template <bool kBF16, bool kMaster>
cudaError_t launch_kind(const LeafTable& T, const Plan& p, const AdamWHyper& h, const float* step,
                        cudaStream_t stream) {
  const int blocks = static_cast<int>(std::min<int64_t>(T.first_chunk[T.count], 0x7FFFFFFF));
  if (!p.mirror && p.stages != 0) {
    return launch_staged<kBF16, kMaster>(p.stages, T, blocks, h, step, stream);
  }
  if (!p.mirror) {
    if (p.in_flight == 2) {
      adamw_kernel<kBF16, kMaster, 2, false, false><<<blocks, kThreads, 0, stream>>>(T, h, step);
    } else if (p.prefetch == 2) {
      adamw_kernel<kBF16, kMaster, 1, false, false, 2><<<blocks, kThreads, 0, stream>>>(T, h, step);
    } else if (p.prefetch == 4) {
      adamw_kernel<kBF16, kMaster, 1, false, false, 4><<<blocks, kThreads, 0, stream>>>(T, h, step);
    } else if (p.min_blocks == 4) {
      adamw_kernel_4_blocks<kBF16, kMaster><<<blocks, kThreads, 0, stream>>>(T, h, step);
    } else if (p.plain_loads) {
      adamw_kernel_plain_loads<kBF16, kMaster><<<blocks, kThreads, 0, stream>>>(T, h, step);
    } else {
      adamw_kernel<kBF16, kMaster, 1, false, false><<<blocks, kThreads, 0, stream>>>(T, h, step);
    }
  } else if (p.pass == MirrorPass::kRegisters) {
    switch (p.resident) {
      case 1:
        adamw_resident_kernel<kBF16, kMaster, 1><<<blocks, kThreads, 0, stream>>>(T, h, step);
        break;
      case 2:
        adamw_resident_kernel<kBF16, kMaster, 2><<<blocks, kThreads, 0, stream>>>(T, h, step);
        break;
      default:
        adamw_resident_kernel<kBF16, kMaster, 4><<<blocks, kThreads, 0, stream>>>(T, h, step);
    }
  } else {
    const bool keep = p.pass == MirrorPass::kTwoReadsKeep;
    if (p.in_flight == 2) {
      if (keep)
        adamw_kernel<kBF16, kMaster, 2, true, true><<<blocks, kThreads, 0, stream>>>(T, h, step);
      else
        adamw_kernel<kBF16, kMaster, 2, true, false><<<blocks, kThreads, 0, stream>>>(T, h, step);
    } else {
      if (keep)
        adamw_kernel<kBF16, kMaster, 1, true, true><<<blocks, kThreads, 0, stream>>>(T, h, step);
      else
        adamw_kernel<kBF16, kMaster, 1, true, false><<<blocks, kThreads, 0, stream>>>(T, h, step);
    }
  }
  PIMHBM_CUDA_RETURN_LAUNCH_ERROR();
  return cudaSuccess;
}

cudaError_t launch_table(const LeafTable& T, const Plan& p, const AdamWHyper& h, const float* step,
                         cudaStream_t stream) {
  if (T.count == 0 || T.first_chunk[T.count] == 0) return cudaSuccess;
  if (p.bf16 && p.master) return launch_kind<true, true>(T, p, h, step, stream);
  if (p.bf16) return launch_kind<true, false>(T, p, h, step, stream);
  return launch_kind<false, false>(T, p, h, step, stream);
}

Plan plan_for(const AdamWLeaf& leaf, AdamWLaunch options) {
  Plan p{leaf.param_bf16,
         leaf.has_master,
         leaf.has_mirror,
         options.mirror_pass,
         options.groups_in_flight == 2 ? 2 : 1,
         resident_groups(leaf.chunk_elems),
         options.prefetch,
         options.stages,
         options.min_blocks,
         options.plain_loads};
  // Default (bench/NOTES.md, v3): registers where the chunk fits, except with master weights,
  // whose five tensors per group take 128 registers there and run faster read twice.
  if (p.pass == MirrorPass::kDefault) {
    p.pass = p.resident != 0 && !p.master ? MirrorPass::kRegisters : MirrorPass::kTwoReadsKeep;
  } else if (p.pass == MirrorPass::kRegisters && p.resident == 0) {
    p.pass = MirrorPass::kTwoReadsKeep;
  }
  return p;
}

bool same_launch(const Plan& a, const Plan& b) {
  return a.bf16 == b.bf16 && a.master == b.master && a.mirror == b.mirror && a.pass == b.pass &&
         a.in_flight == b.in_flight && a.resident == b.resident && a.prefetch == b.prefetch &&
         a.stages == b.stages && a.min_blocks == b.min_blocks && a.plain_loads == b.plain_loads;
}

template <bool kBF16, bool kMaster>
cudaError_t occupancy_kind(int stages, int* blocks, int min_blocks) {
  if (stages == 0 && min_blocks == 4) {
    return cudaOccupancyMaxActiveBlocksPerMultiprocessor(
        blocks, adamw_kernel_4_blocks<kBF16, kMaster>, kThreads, 0);
  }
  if (stages == 0) {
    return cudaOccupancyMaxActiveBlocksPerMultiprocessor(
        blocks, adamw_kernel<kBF16, kMaster, 1, false, false>, kThreads, 0);
  }
  void (*kernel)(LeafTable, AdamWHyper, const float*);
  int bytes;
  PIMHBM_CUDA_RETURN_IF_ERROR((staged_kernel<kBF16, kMaster>(stages, &kernel, &bytes)));
  return cudaOccupancyMaxActiveBlocksPerMultiprocessor(blocks, kernel, kThreads, bytes);
}

}  // namespace

cudaError_t adamw_blocks_per_sm(bool bf16, bool master, int stages, int* blocks, int min_blocks) {
  if (stages != 0 && (stages < 2 || stages > 4)) return cudaErrorInvalidValue;
  if (bf16 && master) return occupancy_kind<true, true>(stages, blocks, min_blocks);
  if (bf16) return occupancy_kind<true, false>(stages, blocks, min_blocks);
  return occupancy_kind<false, false>(stages, blocks, min_blocks);
}

int resident_groups(int64_t chunk_elems) {
  const int64_t groups = (chunk_elems + 4 * kThreads - 1) / (4 * kThreads);  // per thread
  return groups <= 1 ? 1 : groups <= 2 ? 2 : groups <= 4 ? 4 : 0;
}

cudaError_t adamw_cuda(const AdamWLeaf* leaves, size_t count, const AdamWHyper& hyper,
                       const float* step, cudaStream_t stream, AdamWLaunch options) {
  if (options.groups_in_flight < 0 || options.groups_in_flight > 2) return cudaErrorInvalidValue;
  if (options.prefetch != 0 && options.prefetch != 2 && options.prefetch != 4) {
    return cudaErrorInvalidValue;
  }
  if (options.stages != 0 && (options.stages < 2 || options.stages > 4)) {
    return cudaErrorInvalidValue;
  }
  if (options.min_blocks != 0 && options.min_blocks != 3 && options.min_blocks != 4) {
    return cudaErrorInvalidValue;
  }
  // Leaves of the same kind go in one launch (up to kMaxLeaves each), in the order given.
  std::vector<bool> done(count, false);
  for (size_t i = 0; i < count; ++i) {
    if (done[i]) continue;
    const Plan p = plan_for(leaves[i], options);
    LeafTable T{};
    T.count = 0;
    T.first_chunk[0] = 0;
    for (size_t j = i; j < count; ++j) {
      if (done[j] || !same_launch(p, plan_for(leaves[j], options))) continue;
      const int64_t nchunks = leaf_chunks(leaves[j]);
      done[j] = true;
      if (nchunks == 0) continue;
      T.leaf[T.count] = leaves[j];
      T.first_chunk[T.count + 1] = T.first_chunk[T.count] + nchunks;
      if (++T.count == kMaxLeaves) {
        PIMHBM_CUDA_RETURN_IF_ERROR(launch_table(T, p, hyper, step, stream));
        T.count = 0;
      }
    }
    PIMHBM_CUDA_RETURN_IF_ERROR(launch_table(T, p, hyper, step, stream));
  }
  return cudaSuccess;
}

cudaError_t adamw_cuda(const AdamWLeaf& leaf, const AdamWHyper& hyper, const float* step,
                       cudaStream_t stream, AdamWLaunch options) {
  return adamw_cuda(&leaf, 1, hyper, step, stream, options);
}

}  // namespace pimhbm::update
