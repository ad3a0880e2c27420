// Helpers for the CUDA tests: checked device buffers, and a skip when there is no GPU.
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>
#include <vector>

namespace pimhbm::testing {

#define PIMHBM_ASSERT_CUDA(expr)                                               \
  do {                                                                         \
    cudaError_t err_ = (expr);                                                 \
    ASSERT_EQ(err_, cudaSuccess) << #expr << ": " << cudaGetErrorString(err_); \
  } while (0)

// Where a GPU must be there (scripts/gpu-check sets PIMHBM_REQUIRE_GPU=1 on the GPU machine), a
// missing one fails a GPU test instead of skipping it: a GPU stage cannot pass with every test
// skipped.
inline bool gpu_required() { return std::getenv("PIMHBM_REQUIRE_GPU") != nullptr; }

#define PIMHBM_SKIP_WITHOUT_GPU()                                      \
  do {                                                                 \
    int count_ = 0;                                                    \
    if (cudaGetDeviceCount(&count_) != cudaSuccess || count_ == 0) {   \
      cudaGetLastError();                                              \
      if (pimhbm::testing::gpu_required()) FAIL() << "no CUDA device"; \
      GTEST_SKIP() << "no CUDA device";                                \
    }                                                                  \
  } while (0)

// Whether device 0 is sm_90 (Hopper): the wgmma code's tests skip elsewhere.
inline bool has_sm90() {
  int count = 0, major = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    cudaGetLastError();  // no device: not an error of a later call
    return false;
  }
  return cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0) == cudaSuccess &&
         major == 9;
}

#define PIMHBM_SKIP_WITHOUT_SM90()                                                   \
  do {                                                                               \
    if (!pimhbm::testing::has_sm90()) {                                              \
      if (pimhbm::testing::gpu_required()) FAIL() << "device 0 is not an sm_90 GPU"; \
      GTEST_SKIP() << "needs an sm_90 GPU";                                          \
    }                                                                                \
  } while (0)

// dst = the device buffer's values; a failed copy fails the test.
#define PIMHBM_ASSERT_DOWNLOAD(dst, buffer)  \
  do {                                       \
    cudaError_t download_err_ = cudaSuccess; \
    dst = (buffer).download(&download_err_); \
    PIMHBM_ASSERT_CUDA(download_err_);       \
  } while (0)

// Sizes shrink under compute-sanitizer (PIMHBM_TEST_SMALL=1), which runs kernels ~100x slower.
inline bool small_sizes() { return std::getenv("PIMHBM_TEST_SMALL") != nullptr; }

template <typename T>
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t count) : count_(count) {
    if (count_ > 0 && cudaMalloc(&ptr_, count_ * sizeof(T)) != cudaSuccess) {
      ptr_ = nullptr;
      ADD_FAILURE() << "cudaMalloc of " << count_ * sizeof(T) << " bytes failed";
    }
  }
  ~DeviceBuffer() {
    if (ptr_) cudaFree(ptr_);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  T* get() const { return static_cast<T*>(ptr_); }
  size_t bytes() const { return count_ * sizeof(T); }

  cudaError_t upload(const std::vector<T>& host) {
    return count_ ? cudaMemcpy(ptr_, host.data(), bytes(), cudaMemcpyHostToDevice) : cudaSuccess;
  }
  // Fills with `byte` so that an output a kernel never wrote shows up in the comparison.
  cudaError_t poison(int byte = 0xFF) {
    return count_ ? cudaMemset(ptr_, byte, bytes()) : cudaSuccess;
  }
  std::vector<T> download(cudaError_t* err) const {
    std::vector<T> host(count_);
    *err = count_ ? cudaMemcpy(host.data(), ptr_, bytes(), cudaMemcpyDeviceToHost) : cudaSuccess;
    return host;
  }

 private:
  void* ptr_ = nullptr;
  size_t count_;
};

}  // namespace pimhbm::testing
