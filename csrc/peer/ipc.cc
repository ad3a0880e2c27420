#include "peer/ipc.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <utility>

#include "pimhbm/cuda_driver.h"
#include "pimhbm/digest.h"
#include "repair/repair.h"

#if defined(PIMHBM_WITH_CUDA)
#include <cuda.h>  // the driver API's types only: its functions come through the runtime
#include <cuda_runtime_api.h>
#include <unistd.h>

#include "peer/fd_passing.h"
#endif

namespace pimhbm::peer::ipc {

#if defined(PIMHBM_WITH_CUDA)
namespace {

[[noreturn]] void fail(const std::string& what, cudaError_t err) {
  (void)cudaGetLastError();  // clear the sticky-free error state for the next call
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

// The driver functions used here, through the runtime's driver entry point (nothing links
// libcuda); a driver without one of them makes IPC unavailable.
template <class Fn>
Fn driver_fn(const char* name) {
  if (Fn fn = cuda_driver_fn<Fn>(name)) return fn;
  throw Unavailable(std::string("pimhbm IPC pull: the driver has no ") + name);
}

struct Driver {
  decltype(&cuMemGetAddressRange) address_range =
      driver_fn<decltype(address_range)>("cuMemGetAddressRange");
  decltype(&cuMemRetainAllocationHandle) retain =
      driver_fn<decltype(retain)>("cuMemRetainAllocationHandle");
  decltype(&cuMemExportToShareableHandle) export_handle =
      driver_fn<decltype(export_handle)>("cuMemExportToShareableHandle");
  decltype(&cuMemImportFromShareableHandle) import_handle =
      driver_fn<decltype(import_handle)>("cuMemImportFromShareableHandle");
  decltype(&cuMemRelease) release = driver_fn<decltype(release)>("cuMemRelease");
  decltype(&cuMemAddressReserve) reserve = driver_fn<decltype(reserve)>("cuMemAddressReserve");
  decltype(&cuMemAddressFree) address_free = driver_fn<decltype(address_free)>("cuMemAddressFree");
  decltype(&cuMemMap) map = driver_fn<decltype(map)>("cuMemMap");
  decltype(&cuMemUnmap) unmap = driver_fn<decltype(unmap)>("cuMemUnmap");
  decltype(&cuMemSetAccess) set_access = driver_fn<decltype(set_access)>("cuMemSetAccess");
};

const Driver& driver() {
  static const Driver d;  // a throw leaves it unset: the next call tries again
  return d;
}

[[noreturn]] void unavailable_cu(const std::string& what, CUresult r) {
  throw Unavailable("pimhbm IPC pull: " + what + " (CUresult " + std::to_string(r) + ")");
}

std::mutex mu;
// (allocation base, size) -> the descriptor peers take, and its ticket. XLA's allocator keeps
// its allocation for the process's life; one freed and made again at the same base with the
// same size would be sent with the old descriptor (close_all forgets them).
struct Offered {
  int fd;
  fd_passing::Ticket ticket;
};
std::map<std::pair<uint64_t, uint64_t>, Offered> exported;
struct Mapping {
  void* base;
  uint32_t kind;
  uint64_t size;
};
std::map<std::string, Mapping> opened;  // (device, export) -> a peer allocation mapped here
std::map<int, cudaStream_t> streams;    // per device: the stream pulls run on

// How another process takes a descriptor of the virtual-memory allocation at `base`.
fd_passing::Ticket ticket_of(uint64_t base, uint64_t size) {
  if (auto it = exported.find({base, size}); it != exported.end()) return it->second.ticket;
  const Driver& d = driver();
  CUmemGenericAllocationHandle h{};
  if (CUresult r = d.retain(&h, reinterpret_cast<void*>(base)); r != CUDA_SUCCESS) {
    unavailable_cu(
        "this memory has neither a CUDA IPC handle nor a virtual-memory allocation "
        "handle",
        r);
  }
  int fd = -1;
  const CUresult r = d.export_handle(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
  d.release(h);  // the retain's reference; the allocation lives on in its owner
  if (r != CUDA_SUCCESS) {
    unavailable_cu("this allocation was not created shareable as a file descriptor", r);
  }
  fd_passing::Ticket ticket;
  try {
    ticket = fd_passing::offer(fd);
  } catch (const std::exception& err) {
    close(fd);
    throw Unavailable(std::string("pimhbm IPC pull: ") + err.what());
  }
  exported.emplace(std::make_pair(base, size), Offered{fd, ticket});
  return ticket;
}

// Maps a peer's virtual-memory allocation (its descriptor handed over by the exporting
// process) into this process's address space, readable by `device`.
void* map_descriptor(const Export& e, int device, int timeout_ms) {
  fd_passing::Ticket ticket;
  std::memcpy(&ticket, e.handle, sizeof(ticket));
  ticket.socket[sizeof(ticket.socket) - 1] = '\0';  // read from another process: terminated here
  int fd;
  try {
    fd = fd_passing::take(ticket, e.pid, timeout_ms);
  } catch (const fd_passing::Refused& err) {
    throw Unavailable(std::string("pimhbm IPC pull: ") + err.what());
  }
  const Driver& d = driver();
  CUmemGenericAllocationHandle h{};
  CUresult r = d.import_handle(&h, reinterpret_cast<void*>(static_cast<intptr_t>(fd)),
                               CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
  close(fd);
  if (r != CUDA_SUCCESS) unavailable_cu("the peer's allocation cannot be imported", r);
  CUdeviceptr va = 0;
  if (r = d.reserve(&va, e.size, 0, 0, 0); r != CUDA_SUCCESS) {
    d.release(h);
    unavailable_cu("no address range for the peer's allocation", r);
  }
  r = d.map(va, e.size, 0, h, 0);
  d.release(h);  // the mapping holds the allocation from here on
  if (r != CUDA_SUCCESS) {
    d.address_free(va, e.size);
    unavailable_cu("the peer's allocation cannot be mapped here", r);
  }
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = device;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READ;  // a pull only reads the healthy replica
  if (r = d.set_access(va, e.size, &access, 1); r != CUDA_SUCCESS) {
    d.unmap(va, e.size);
    d.address_free(va, e.size);
    unavailable_cu("device " + std::to_string(device) + " may not read the peer's allocation", r);
  }
  return reinterpret_cast<void*>(va);
}

// The peer memory an export names, mapped here; `bytes` from it must lie in its allocation.
void* open_export(const std::string& blob, int device, uint64_t bytes, int timeout_ms) {
  if (blob.size() != kExportBytes) {
    throw std::runtime_error("pimhbm IPC pull: an export is " + std::to_string(kExportBytes) +
                             " bytes, got " + std::to_string(blob.size()));
  }
  Export e;
  std::memcpy(&e, blob.data(), sizeof(e));
  // The allocation, without the pointer's offset in it.
  const std::string key = std::to_string(device) + ":" + blob.substr(0, offsetof(Export, offset)) +
                          blob.substr(offsetof(Export, handle));
  auto it = opened.find(key);
  if (it == opened.end()) {
    void* base = nullptr;
    if (e.kind == kLegacyHandle) {
      cudaIpcMemHandle_t handle;
      std::memcpy(&handle, e.handle, sizeof(handle));
      if (cudaError_t err = cudaIpcOpenMemHandle(&base, handle, cudaIpcMemLazyEnablePeerAccess);
          err != cudaSuccess) {
        unavailable("the peer's memory cannot be mapped here (cudaIpcOpenMemHandle)", err);
      }
    } else if (e.kind == kFileDescriptor) {
      base = map_descriptor(e, device, timeout_ms);
    } else {
      throw std::runtime_error("pimhbm IPC pull: an export of unknown kind " +
                               std::to_string(e.kind));
    }
    it = opened.emplace(key, Mapping{base, e.kind, e.size}).first;
  }
  if (e.offset > e.size || bytes > e.size - e.offset) {
    // An allocator that maps several allocations side by side can place a buffer across two:
    // this transport maps one, so such a buffer is for another transport.
    throw Unavailable("pimhbm IPC pull: " + std::to_string(bytes) + " bytes at offset " +
                      std::to_string(e.offset) + " lie outside the peer's allocation of " +
                      std::to_string(e.size) + " bytes");
  }
  return static_cast<uint8_t*>(it->second.base) + e.offset;
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
    if (s.chunks) check(cudaFree(s.chunks), "cudaFree");
    if (s.status) check(cudaFree(s.status), "cudaFree");
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
  CUdeviceptr base = 0;
  size_t size = 0;
  if (CUresult r = driver().address_range(&base, &size, ptr); r != CUDA_SUCCESS) {
    unavailable_cu("cuMemGetAddressRange failed: not device memory of this process", r);
  }
  Export e{};
  e.size = size;
  e.offset = ptr - base;
  cudaIpcMemHandle_t handle;
  if (cudaIpcGetMemHandle(&handle, reinterpret_cast<void*>(base)) == cudaSuccess) {
    e.kind = kLegacyHandle;
    std::memcpy(e.handle, &handle, sizeof(handle));
  } else {  // memory from cuMemCreate (XLA's allocator): its descriptor
    cudaGetLastError();
    e.kind = kFileDescriptor;
    e.pid = static_cast<int32_t>(getpid());
    const fd_passing::Ticket ticket = ticket_of(base, size);
    std::memcpy(e.handle, &ticket, sizeof(ticket));
  }
  std::string blob(kExportBytes, '\0');
  std::memcpy(blob.data(), &e, sizeof(e));
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
  // Each exchange of a descriptor hand-off is bounded too.
  const int wait_ms = static_cast<int>(std::clamp<int64_t>(timeout_ms, 1, 600000));
  repair::Sources sources{};
  sources.count = 1;
  sources.self = -1;
  sources.which = nullptr;
  const auto table_bytes = static_cast<uint64_t>(num_chunks(nbytes, chunk_bytes)) * 8;
  sources.tensor[0] = {
      static_cast<const uint8_t*>(open_export(src, device, static_cast<uint64_t>(nbytes), wait_ms)),
      nbytes, chunk_bytes,
      static_cast<const uint32_t*>(open_export(src_table, device, table_bytes, wait_ms))};
  const repair::MutableChunkedTensor target{reinterpret_cast<uint8_t*>(dst), nbytes, chunk_bytes,
                                            reinterpret_cast<uint32_t*>(dst_table)};
  const size_t bytes = chunks.size() * sizeof(int32_t);
  Scratch& scratch = scratch_of(device, bytes);
  auto* d_chunks = static_cast<int32_t*>(scratch.chunks);
  auto* d_status = static_cast<int32_t*>(scratch.status);
  cudaStream_t stream = stream_of(device);
  cudaEvent_t done = nullptr;
  check(cudaEventCreateWithFlags(&done, cudaEventDisableTiming), "cudaEventCreate");
  // Destroyed on every way out (an event not yet complete is released once it completes).
  const std::unique_ptr<CUevent_st, decltype(&cudaEventDestroy)> done_guard(done, cudaEventDestroy);
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
  return status;
}

// Best effort, as teardown goes: a mapping that cannot be closed (its device gone) is left to
// the process's exit; the errors are cleared at the end.
void close_all() {
  std::lock_guard<std::mutex> lock(mu);
  for (auto& [key, m] : opened) {
    const int device = std::stoi(key.substr(0, key.find(':')));
    if (cudaSetDevice(device) != cudaSuccess) continue;
    if (m.kind == kLegacyHandle) {
      (void)cudaIpcCloseMemHandle(m.base);
    } else {
      const Driver& d = driver();
      (void)d.unmap(reinterpret_cast<CUdeviceptr>(m.base), m.size);
      (void)d.address_free(reinterpret_cast<CUdeviceptr>(m.base), m.size);
    }
  }
  opened.clear();
  fd_passing::withdraw_all();  // no peer takes a descriptor from here on
  for (auto& [allocation, offered] : exported) close(offered.fd);
  exported.clear();
  (void)cudaGetLastError();
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
