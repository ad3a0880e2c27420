// Streams of our own beside XLA's, one a device, each ordered by two events: `ready` marks XLA's
// stream where the side work begins, `done` the side stream after the last work handed to it.
// The work of one side stream runs in the order it was handed over, so waiting for `done` is
// waiting for all of it. The snapshot copies use one set (backup/snapshot.cc). A side stream
// has the default priority, the lowest, as XLA's own stream has: a kernel on it is not held back
// for XLA's (bench/NOTES.md, "The checks per leaf timed").
#pragma once

#if defined(PIMHBM_WITH_CUDA)
#include <cuda_runtime_api.h>

#include <map>
#include <mutex>

#include "pimhbm/cuda_check.h"

namespace pimhbm::ffi_util {

struct SideStream {
  cudaStream_t stream = nullptr;
  cudaEvent_t ready = nullptr, done = nullptr;

  // What goes on the side stream next runs after XLA's work enqueued so far.
  cudaError_t follow(cudaStream_t xla_stream) const {
    PIMHBM_CUDA_RETURN_IF_ERROR(cudaEventRecord(ready, xla_stream));
    return cudaStreamWaitEvent(stream, ready, 0);
  }
  // Marks the end of the work handed over so far.
  cudaError_t mark_done() const { return cudaEventRecord(done, stream); }
  // XLA's work enqueued next runs after that work.
  cudaError_t join(cudaStream_t xla_stream) const {
    return cudaStreamWaitEvent(xla_stream, done, 0);
  }
};

// One SideStream a device, made on first use and never removed (so a reference to one stays
// good after the set's lock is released: `use` runs without it, as a copy may take a while).
class SideStreams {
 public:
  // `use(side)` with the current device's side stream (made now if it is not there yet).
  template <typename Use>
  cudaError_t on_current_device(Use use) {
    int dev;
    PIMHBM_CUDA_RETURN_IF_ERROR(cudaGetDevice(&dev));
    SideStream* s;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      s = &by_device_[dev];
      if (s->stream == nullptr) {
        PIMHBM_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&s->stream, cudaStreamNonBlocking));
        PIMHBM_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&s->ready, cudaEventDisableTiming));
        PIMHBM_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&s->done, cudaEventDisableTiming));
      }
    }
    return use(*s);
  }
  // `use(side)` with the current device's side stream where it has one (else nothing to do).
  template <typename Use>
  cudaError_t if_on_current_device(Use use) {
    int dev;
    PIMHBM_CUDA_RETURN_IF_ERROR(cudaGetDevice(&dev));
    SideStream* s = nullptr;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      const auto it = by_device_.find(dev);
      if (it != by_device_.end()) s = &it->second;
    }
    return s == nullptr ? cudaSuccess : use(*s);
  }
  // `use(side)` with every device's, under the set's lock, until one returns other than
  // cudaSuccess (that value is returned).
  template <typename Use>
  cudaError_t each(Use use) {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& [dev, s] : by_device_) PIMHBM_CUDA_RETURN_IF_ERROR(use(s));
    return cudaSuccess;
  }

 private:
  std::mutex mutex_;
  std::map<int, SideStream> by_device_;
};

}  // namespace pimhbm::ffi_util

#endif  // PIMHBM_WITH_CUDA
