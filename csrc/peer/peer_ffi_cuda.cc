// The peer ops on GPUs. Each device's handler runs on the host thread that launches that
// device's work; it publishes its buffers and an event recorded on its stream, makes its
// stream wait for its peers' events (their inputs are ready), launches one kernel that reads
// the peers' memory directly, and then waits -- on the stream, not on the host -- for its
// peers to finish reading before its own stream may go on writing its buffers. No NCCL call;
// only the calling devices' streams take part.
#include <cuda_runtime_api.h>

#include <mutex>
#include <set>
#include <utility>

#include "peer/peer_ffi.h"
#include "pimhbm/ffi_alias_cuda.h"
#include "repair/repair_ffi.h"

namespace pimhbm::peer {
namespace {

std::string cuda_what(const char* call, cudaError_t err) {
  return std::string(call) + ": " + cudaGetErrorString(err);
}

// Peer access from `me` to each peer, enabled once per pair for the process.
std::string enable_peer_access(int me, const int64_t* peers, int size) {
  static std::mutex mu;
  static std::set<std::pair<int, int>> enabled;
  std::lock_guard<std::mutex> lock(mu);
  for (int p = 0; p < size; ++p) {
    const int other = static_cast<int>(peers[p]);
    if (other == me || enabled.count({me, other})) continue;
    int can = 0;
    if (cudaError_t err = cudaDeviceCanAccessPeer(&can, me, other); err != cudaSuccess) {
      return cuda_what("cudaDeviceCanAccessPeer", err);
    }
    if (!can) {
      return "GPU " + std::to_string(me) + " cannot read GPU " + std::to_string(other) +
             "'s memory directly (no peer access between them): use the collective transport";
    }
    cudaError_t err = cudaDeviceEnablePeerAccess(other, 0);
    if (err == cudaErrorPeerAccessAlreadyEnabled) {
      cudaGetLastError();  // clears the sticky "already enabled"
    } else if (err != cudaSuccess) {
      return cuda_what("cudaDeviceEnablePeerAccess", err);
    }
    enabled.insert({me, other});
  }
  return "";
}

// Makes `ordinal` current for the handler's calls and puts the caller's device back after.
class DeviceScope {
 public:
  explicit DeviceScope(int ordinal) {
    error_ = cudaGetDevice(&previous_);
    if (error_ == cudaSuccess && previous_ != ordinal) error_ = cudaSetDevice(ordinal);
  }
  ~DeviceScope() {
    int now = -1;
    if (cudaGetDevice(&now) == cudaSuccess && now != previous_) cudaSetDevice(previous_);
  }
  cudaError_t error() const { return error_; }

 private:
  int previous_ = 0;
  cudaError_t error_;
};

cudaEvent_t event_of(Group* group, int rank, Phase phase, cudaError_t* err) {
  void*& slot = group->event_slot(rank, phase);
  if (!slot) {
    cudaEvent_t e;
    *err = cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
    if (*err != cudaSuccess) return nullptr;
    slot = e;
  }
  return static_cast<cudaEvent_t>(slot);
}

// Publishes `mine` with a ready event, orders `stream` after every peer's, runs `launch`,
// publishes a done event and orders `stream` after every peer's (they finished reading).
template <typename Launch>
ffi::Error meet_and_launch(const char* op, int32_t ordinal, const Member& m, cudaStream_t stream,
                           Payload mine, Launch launch) {
  DeviceScope scope(ordinal);
  if (scope.error() != cudaSuccess)
    return peer_error(op, cuda_what("cudaSetDevice", scope.error()));
  if (std::string e = enable_peer_access(ordinal, m.peers, m.size); !e.empty()) {
    return peer_error(op, e);
  }
  cudaError_t err = cudaSuccess;
  cudaEvent_t ready = event_of(m.group, m.rank, kReady, &err);
  cudaEvent_t done = ready ? event_of(m.group, m.rank, kDone, &err) : nullptr;
  if (!done) return peer_error(op, cuda_what("cudaEventCreateWithFlags", err));
  if ((err = cudaEventRecord(ready, stream)) != cudaSuccess) {
    return peer_error(op, cuda_what("cudaEventRecord", err));
  }
  mine.event = ready;
  std::vector<Payload> all;
  if (std::string e = m.group->exchange(m.rank, kReady, mine, &all, m.timeout); !e.empty()) {
    return peer_error(op, e);
  }
  for (int p = 0; p < m.size && err == cudaSuccess; ++p) {
    if (p != m.rank) err = cudaStreamWaitEvent(stream, static_cast<cudaEvent_t>(all[p].event), 0);
  }
  std::string failed = err != cudaSuccess ? cuda_what("cudaStreamWaitEvent", err) : "";
  if (failed.empty() && (err = launch(all)) != cudaSuccess) failed = cuda_what("launch", err);
  if (failed.empty() && (err = cudaEventRecord(done, stream)) != cudaSuccess) {
    failed = cuda_what("cudaEventRecord", err);
  }
  // The second meeting happens even after a failure: peers must not wait for us in vain.
  std::vector<Payload> finished;
  if (std::string e =
          m.group->exchange(m.rank, kDone, Payload{nullptr, nullptr, done}, &finished, m.timeout);
      !e.empty()) {
    return peer_error(op, e);
  }
  for (int p = 0; p < m.size && failed.empty(); ++p) {
    if (p == m.rank) continue;
    if ((err = cudaStreamWaitEvent(stream, static_cast<cudaEvent_t>(finished[p].event), 0)) !=
        cudaSuccess) {
      failed = cuda_what("cudaStreamWaitEvent", err);
    }
  }
  return failed.empty() ? ffi::Error::Success() : peer_error(op, failed);
}

ffi::Error all_gather_cuda(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x,
                           ffi::Result<ffi::AnyBuffer> out, int64_t tag,
                           ffi::Span<const int64_t> ordinals, int64_t group_size,
                           int64_t timeout_ms) {
  constexpr const char* kOp = "pimhbm.peer.all_gather";
  auto m = member_of(kOp, ordinal, tag, ordinals, group_size, timeout_ms);
  if (m.has_error()) return m.error();
  PIMHBM_FFI_RETURN_IF_ERROR(validate_all_gather(x, *out, m->size));
  return meet_and_launch(
      kOp, ordinal, *m, stream, Payload{x.untyped_data()}, [&](const std::vector<Payload>& all) {
        return copy_segments_cuda(gather_segments(all, static_cast<int64_t>(x.size_bytes())),
                                  static_cast<uint8_t*>(out->untyped_data()), stream);
      });
}

ffi::Error all_to_all_cuda(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x,
                           ffi::Result<ffi::AnyBuffer> out, int64_t tag,
                           ffi::Span<const int64_t> ordinals, int64_t group_size,
                           int64_t timeout_ms) {
  constexpr const char* kOp = "pimhbm.peer.all_to_all";
  auto m = member_of(kOp, ordinal, tag, ordinals, group_size, timeout_ms);
  if (m.has_error()) return m.error();
  PIMHBM_FFI_RETURN_IF_ERROR(validate_all_to_all(x, *out, m->size));
  return meet_and_launch(
      kOp, ordinal, *m, stream, Payload{x.untyped_data()}, [&](const std::vector<Payload>& all) {
        return copy_segments_cuda(
            exchange_segments(all, m->rank, static_cast<int64_t>(x.size_bytes()) / m->size),
            static_cast<uint8_t*>(out->untyped_data()), stream);
      });
}

ffi::Error pull_cuda(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer chunks,
                     ffi::AnyBuffer which, ffi::AnyBuffer x_in, ffi::AnyBuffer table_in,
                     ffi::Result<ffi::AnyBuffer> x, ffi::Result<ffi::AnyBuffer> table,
                     ffi::Result<ffi::AnyBuffer> status, int64_t chunk_bytes, int64_t tag,
                     ffi::Span<const int64_t> ordinals, int64_t group_size, int64_t timeout_ms) {
  constexpr const char* kOp = "pimhbm.peer.pull";
  auto m = member_of(kOp, ordinal, tag, ordinals, group_size, timeout_ms);
  if (m.has_error()) return m.error();
  PIMHBM_FFI_RETURN_IF_ERROR(validate_pull(chunks, which, *x, *table, *status, chunk_bytes));
  // The target starts as the operand where XLA did not alias them (ffi_alias.h), before the
  // peers meet: what they read of this device is its current state.
  PIMHBM_FFI_RETURN_IF_ERROR(ffi_util::cuda_status(
      kOp, ffi_util::copy_unaliased_cuda(ffi_util::unaliased(kOp, {{x_in, *x}, {table_in, *table}}),
                                         stream)));
  Payload mine{x->untyped_data(), table->untyped_data()};
  return meet_and_launch(kOp, ordinal, *m, stream, mine, [&](const std::vector<Payload>& all) {
    return repair::repair_from_cuda(
        static_cast<const int32_t*>(chunks.untyped_data()),
        static_cast<int64_t>(chunks.element_count()),
        pull_sources(all, *m, which, static_cast<int64_t>(x->size_bytes()), chunk_bytes),
        repair::mutable_chunked(*x, *table, chunk_bytes),
        static_cast<int32_t*>(status->untyped_data()), stream);
  });
}

}  // namespace
}  // namespace pimhbm::peer

// Not command-buffer compatible: each call meets its peers on the host.
XLA_FFI_DEFINE_HANDLER_SYMBOL(PimhbmPeerAllGatherCuda, pimhbm::peer::all_gather_cuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<xla::ffi::DeviceOrdinal>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>() PIMHBM_PEER_GROUP_ATTRS);

XLA_FFI_DEFINE_HANDLER_SYMBOL(PimhbmPeerAllToAllCuda, pimhbm::peer::all_to_all_cuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<xla::ffi::DeviceOrdinal>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>() PIMHBM_PEER_GROUP_ATTRS);

XLA_FFI_DEFINE_HANDLER_SYMBOL(PimhbmPeerPullCuda, pimhbm::peer::pull_cuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<xla::ffi::DeviceOrdinal>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Attr<int64_t>("chunk_bytes") PIMHBM_PEER_GROUP_ATTRS);
