#include "peer/ipc.h"

#include <chrono>
#include <cstring>
#include <map>
#include <mutex>
#include <stdexcept>
#include <thread>

#include "repair/repair.h"

#if defined(PIMHBM_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace pimhbm::peer::ipc {

#if defined(PIMHBM_WITH_CUDA)
namespace {

[[noreturn]] void fail(const std::string& what, cudaError_t err) {
  cudaGetLastError();  // clear the sticky-free error state for the next call
  throw std::runtime_error("pimhbm IPC pull: " + what + ": " + cudaGetErrorString(err));
}

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) fail(what, err);
}

// The same for what makes IPC unusable here (the caller takes another transport).
[[noreturn]] void unavailable(const std::string& what, cudaError_t err) {
  cudaGetLastError();
  throw Unavailable("pimhbm IPC pull: " + what + " (" + cudaGetErrorString(err) + ")");
}

// Makes `device` current for this thread. The previous device is not put back: in a thread
// without a context that would be device 0, and setting it would create a context there.
void use_device(int device) {
  if (cudaError_t err = cudaSetDevice(device); err != cudaSuccess) {
    unavailable("no usable CUDA device " + std::to_string(device), err);
  }
}

// cuMemGetAddressRange through the runtime's driver entry point (nothing links libcuda).
using GetAddressRange = int (*)(unsigned long long* base, size_t* size, unsigned long long ptr);

GetAddressRange address_range_fn() {
  static GetAddressRange fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult found{};
#if CUDART_VERSION >= 12050
    const cudaError_t err = cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &p, 12000,
                                                             cudaEnableDefault, &found);
#else
    const cudaError_t err =
        cudaGetDriverEntryPoint("cuMemGetAddressRange", &p, cudaEnableDefault, &found);
#endif
    if (err != cudaSuccess || found != cudaDriverEntryPointSuccess || p == nullptr) {
      cudaGetLastError();
      throw Unavailable("pimhbm IPC pull: the driver has no cuMemGetAddressRange");
    }
    return reinterpret_cast<GetAddressRange>(p);
  }();
  return fn;
}

std::mutex mu;
std::map<std::string, void*> opened;  // (device, handle) -> mapped base of a peer allocation
std::map<int, cudaStream_t> streams;  // per device: the stream pulls run on

void* open_export(const std::string& blob, int device) {
  if (blob.size() != kExportBytes) {
    throw std::runtime_error("pimhbm IPC pull: an export is " + std::to_string(kExportBytes) +
                             " bytes, got " + std::to_string(blob.size()));
  }
  const std::string key = std::to_string(device) + ":" + blob.substr(0, 64);
  auto it = opened.find(key);
  if (it == opened.end()) {
    cudaIpcMemHandle_t handle;
    std::memcpy(&handle, blob.data(), sizeof(handle));
    void* base = nullptr;
    if (cudaError_t err = cudaIpcOpenMemHandle(&base, handle, cudaIpcMemLazyEnablePeerAccess);
        err != cudaSuccess) {
      unavailable("the peer's memory cannot be mapped here (cudaIpcOpenMemHandle)", err);
    }
    it = opened.emplace(key, base).first;
  }
  uint64_t offset = 0;
  std::memcpy(&offset, blob.data() + 64, sizeof(offset));
  return static_cast<uint8_t*>(it->second) + offset;
}

// Device memory for the list of chunks and their statuses, kept between pulls (an allocation
// or a free per pull would synchronise the device).
struct Scratch {
  void* chunks = nullptr;
  void* status = nullptr;
  size_t bytes = 0;
};
std::map<int, Scratch> scratches;

Scratch& scratch_of(int device, size_t bytes) {
  Scratch& s = scratches[device];
  if (s.bytes < bytes) {
    if (s.chunks) cudaFree(s.chunks);
    if (s.status) cudaFree(s.status);
    s = Scratch{};
    check(cudaMalloc(&s.chunks, bytes), "cudaMalloc");
    check(cudaMalloc(&s.status, bytes), "cudaMalloc");
    s.bytes = bytes;
  }
  return s;
}

cudaStream_t stream_of(int device) {
  auto it = streams.find(device);
  if (it == streams.end()) {
    cudaStream_t s = nullptr;
    check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
    it = streams.emplace(device, s).first;
  }
  return it->second;
}

}  // namespace

std::string export_pointer(uint64_t ptr, int device) {
  std::lock_guard<std::mutex> lock(mu);
  use_device(device);
  unsigned long long base = 0;
  size_t size = 0;
  if (int r = address_range_fn()(&base, &size, ptr); r != 0) {
    throw Unavailable("pimhbm IPC pull: cuMemGetAddressRange failed (CUresult " +
                      std::to_string(r) + "): not device memory of this process");
  }
  cudaIpcMemHandle_t handle;
  if (cudaError_t err = cudaIpcGetMemHandle(&handle, reinterpret_cast<void*>(base));
      err != cudaSuccess) {
    unavailable(
        "this allocator's memory cannot be shared between processes "
        "(cudaIpcGetMemHandle)",
        err);
  }
  std::string blob(kExportBytes, '\0');
  const uint64_t offset = ptr - base;
  std::memcpy(blob.data(), &handle, sizeof(handle));
  std::memcpy(blob.data() + 64, &offset, sizeof(offset));
  return blob;
}

std::vector<int32_t> pull(int device, const std::vector<int32_t>& chunks, uint64_t dst,
                          uint64_t dst_table, int64_t nbytes, int64_t chunk_bytes,
                          const std::string& src, const std::string& src_table,
                          int64_t timeout_ms) {
  if (chunk_bytes <= 0 || nbytes < 0) {
    throw std::runtime_error("pimhbm IPC pull: chunk_bytes must be positive, nbytes >= 0");
  }
  std::vector<int32_t> status(chunks.size(), repair::kNotListed);
  if (chunks.empty()) return status;
  std::lock_guard<std::mutex> lock(mu);
  use_device(device);
  repair::Sources sources{};
  sources.count = 1;
  sources.self = -1;
  sources.which = nullptr;
  sources.tensor[0] = {static_cast<const uint8_t*>(open_export(src, device)), nbytes, chunk_bytes,
                       static_cast<const uint32_t*>(open_export(src_table, device))};
  const repair::MutableChunkedTensor target{reinterpret_cast<uint8_t*>(dst), nbytes, chunk_bytes,
                                            reinterpret_cast<uint32_t*>(dst_table)};
  const size_t bytes = chunks.size() * sizeof(int32_t);
  Scratch& scratch = scratch_of(device, bytes);
  auto* d_chunks = static_cast<int32_t*>(scratch.chunks);
  auto* d_status = static_cast<int32_t*>(scratch.status);
  cudaStream_t stream = stream_of(device);
  cudaEvent_t done = nullptr;
  check(cudaEventCreateWithFlags(&done, cudaEventDisableTiming), "cudaEventCreate");
  check(cudaMemcpyAsync(d_chunks, chunks.data(), bytes, cudaMemcpyHostToDevice, stream),
        "cudaMemcpyAsync");
  check(repair::repair_from_cuda(d_chunks, static_cast<int64_t>(chunks.size()), sources, target,
                                 d_status, stream),
        "the pull kernel");
  check(cudaEventRecord(done, stream), "cudaEventRecord");
  // Bounded wait: poll, never block on the peer's memory without a deadline.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  cudaError_t state;
  while ((state = cudaEventQuery(done)) == cudaErrorNotReady) {
    if (std::chrono::steady_clock::now() > deadline) {
      // The kernel may still run: its scratch is abandoned (never freed under it), and the
      // caller must not trust or free the target.
      scratch = Scratch{};
      throw std::runtime_error("pimhbm IPC pull: the pull did not finish within " +
                               std::to_string(timeout_ms) + " ms");
    }
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  check(state, "the pull kernel");
  check(cudaMemcpy(status.data(), d_status, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy");
  cudaEventDestroy(done);
  return status;
}

void close_all() {
  std::lock_guard<std::mutex> lock(mu);
  for (auto& [key, base] : opened) {
    const int device = std::stoi(key.substr(0, key.find(':')));
    if (cudaSetDevice(device) == cudaSuccess) cudaIpcCloseMemHandle(base);
  }
  opened.clear();
  cudaGetLastError();
}

#else  // no CUDA

namespace {
[[noreturn]] void no_cuda() {
  throw Unavailable("pimhbm IPC pull: this build has no CUDA (CUDA IPC needs GPUs)");
}
}  // namespace

std::string export_pointer(uint64_t, int) { no_cuda(); }

std::vector<int32_t> pull(int, const std::vector<int32_t>&, uint64_t, uint64_t, int64_t, int64_t,
                          const std::string&, const std::string&, int64_t) {
  no_cuda();
}

void close_all() {}

#endif

}  // namespace pimhbm::peer::ipc
