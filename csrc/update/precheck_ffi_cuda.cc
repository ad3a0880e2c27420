// The CUDA launches of the checks before the in-place update: pimhbm_inplace_precheck's kernel
// on XLA's stream; pimhbm_inplace_precheck_begin's on a side stream of the device, and
// pimhbm_inplace_precheck_end's wait for it.
#include <map>
#include <mutex>

#include "pimhbm/cuda_check.h"
#include "pimhbm/ffi_error.h"
#include "update/precheck_ffi.h"

namespace pimhbm::update {

ffi::Error launch(const ffi_util::OnCuda& on, const PrecheckCall& c) {
  return ffi_util::cuda_status("pimhbm.inplace_precheck",
                               precheck_cuda(c.leaves.data(), c.leaves.size(), on.stream));
}

namespace {

// One side stream a device, and two events: `ready` marks XLA's stream where a check begins,
// `done` the side stream after the last check begun. The checks of a device run in the order
// they began, so waiting for the last is waiting for all.
struct Beside {
  cudaStream_t stream = nullptr;
  cudaEvent_t ready = nullptr, done = nullptr;
};
std::mutex beside_mutex;
std::map<int, Beside>& beside() {
  static auto* m = new std::map<int, Beside>();  // never destroyed: used at exit
  return *m;
}

// This device's side stream (made on first use); the caller holds beside_mutex.
cudaError_t beside_current_device(Beside** out) {
  int dev;
  PIMHBM_CUDA_RETURN_IF_ERROR(cudaGetDevice(&dev));
  Beside& b = beside()[dev];
  if (b.stream == nullptr) {
    int lowest, highest;
    PIMHBM_CUDA_RETURN_IF_ERROR(cudaDeviceGetStreamPriorityRange(&lowest, &highest));
    PIMHBM_CUDA_RETURN_IF_ERROR(
        cudaStreamCreateWithPriority(&b.stream, cudaStreamNonBlocking, lowest));
    PIMHBM_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&b.ready, cudaEventDisableTiming));
    PIMHBM_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&b.done, cudaEventDisableTiming));
  }
  *out = &b;
  return cudaSuccess;
}

cudaError_t begin(cudaStream_t xla_stream, const PrecheckCall& c) {
  std::lock_guard<std::mutex> lock(beside_mutex);
  Beside* b;
  PIMHBM_CUDA_RETURN_IF_ERROR(beside_current_device(&b));
  PIMHBM_CUDA_RETURN_IF_ERROR(cudaEventRecord(b->ready, xla_stream));
  PIMHBM_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(b->stream, b->ready, 0));
  PIMHBM_CUDA_RETURN_IF_ERROR(precheck_cuda(c.leaves.data(), c.leaves.size(), b->stream));
  return cudaEventRecord(b->done, b->stream);
}

// XLA's stream waits for this device's checks (none begun: nothing to wait for).
cudaError_t end(cudaStream_t xla_stream) {
  int dev;
  PIMHBM_CUDA_RETURN_IF_ERROR(cudaGetDevice(&dev));
  std::lock_guard<std::mutex> lock(beside_mutex);
  const auto it = beside().find(dev);
  if (it == beside().end()) return cudaSuccess;
  return cudaStreamWaitEvent(xla_stream, it->second.done, 0);
}

}  // namespace

ffi::Error launch(const ffi_util::OnCuda& on, const BesideCall& c) {
  return ffi_util::cuda_status("pimhbm.inplace_precheck_begin", begin(on.stream, c.checks));
}

ffi::Error launch(const ffi_util::OnCuda& on, const EndOfChecks&) {
  return ffi_util::cuda_status("pimhbm.inplace_precheck_end", end(on.stream));
}

}  // namespace pimhbm::update
