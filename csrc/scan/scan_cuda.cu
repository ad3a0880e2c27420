// CUDA scan and verify kernels. One block per chunk (blocks loop when there are more chunks
// than blocks); every thread digests 16-byte vectors of its chunk, the block sums the terms
// with warp shuffles and shared memory, and thread 0 writes the chunk's results.
//
// Why it is shaped this way:
// * 16-byte loads, kUnroll of them in flight per thread, streamed past L1: the scan is a pure
//   read of memory and must run at the bandwidth ceiling.
// * The digest is a sum mod 2^64 (digest.h), the count a sum and the max an integer max over
//   bit patterns, so the result is exact and independent of the launch shape -- no floats and
//   no order-dependent atomics.
// * Ragged ends never read past the buffer: the last partial group of vectors is loaded under
//   a predicate as zeros (which add no digest term), and the last 0..15 bytes of a buffer are
//   read one byte at a time under a predicate by thread 0.
// * The finite check rides on the max: the streaming pass keeps only the largest magnitude bit
//   pattern (|x| with NaN/Inf included: one AND and half a 3-way max per word, two bf16 or
//   four fp8 values at a time). A chunk whose largest pattern is NaN/Inf (rare: a damaged
//   chunk) is read a second time by its block to count them and to take the max over the
//   finite values exactly. Both passes are integer arithmetic on whole words, no per-element
//   branch.
#include <cuda_runtime.h>

#include <algorithm>
#include <type_traits>

#include "pimhbm/cuda_check.h"
#include "pimhbm/digest.h"
#include "pimhbm/word_muls.cuh"
#include "pimhbm/elem.h"
#include "scan/scan.h"

namespace pimhbm::scan {
namespace {

constexpr int kUnroll = 4;
// Blocks of up to 256 threads, at least 8 of them resident per SM (full occupancy): the
// compiler keeps the kernel within 32 registers.
constexpr int kMaxThreads = 256;
constexpr int kMinBlocks = 8;
constexpr int kDefaultMaxThreads = 256;

// ---- finite checks over 32-bit words ------------------------------------------------------
// Each dtype has
//  * a fast state for the streaming pass: the largest magnitude bit pattern seen (NaN/Inf
//    included), and kNonFiniteKey: a largest pattern >= this means some element is NaN/Inf;
//  * an exact check for the second pass over a chunk that has NaN/Inf: the count of
//    non-finite elements and the largest finite magnitude pattern.
// Magnitude patterns order like |x| for finite values, so the max is an integer max; it is
// turned into a float once per chunk.

struct NoCheck {
  using Fast = uint32_t;
  static constexpr uint64_t kNonFiniteKey = ~0ull;
  static __device__ Fast fast(Fast s, uint4) { return s; }
  static __device__ uint64_t fast_key(Fast) { return 0; }
  static __device__ float to_float(uint64_t) { return 0.0f; }
};

struct F32Check {
  using Fast = uint32_t;
  static constexpr uint64_t kNonFiniteKey = 0x7F800000u;  // exponent all ones
  static __device__ Fast fast(Fast s, uint4 v) {
    constexpr uint32_t m = 0x7FFFFFFFu;
    return max(max(s, max(v.x & m, v.y & m)), max(v.z & m, v.w & m));
  }
  static __device__ uint64_t fast_key(Fast s) { return s; }

  uint32_t n = 0, mx = 0;
  __device__ void word(uint32_t w) {
    uint32_t a = w & 0x7FFFFFFFu;
    uint32_t nf = (a + 0x00800000u) >> 31;  // a >= 0x7f800000
    n += nf;
    mx = max(mx, a & (nf - 1u));            // non-finite values count as 0
  }
  __device__ void add(uint4 v) { word(v.x); word(v.y); word(v.z); word(v.w); }
  __device__ uint32_t count() const { return n; }
  __device__ uint64_t max_key() const { return mx; }
  static __device__ float to_float(uint64_t k) { return __uint_as_float(static_cast<uint32_t>(k)); }
};

struct F64Check {
  using Fast = uint64_t;
  static constexpr uint64_t kNonFiniteKey = 0x7FF0000000000000ull;
  static __device__ Fast fast(Fast s, uint4 v) {
    constexpr uint32_t m = 0x7FFFFFFFu;
    const uint64_t a = (static_cast<uint64_t>(v.y & m) << 32) | v.x;
    const uint64_t b = (static_cast<uint64_t>(v.w & m) << 32) | v.z;
    return max(s, max(a, b));
  }
  static __device__ uint64_t fast_key(Fast s) { return s; }

  uint32_t n = 0;
  uint64_t mx = 0;
  __device__ void unit(uint32_t lo, uint32_t hi) {
    uint32_t ahi = hi & 0x7FFFFFFFu;
    uint32_t nf = (ahi + 0x00100000u) >> 31;  // ahi >= 0x7ff00000
    n += nf;
    uint64_t a = (static_cast<uint64_t>(ahi) << 32) | lo;
    mx = max(mx, a & (static_cast<uint64_t>(nf) - 1u));
  }
  __device__ void add(uint4 v) { unit(v.x, v.y); unit(v.z, v.w); }
  __device__ uint32_t count() const { return n; }
  __device__ uint64_t max_key() const { return mx; }
  static __device__ float to_float(uint64_t k) {
    return __double2float_rn(__longlong_as_double(static_cast<long long>(k)));
  }
};

// Two 16-bit values per word. Exact check: a lane |x| is non-finite when it is >= the first
// non-finite pattern T; adding (0x8000 - T) sets the lane's top bit exactly then, and cannot
// carry into the next lane because |x| <= 0x7fff.
template <uint32_t kFirstNonFinite, bool kBF16>
struct Half2Check {
  using Fast = uint32_t;  // two lane maxima
  static constexpr uint64_t kNonFiniteKey = kFirstNonFinite;
  static __device__ Fast fast(Fast s, uint4 v) {
    constexpr uint32_t m = 0x7FFF7FFFu;
    return __vmaxu2(__vmaxu2(s, __vmaxu2(v.x & m, v.y & m)), __vmaxu2(v.z & m, v.w & m));
  }
  static __device__ uint64_t fast_key(Fast s) { return max(s & 0xFFFFu, s >> 16); }

  static constexpr uint32_t kAdd = (0x8000u - kFirstNonFinite) * 0x00010001u;
  uint32_t n = 0, mx = 0;  // mx holds two lane maxima
  __device__ void word(uint32_t w) {
    uint32_t a = w & 0x7FFF7FFFu;
    uint32_t t = (a + kAdd) & 0x80008000u;
    n += __popc(t);
    uint32_t bad = t - (t >> 15);  // 0x7fff in every non-finite lane
    mx = __vmaxu2(mx, a & ~bad);
  }
  __device__ void add(uint4 v) { word(v.x); word(v.y); word(v.z); word(v.w); }
  __device__ uint32_t count() const { return n; }
  __device__ uint64_t max_key() const { return fast_key(mx); }
  static __device__ float to_float(uint64_t k) {
    return kBF16 ? __uint_as_float(static_cast<uint32_t>(k) << 16)
                 : f16_abs_to_float(static_cast<uint32_t>(k));
  }
};
using BF16Check = Half2Check<0x7F80u, true>;   // non-finite: |x| >= 0x7f80
using F16Check = Half2Check<0x7C00u, false>;   // non-finite: |x| >= 0x7c00

// Four 8-bit values per word, same tricks with 8-bit lanes.
template <uint32_t kFirstNonFinite, bool kE4M3>
struct Byte4Check {
  using Fast = uint32_t;  // four lane maxima
  static constexpr uint64_t kNonFiniteKey = kFirstNonFinite;
  static __device__ Fast fast(Fast s, uint4 v) {
    constexpr uint32_t m = 0x7F7F7F7Fu;
    return __vmaxu4(__vmaxu4(s, __vmaxu4(v.x & m, v.y & m)), __vmaxu4(v.z & m, v.w & m));
  }
  static __device__ uint64_t fast_key(Fast s) {
    return max(max(s & 0xFFu, (s >> 8) & 0xFFu), max((s >> 16) & 0xFFu, s >> 24));
  }

  static constexpr uint32_t kAdd = (0x80u - kFirstNonFinite) * 0x01010101u;
  uint32_t n = 0, mx = 0;  // mx holds four lane maxima
  __device__ void word(uint32_t w) {
    uint32_t a = w & 0x7F7F7F7Fu;
    uint32_t t = (a + kAdd) & 0x80808080u;
    n += __popc(t);
    uint32_t bad = t - (t >> 7);  // 0x7f in every non-finite lane
    mx = __vmaxu4(mx, a & ~bad);
  }
  __device__ void add(uint4 v) { word(v.x); word(v.y); word(v.z); word(v.w); }
  __device__ uint32_t count() const { return n; }
  __device__ uint64_t max_key() const { return fast_key(mx); }
  static __device__ float to_float(uint64_t k) {
    return kE4M3 ? f8e4m3fn_abs_to_float(static_cast<uint32_t>(k))
                 : f8e5m2_abs_to_float(static_cast<uint32_t>(k));
  }
};
using E4M3Check = Byte4Check<0x7Fu, true>;   // non-finite: |x| == 0x7f (NaN)
using E5M2Check = Byte4Check<0x7Cu, false>;  // non-finite: |x| >= 0x7c

// ---- loads ----------------------------------------------------------------------------------

// 16 bytes at `p` (16-byte aligned), read-only and not kept in L1: each byte is read once.
// volatile keeps the kUnroll loads of a group together, ahead of the arithmetic that uses them.
__device__ __forceinline__ uint4 load_vec(const uint8_t* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// The same load under a predicate written into the instruction itself: when `live` is false
// nothing is read (p may point past the end) and the result is zero. No branch.
__device__ __forceinline__ uint4 load_vec_if(bool live, const uint8_t* p) {
  uint4 v;
  asm("{\n\t.reg .pred q;\n\t"
      "setp.ne.b32 q, %5, 0;\n\t"
      "mov.b32 %0, 0; mov.b32 %1, 0; mov.b32 %2, 0; mov.b32 %3, 0;\n\t"
      "@q ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n\t}"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p), "r"(static_cast<int>(live)));
  return v;
}

// 16 bytes at `p` with no alignment requirement (the byte path for misaligned views).
__device__ __forceinline__ uint4 load_bytes(const uint8_t* p) {
  uint32_t w[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    w[k] = static_cast<uint32_t>(__ldg(p + 4 * k)) |
           static_cast<uint32_t>(__ldg(p + 4 * k + 1)) << 8 |
           static_cast<uint32_t>(__ldg(p + 4 * k + 2)) << 16 |
           static_cast<uint32_t>(__ldg(p + 4 * k + 3)) << 24;
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

template <bool kAligned>
__device__ __forceinline__ uint4 load16(const uint8_t* p) {
  return kAligned ? load_vec(p) : load_bytes(p);
}

template <bool kAligned>
__device__ __forceinline__ uint4 load16_if(bool live, const uint8_t* p) {
  if constexpr (kAligned) {
    return load_vec_if(live, p);
  } else {
    return live ? load_bytes(p) : make_uint4(0, 0, 0, 0);
  }
}

// ---- block reduction ------------------------------------------------------------------------

struct Partial {
  uint64_t acc;
  uint32_t count;
  uint64_t max_key;
};

// Butterfly reduction: every lane ends with the warp's total.
__device__ __forceinline__ Partial warp_allreduce(Partial p) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    p.acc += __shfl_xor_sync(0xFFFFFFFFu, p.acc, off);
    p.count += __shfl_xor_sync(0xFFFFFFFFu, p.count, off);
    p.max_key = max(p.max_key, __shfl_xor_sync(0xFFFFFFFFu, p.max_key, off));
  }
  return p;
}

// Sum / sum / max over the block, returned to every thread (so that the block can branch on
// it uniformly).
__device__ __forceinline__ Partial block_allreduce(Partial p) {
  __shared__ uint64_t s_acc[32];
  __shared__ uint32_t s_count[32];
  __shared__ uint64_t s_max[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  p = warp_allreduce(p);
  if (lane == 0) {
    s_acc[warp] = p.acc;
    s_count[warp] = p.count;
    s_max[warp] = p.max_key;
  }
  __syncthreads();
  const bool have = lane < static_cast<int>(blockDim.x >> 5);
  p.acc = have ? s_acc[lane] : 0;
  p.count = have ? s_count[lane] : 0;
  p.max_key = have ? s_max[lane] : 0;
  p = warp_allreduce(p);
  __syncthreads();  // shared memory is reused by the next reduction
  return p;
}

// ---- one pass over a chunk ------------------------------------------------------------------

// Calls visit(v, index) for every 16-byte vector of the chunk that this thread owns: `index`
// is the vector's place in the chunk (its words are 4 index .. 4 index + 3). Bytes past the end
// read as zero, which the digest ignores (digest.h).
template <bool kAligned, class Visit>
__device__ __forceinline__ void for_each_vector(const uint8_t* base, int64_t len, Visit&& visit) {
  const int64_t bd = blockDim.x;
  const int64_t nvec = len >> 4;
  int64_t j = threadIdx.x;
  // Whole groups: kUnroll loads issued before any is used.
  for (; j + (kUnroll - 1) * bd < nvec; j += kUnroll * bd) {
    uint4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = load16<kAligned>(base + 16 * (j + u * bd));
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) visit(v[u], j + u * bd);
  }
  // The last partial group: loads under a predicate. Block-uniform test: a chunk that is a
  // whole number of groups (every full 64 KiB chunk with the default shape) skips it.
  if (nvec % (kUnroll * bd) != 0) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t jj = j + u * bd;
      visit(load16_if<kAligned>(jj < nvec, base + 16 * jj), jj);
    }
  }
  // The last 0..15 bytes: only a buffer's last chunk has them (block-uniform test); thread 0
  // reads them with byte loads under a predicate.
  const int64_t rem = len & 15;
  if (rem != 0) {
    const bool mine = threadIdx.x == 0;
    const uint8_t* tail = base + 16 * nvec;
    uint32_t w[4] = {0, 0, 0, 0};
#pragma unroll
    for (int b = 0; b < 16; ++b) {
      const uint32_t byte = (mine && b < rem) ? __ldg(tail + b) : 0u;
      w[b >> 2] |= byte << (8 * (b & 3));
    }
    visit(make_uint4(w[0], w[1], w[2], w[3]), nvec);
  }
}

// ---- the kernel -----------------------------------------------------------------------------

// kVerify: compare with `expected` and write `mismatch`; otherwise write digests and health.
// A chunk whose largest magnitude pattern is NaN/Inf gets nonfinite[c] = -1 here: the
// exact_health_kernel that runs next counts its non-finite values and takes its max |x|.
// (A second kernel rather than a branch here: a call or the inlined second pass would cost
// the streaming pass registers or spills on every chunk.)
template <class Check, bool kVerify, bool kAligned>
__global__ void __launch_bounds__(kMaxThreads, kMinBlocks)
    scan_kernel(const uint8_t* __restrict__ data, int64_t nbytes, int64_t chunk_bytes,
                int64_t nchunks, uint32_t* __restrict__ digests, int32_t* __restrict__ nonfinite,
                float* __restrict__ max_abs, const uint32_t* __restrict__ expected,
                uint8_t* __restrict__ mismatch, const int32_t* __restrict__ chunk_base) {
  const int64_t first = chunk_base != nullptr ? *chunk_base : 0;
  for (int64_t c = blockIdx.x; c < nchunks; c += gridDim.x) {
    const uint8_t* base = data + c * chunk_bytes;
    const int64_t len = chunk_length(nbytes, chunk_bytes, c);

    // Streaming pass: digest terms and the fast magnitude max.
    uint64_t acc = 0;
    typename Check::Fast fast = 0;
    for_each_vector<kAligned>(base, len, [&](uint4 v, int64_t index) {
      acc += vector_terms(v, word_muls_of_vector(static_cast<uint32_t>(index)));
      if constexpr (!kVerify) fast = Check::fast(fast, v);  // zeros past the end: no effect
    });
    const Partial r = block_allreduce(Partial{acc, 0, Check::fast_key(fast)});
    if (threadIdx.x == 0) {
      const uint64_t d =
          finalize(r.acc, static_cast<uint64_t>(len), static_cast<uint64_t>(first + c));
      if constexpr (kVerify) {
        mismatch[c] = d != digest_join(expected[2 * c], expected[2 * c + 1]) ? 1 : 0;
      } else {
        const bool dirty = r.max_key >= Check::kNonFiniteKey;
        digests[2 * c] = digest_lo(d);
        digests[2 * c + 1] = digest_hi(d);
        nonfinite[c] = dirty ? -1 : 0;
        max_abs[c] = Check::to_float(dirty ? 0 : r.max_key);
      }
    }
  }
}

// Second pass, only over the chunks the scan marked (nonfinite[c] == -1): exact count of
// NaN/Inf and the largest finite |x|. Clean chunks cost one flag read per block.
template <class Check, bool kAligned>
__global__ void __launch_bounds__(kMaxThreads)
    exact_health_kernel(const uint8_t* __restrict__ data, int64_t nbytes, int64_t chunk_bytes,
                        int64_t nchunks, int32_t* __restrict__ nonfinite,
                        float* __restrict__ max_abs) {
  for (int64_t c = blockIdx.x; c < nchunks; c += gridDim.x) {
    if (nonfinite[c] != -1) continue;  // block-uniform
    const uint8_t* base = data + c * chunk_bytes;
    Check exact;
    for_each_vector<kAligned>(base, chunk_length(nbytes, chunk_bytes, c),
                              [&](uint4 v, int64_t) { exact.add(v); });
    const Partial e = block_allreduce(Partial{0, exact.count(), exact.max_key()});
    if (threadIdx.x == 0) {
      nonfinite[c] = static_cast<int32_t>(e.count);
      max_abs[c] = Check::to_float(e.max_key);
    }
  }
}

struct Args {
  const uint8_t* data;
  int64_t nbytes, chunk_bytes, nchunks;
  uint32_t* digests;
  int32_t* nonfinite;
  float* max_abs;
  const uint32_t* expected;
  uint8_t* mismatch;
  const int32_t* chunk_base;
};

// Blocks of the second pass: each loops over many chunks and reads one flag per chunk.
constexpr int64_t kExactBlocks = 2048;

template <class Check, bool kVerify>
cudaError_t launch(const Args& a, int threads, int blocks, cudaStream_t stream) {
  const bool aligned = reinterpret_cast<uintptr_t>(a.data) % 16 == 0;
  auto kernel = aligned ? scan_kernel<Check, kVerify, true> : scan_kernel<Check, kVerify, false>;
  kernel<<<blocks, threads, 0, stream>>>(a.data, a.nbytes, a.chunk_bytes, a.nchunks, a.digests,
                                         a.nonfinite, a.max_abs, a.expected, a.mismatch,
                                         a.chunk_base);
  PIMHBM_CUDA_RETURN_LAUNCH_ERROR();
  if constexpr (!kVerify && !std::is_same_v<Check, NoCheck>) {
    auto exact = aligned ? exact_health_kernel<Check, true> : exact_health_kernel<Check, false>;
    const int exact_blocks = static_cast<int>(std::min<int64_t>(a.nchunks, kExactBlocks));
    exact<<<exact_blocks, threads, 0, stream>>>(a.data, a.nbytes, a.chunk_bytes, a.nchunks,
                                                a.nonfinite, a.max_abs);
    PIMHBM_CUDA_RETURN_LAUNCH_ERROR();
  }
  return cudaSuccess;
}

// Threads per block: about 32 vectors (8 groups) per thread so that the per-chunk work (the
// block reduction, the outputs) stays small next to the streaming; a whole number of warps,
// 32 to 256. A 64 KiB chunk gets 128 threads.
int default_threads(int64_t chunk_bytes) {
  int64_t want = (chunk_bytes / 16 + 31) / 32;
  want = (want + 31) / 32 * 32;
  return static_cast<int>(std::clamp<int64_t>(want, 32, kDefaultMaxThreads));
}

cudaError_t run(const Args& a, Elem elem, bool verify, LaunchShape shape, cudaStream_t stream) {
  if (a.nchunks == 0) return cudaSuccess;  // nothing to read, nothing to write
  const int threads = shape.threads > 0 ? shape.threads : default_threads(a.chunk_bytes);
  if (threads % 32 != 0 || threads > kMaxThreads) return cudaErrorInvalidConfiguration;
  const int64_t max_blocks = shape.max_blocks > 0 ? shape.max_blocks : 0x7FFFFFFF;
  const int blocks = static_cast<int>(std::min<int64_t>(a.nchunks, max_blocks));
  if (verify) return launch<NoCheck, true>(a, threads, blocks, stream);
  switch (elem) {
    case Elem::kRaw: return launch<NoCheck, false>(a, threads, blocks, stream);
    case Elem::kF64: return launch<F64Check, false>(a, threads, blocks, stream);
    case Elem::kF32: return launch<F32Check, false>(a, threads, blocks, stream);
    case Elem::kF16: return launch<F16Check, false>(a, threads, blocks, stream);
    case Elem::kBF16: return launch<BF16Check, false>(a, threads, blocks, stream);
    case Elem::kF8E4M3FN: return launch<E4M3Check, false>(a, threads, blocks, stream);
    case Elem::kF8E5M2: return launch<E5M2Check, false>(a, threads, blocks, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t scan_cuda_shaped(const void* data, int64_t nbytes, Elem elem, int64_t chunk_bytes,
                             uint32_t* digests, int32_t* nonfinite, float* max_abs,
                             cudaStream_t stream, LaunchShape shape, const int32_t* chunk_base) {
  Args a{static_cast<const uint8_t*>(data), nbytes, chunk_bytes,
         num_chunks(nbytes, chunk_bytes), digests, nonfinite, max_abs, nullptr, nullptr,
         chunk_base};
  return run(a, elem, /*verify=*/false, shape, stream);
}

cudaError_t scan_cuda(const void* data, int64_t nbytes, Elem elem, int64_t chunk_bytes,
                      uint32_t* digests, int32_t* nonfinite, float* max_abs,
                      cudaStream_t stream, const int32_t* chunk_base) {
  return scan_cuda_shaped(data, nbytes, elem, chunk_bytes, digests, nonfinite, max_abs, stream,
                          LaunchShape{}, chunk_base);
}

cudaError_t verify_cuda(const void* data, int64_t nbytes, int64_t chunk_bytes,
                        const uint32_t* expected, uint8_t* mismatch, cudaStream_t stream,
                        const int32_t* chunk_base) {
  Args a{static_cast<const uint8_t*>(data), nbytes, chunk_bytes,
         num_chunks(nbytes, chunk_bytes), nullptr, nullptr, nullptr, expected, mismatch,
         chunk_base};
  return run(a, Elem::kRaw, /*verify=*/true, LaunchShape{}, stream);
}

}  // namespace pimhbm::scan
