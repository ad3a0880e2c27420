// Repair from a replica in another process: a one-sided pull over CUDA IPC. The healthy
// process exports a handle for the allocation that holds its copy of a tensor (and of its
// digest table); the damaged process opens it once (cached) and runs the chunk-repair kernel
// on its own stream, reading the peer GPU's memory directly -- no NCCL call, no kernel on the
// healthy GPU. Every wait is bounded: a pull that does not finish in time is an error.
//
// Built without CUDA, every call fails with a message that says so (the engine then keeps
// its collective transport).
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace pimhbm::peer::ipc {

// This memory cannot be pulled over CUDA IPC here (no CUDA, an allocation without an IPC
// handle, a peer allocation that cannot be mapped into this process): the caller should use
// another transport. Every other failure is a std::runtime_error.
class Unavailable : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A device pointer made shareable: how another process maps the allocation it lies in, and
// the pointer's offset from that allocation's base (XLA hands out pieces of larger
// allocations). Memory from cudaMalloc/cuMemAlloc travels as a CUDA IPC handle; memory from the
// virtual memory management API (cuMemCreate, which XLA's allocator uses) as a POSIX file
// descriptor of the allocation, which this process hands to the puller over a Unix socket
// (peer/fd_passing.h: each side checks the other's credentials).
struct Export {
  uint32_t kind;  // kLegacyHandle or kFileDescriptor
  int32_t pid;    // the exporting process (kFileDescriptor: the socket's peer must be it)
  uint64_t reserved;
  uint64_t size;    // of the allocation
  uint64_t offset;  // of the pointer in it
  char handle[64];  // kLegacyHandle: the cudaIpcMemHandle_t; kFileDescriptor: a Ticket
};
constexpr uint32_t kLegacyHandle = 1, kFileDescriptor = 2;
constexpr size_t kExportBytes = sizeof(Export);
static_assert(kExportBytes == 96, "an export's layout is part of the protocol between processes");

// The export of `ptr` (device memory of CUDA device `device`), kExportBytes long. Throws
// Unavailable when the memory cannot be shared between processes.
std::string export_pointer(uint64_t ptr, int device);

// Repairs the listed chunks of this process's tensor (dst, dst_table: device pointers on
// `device`, nbytes long, chunk_bytes per chunk) from another process's copy (src, src_table:
// exports from that process); returns a repair::Status per entry. Throws Unavailable when
// the peer's memory cannot be mapped here, std::runtime_error on a CUDA error or when the pull
// has not finished after timeout_ms (its kernel may then still run: this process's target
// memory is not to be trusted or freed).
std::vector<int32_t> pull(int device, const std::vector<int32_t>& chunks, uint64_t dst,
                          uint64_t dst_table, int64_t nbytes, int64_t chunk_bytes,
                          const std::string& src, const std::string& src_table, int64_t timeout_ms);

// Unmaps every peer allocation this process mapped, and closes the descriptors it exported
// (a peer's memory stays mapped until then).
void close_all();

}  // namespace pimhbm::peer::ipc
