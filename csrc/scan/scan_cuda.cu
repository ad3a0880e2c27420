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
//   a predicate and its terms are selected away, and the last 0..15 bytes of a buffer are read
//   one byte at a time under a predicate by thread 0.
// * The finite checks work on whole 32-bit words (two bf16/f16 or four fp8 values at once)
//   with integer arithmetic, so there is no per-element branch.
#include <cuda_runtime.h>

#include <algorithm>

#include "pimhbm/cuda_check.h"
#include "pimhbm/digest.h"
#include "pimhbm/elem.h"
#include "scan/scan.h"

namespace pimhbm::scan {
namespace {

constexpr int kUnroll = 4;
constexpr int kMaxThreads = 1024;
constexpr int kDefaultMaxThreads = 256;

// ---- finite checks over 32-bit words ------------------------------------------------------
// Each keeps a count of non-finite elements and a "max key": an integer that orders like |x|
// over finite elements (the magnitude bits), turned into a float once per chunk.

struct NoCheck {
  __device__ void add(uint4) {}
  __device__ uint32_t count() const { return 0; }
  __device__ uint64_t max_key() const { return 0; }
  static __device__ float to_float(uint64_t) { return 0.0f; }
};

struct F32Check {
  uint32_t n = 0, mx = 0;
  __device__ void word(uint32_t w) {
    uint32_t a = w & 0x7FFFFFFFu;
    uint32_t nf = (a + 0x00800000u) >> 31;  // a >= 0x7f800000 (exponent all ones)
    n += nf;
    mx = max(mx, a & (nf - 1u));            // non-finite values count as 0
  }
  __device__ void add(uint4 v) { word(v.x); word(v.y); word(v.z); word(v.w); }
  __device__ uint32_t count() const { return n; }
  __device__ uint64_t max_key() const { return mx; }
  static __device__ float to_float(uint64_t k) { return __uint_as_float(static_cast<uint32_t>(k)); }
};

struct F64Check {
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

// Two 16-bit values per word. A lane |x| is non-finite when it is >= the first non-finite
// pattern T; adding (0x8000 - T) sets the lane's top bit exactly then, and cannot carry into
// the next lane because |x| <= 0x7fff.
template <uint32_t kAdd, bool kBF16>
struct Half2Check {
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
  __device__ uint64_t max_key() const { return max(mx & 0xFFFFu, mx >> 16); }
  static __device__ float to_float(uint64_t k) {
    return kBF16 ? __uint_as_float(static_cast<uint32_t>(k) << 16)
                 : f16_abs_to_float(static_cast<uint32_t>(k));
  }
};
using BF16Check = Half2Check<0x00800080u, true>;   // non-finite: |x| >= 0x7f80
using F16Check = Half2Check<0x04000400u, false>;   // non-finite: |x| >= 0x7c00

// Four 8-bit values per word, same trick with 8-bit lanes.
template <uint32_t kAdd, bool kE4M3>
struct Byte4Check {
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
  __device__ uint64_t max_key() const {
    return max(max(mx & 0xFFu, (mx >> 8) & 0xFFu), max((mx >> 16) & 0xFFu, mx >> 24));
  }
  static __device__ float to_float(uint64_t k) {
    return kE4M3 ? f8e4m3fn_abs_to_float(static_cast<uint32_t>(k))
                 : f8e5m2_abs_to_float(static_cast<uint32_t>(k));
  }
};
using E4M3Check = Byte4Check<0x01010101u, true>;   // non-finite: |x| == 0x7f (NaN)
using E5M2Check = Byte4Check<0x04040404u, false>;  // non-finite: |x| >= 0x7c

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

// Digest terms of the two units of one vector whose first unit has key `key`.
__device__ __forceinline__ uint64_t vec_terms(uint4 v, uint64_t key) {
  uint64_t lo = static_cast<uint64_t>(v.y) << 32 | v.x;
  uint64_t hi = static_cast<uint64_t>(v.w) << 32 | v.z;
  return unit_term(lo, key) + unit_term(hi, key + kUnitStride);
}

// ---- block reduction ------------------------------------------------------------------------

struct Partial {
  uint64_t acc;
  uint32_t count;
  uint64_t max_key;
};

__device__ __forceinline__ Partial warp_reduce(Partial p) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    p.acc += __shfl_down_sync(0xFFFFFFFFu, p.acc, off);
    p.count += __shfl_down_sync(0xFFFFFFFFu, p.count, off);
    p.max_key = max(p.max_key, __shfl_down_sync(0xFFFFFFFFu, p.max_key, off));
  }
  return p;
}

// Sum / sum / max over the block; the result is valid in thread 0.
__device__ __forceinline__ Partial block_reduce(Partial p) {
  __shared__ uint64_t s_acc[32];
  __shared__ uint32_t s_count[32];
  __shared__ uint64_t s_max[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  p = warp_reduce(p);
  if (lane == 0) {
    s_acc[warp] = p.acc;
    s_count[warp] = p.count;
    s_max[warp] = p.max_key;
  }
  __syncthreads();
  if (warp == 0) {
    const bool have = lane < static_cast<int>(blockDim.x >> 5);
    p.acc = have ? s_acc[lane] : 0;
    p.count = have ? s_count[lane] : 0;
    p.max_key = have ? s_max[lane] : 0;
    p = warp_reduce(p);
  }
  __syncthreads();  // shared memory is reused by the next chunk of this block
  return p;
}

// ---- the kernel -----------------------------------------------------------------------------

// kVerify: compare with `expected` and write `mismatch`; otherwise write digests and health.
template <class Check, bool kVerify, bool kAligned>
__global__ void __launch_bounds__(kMaxThreads)
    scan_kernel(const uint8_t* __restrict__ data, int64_t nbytes, int64_t chunk_bytes,
                int64_t nchunks, uint32_t* __restrict__ digests, int32_t* __restrict__ nonfinite,
                float* __restrict__ max_abs, const uint32_t* __restrict__ expected,
                uint8_t* __restrict__ mismatch) {
  const int64_t bd = blockDim.x;
  const uint64_t key_step = static_cast<uint64_t>(2 * bd) * kUnitStride;  // per vector stride
  for (int64_t c = blockIdx.x; c < nchunks; c += gridDim.x) {
    const uint8_t* base = data + c * chunk_bytes;
    const int64_t len = chunk_length(nbytes, chunk_bytes, c);
    const int64_t nvec = len >> 4;
    const uint64_t key0 = chunk_key(static_cast<uint64_t>(c));

    Check check;
    uint64_t acc = 0;
    int64_t j = threadIdx.x;
    uint64_t key = key0 + static_cast<uint64_t>(2 * j) * kUnitStride;

    // Whole groups: kUnroll loads issued before any is used.
    for (; j + (kUnroll - 1) * bd < nvec; j += kUnroll * bd) {
      uint4 v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) v[u] = load16<kAligned>(base + 16 * (j + u * bd));
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        acc += vec_terms(v[u], key);
        check.add(v[u]);
        key += key_step;
      }
    }
    // The last partial group: loads and terms under a predicate.
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t jj = j + u * bd;
      const bool live = jj < nvec;
      const uint4 v = load16_if<kAligned>(live, base + 16 * jj);
      const uint64_t t = vec_terms(v, key);
      acc += live ? t : 0;
      check.add(v);  // zeros are finite and have |x| = 0: no effect
      key += key_step;
    }
    // The last 0..15 bytes (only the buffer's last chunk has them): thread 0, byte loads.
    {
      const int64_t rem = len & 15;
      const bool mine = threadIdx.x == 0;
      const uint8_t* tail = base + 16 * nvec;
      uint32_t w[4] = {0, 0, 0, 0};
#pragma unroll
      for (int b = 0; b < 16; ++b) {
        const uint32_t byte = (mine && b < rem) ? __ldg(tail + b) : 0u;
        w[b >> 2] |= byte << (8 * (b & 3));
      }
      const uint64_t tkey = key0 + static_cast<uint64_t>(2 * nvec) * kUnitStride;
      const uint64_t lo = static_cast<uint64_t>(w[1]) << 32 | w[0];
      const uint64_t hi = static_cast<uint64_t>(w[3]) << 32 | w[2];
      const uint64_t t_lo = unit_term(lo, tkey), t_hi = unit_term(hi, tkey + kUnitStride);
      acc += (mine && rem > 0) ? t_lo : 0;
      acc += (mine && rem > 8) ? t_hi : 0;
      check.add(make_uint4(w[0], w[1], w[2], w[3]));
    }

    const Partial r = block_reduce(Partial{acc, check.count(), check.max_key()});
    if (threadIdx.x == 0) {
      const uint64_t d = finalize(r.acc, static_cast<uint64_t>(len), static_cast<uint64_t>(c));
      if constexpr (kVerify) {
        mismatch[c] = d != digest_join(expected[2 * c], expected[2 * c + 1]) ? 1 : 0;
      } else {
        digests[2 * c] = digest_lo(d);
        digests[2 * c + 1] = digest_hi(d);
        nonfinite[c] = static_cast<int32_t>(r.count);
        max_abs[c] = Check::to_float(r.max_key);
      }
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
};

template <class Check, bool kVerify>
cudaError_t launch(const Args& a, int threads, int blocks, cudaStream_t stream) {
  const bool aligned = reinterpret_cast<uintptr_t>(a.data) % 16 == 0;
  auto kernel = aligned ? scan_kernel<Check, kVerify, true> : scan_kernel<Check, kVerify, false>;
  kernel<<<blocks, threads, 0, stream>>>(a.data, a.nbytes, a.chunk_bytes, a.nchunks, a.digests,
                                         a.nonfinite, a.max_abs, a.expected, a.mismatch);
  PIMHBM_CUDA_RETURN_LAUNCH_ERROR();
  return cudaSuccess;
}

// Threads per block: enough for kUnroll vectors each, a whole number of warps, at most 256.
int default_threads(int64_t chunk_bytes) {
  int64_t want = (chunk_bytes / 16 + kUnroll - 1) / kUnroll;
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
                             cudaStream_t stream, LaunchShape shape) {
  Args a{static_cast<const uint8_t*>(data), nbytes, chunk_bytes,
         num_chunks(nbytes, chunk_bytes), digests, nonfinite, max_abs, nullptr, nullptr};
  return run(a, elem, /*verify=*/false, shape, stream);
}

cudaError_t scan_cuda(const void* data, int64_t nbytes, Elem elem, int64_t chunk_bytes,
                      uint32_t* digests, int32_t* nonfinite, float* max_abs,
                      cudaStream_t stream) {
  return scan_cuda_shaped(data, nbytes, elem, chunk_bytes, digests, nonfinite, max_abs, stream,
                          LaunchShape{});
}

cudaError_t verify_cuda(const void* data, int64_t nbytes, int64_t chunk_bytes,
                        const uint32_t* expected, uint8_t* mismatch, cudaStream_t stream) {
  Args a{static_cast<const uint8_t*>(data), nbytes, chunk_bytes,
         num_chunks(nbytes, chunk_bytes), nullptr, nullptr, nullptr, expected, mismatch};
  return run(a, Elem::kRaw, /*verify=*/true, LaunchShape{}, stream);
}

}  // namespace pimhbm::scan
