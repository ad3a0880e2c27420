// Hopper's warpgroup products (wgmma) as the attention kernels use them: one warpgroup (four
// warps, 128 threads) computes a 64 x N fp32 tile, N = 64 or 128, from bf16 operands, k = 16 a
// step. Accumulators are float[N / 8][4] a thread, in the layout of attention_device.cuh for
// each warp's 16 rows (warp w of the group holds rows 16 w .. 16 w + 15).
//
// Shared-memory operands are described by 64-bit descriptors: the start address and two strides
// between core matrices (8 rows x 16 bytes, 128 contiguous bytes each), with or without the
// 128-byte swizzle. The roles of the two strides without it were measured on the H200 by
// csrc/tests/wgmma_probe_test.cu: for a K-major operand LBO is the step along K and SBO the step
// along M or N; for an MN-major (transposed) operand, LBO is the step along K and SBO the step
// along N. With the swizzle (rows of 128 bytes, groups of 8 rows 1024 bytes, each 1024-byte
// aligned), after CUTLASS's canonical layouts: K-major, SBO is the step between groups of 8
// rows along M or N and LBO is not used (a k-step's 32 bytes lie inside a row; the start address
// moves 32 bytes a step); MN-major, LBO is the step between blocks of 64 columns along N and
// SBO the step between groups of 8 rows along K.
//
// The instructions exist only in sm_90a code: device code for any other target is refused here
// (built for sm_90, the products would compile to nothing and the kernels run to garbage). Build
// with CUDA_ARCHITECTURES 90a (--generate-code=arch=compute_90a,code=...); nvcc's -arch=sm_90a
// shorthand also runs a compute_90 pass, which this refuses.
#pragma once

#include <cstdint>

#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#error "wgmma.cuh: sm_90a device code only (CUDA_ARCHITECTURES 90a)"
#endif

namespace pimhbm::wgmma {

__device__ __forceinline__ uint64_t descriptor(const void* smem, int lbo, int sbo) {
  const uint64_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  return ((addr >> 4) & 0x3FFF) | (static_cast<uint64_t>((lbo >> 4) & 0x3FFF) << 16) |
         (static_cast<uint64_t>((sbo >> 4) & 0x3FFF) << 32);  // swizzle 0 (bits 62-63)
}

// The same with the 128-byte swizzle (mode 1 in bits 62-63); base offset 0: the swizzle's
// 1024-byte groups must be 1024-byte aligned.
__device__ __forceinline__ uint64_t descriptor_swizzled(const void* smem, int lbo, int sbo) {
  return descriptor(smem, lbo, sbo) | (uint64_t{1} << 62);
}

#define PIMHBM_WGMMA_D32                                                              \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, " \
  "%18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define PIMHBM_WGMMA_D64                                                                  \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, "     \
  "%18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, " \
  "%35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, " \
  "%52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define PIMHBM_WGMMA_TILE(x, n) "+f"(x[n][0]), "+f"(x[n][1]), "+f"(x[n][2]), "+f"(x[n][3])
#define PIMHBM_WGMMA_ACC32(x)                                                    \
  PIMHBM_WGMMA_TILE(x, 0), PIMHBM_WGMMA_TILE(x, 1), PIMHBM_WGMMA_TILE(x, 2),     \
      PIMHBM_WGMMA_TILE(x, 3), PIMHBM_WGMMA_TILE(x, 4), PIMHBM_WGMMA_TILE(x, 5), \
      PIMHBM_WGMMA_TILE(x, 6), PIMHBM_WGMMA_TILE(x, 7)
#define PIMHBM_WGMMA_ACC64(x)                                                       \
  PIMHBM_WGMMA_ACC32(x), PIMHBM_WGMMA_TILE(x, 8), PIMHBM_WGMMA_TILE(x, 9),          \
      PIMHBM_WGMMA_TILE(x, 10), PIMHBM_WGMMA_TILE(x, 11), PIMHBM_WGMMA_TILE(x, 12), \
      PIMHBM_WGMMA_TILE(x, 13), PIMHBM_WGMMA_TILE(x, 14), PIMHBM_WGMMA_TILE(x, 15)

// acc (+)= A B^T: A (64 x 16) and B (N x 16) both K-major in shared memory.
template <int N>
__device__ __forceinline__ void mma_ss(float (&acc)[N / 8][4], uint64_t a, uint64_t b,
                                       int accumulate) {
  static_assert(N == 64 || N == 128, "wgmma tiles of 64 or 128 columns");
  if constexpr (N == 64) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " PIMHBM_WGMMA_D32
        ", %32, %33, p, 1, 1, 0, 0;\n}\n"
        : PIMHBM_WGMMA_ACC32(acc)
        : "l"(a), "l"(b), "r"(accumulate));
  } else {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " PIMHBM_WGMMA_D64
        ", %64, %65, p, 1, 1, 0, 0;\n}\n"
        : PIMHBM_WGMMA_ACC64(acc)
        : "l"(a), "l"(b), "r"(accumulate));
  }
}

// acc (+)= A B: A (64 x 16) from registers (each warp's mma.sync A fragment of its 16 rows), B
// (16 x N) MN-major in shared memory.
template <int N>
__device__ __forceinline__ void mma_rs(float (&acc)[N / 8][4], const uint32_t (&a)[4], uint64_t b,
                                       int accumulate) {
  static_assert(N == 64 || N == 128, "wgmma tiles of 64 or 128 columns");
  if constexpr (N == 64) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " PIMHBM_WGMMA_D32
        ", {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
        : PIMHBM_WGMMA_ACC32(acc)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));
  } else {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " PIMHBM_WGMMA_D64
        ", {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
        : PIMHBM_WGMMA_ACC64(acc)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));
  }
}

// Before a group's first product: registers written by ordinary instructions (accumulators
// rescaled, A fragments packed) become visible to the tensor cores.
__device__ __forceinline__ void begin() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}

// Closes the products issued since the last commit into one group.
__device__ __forceinline__ void commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

// Waits until at most `Pending` committed groups are still running.
template <int Pending>
__device__ __forceinline__ void wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(Pending) : "memory");
}

// The accumulators are registers, which no "memory" clobber covers: after wait(), this keeps
// the compiler from moving a read of them above the wait (and before a product, a write below
// it).
template <int N>
__device__ __forceinline__ void fence_operand(float (&acc)[N / 8][4]) {
#pragma unroll
  for (int n = 0; n < N / 8; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(acc[n][e])::"memory");
  }
}

// Shared-memory writes by ordinary stores or cp.async (the generic proxy) become visible to the
// tensor cores' reads (the async proxy); a barrier must follow before another thread's product.
__device__ __forceinline__ void fence_shared_for_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

}  // namespace pimhbm::wgmma

#undef PIMHBM_WGMMA_D32
#undef PIMHBM_WGMMA_D64
#undef PIMHBM_WGMMA_TILE
#undef PIMHBM_WGMMA_ACC32
#undef PIMHBM_WGMMA_ACC64
