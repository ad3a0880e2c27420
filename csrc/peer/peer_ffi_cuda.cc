// How a peer op's call meets its peers on GPUs. Each device's handler runs on the host thread
// that launches that device's work; it publishes its buffers and an event recorded on its
// stream, makes its stream wait for its peers' events (their inputs are ready), enqueues the
// work (one kernel that reads the peers' memory directly), and then waits -- on the stream,
// not on the host -- for its peers to finish reading before its own stream may go on writing
// its buffers. No NCCL call; only the calling devices' streams take part.
#include <cuda_runtime_api.h>

#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "peer/peer_ffi.h"
#include "pimhbm/ffi_error.h"

namespace pimhbm::peer {
namespace {

using ffi_util::cuda_status;

// Peer access from `me` to each peer, enabled once per pair for the process.
ffi::Error enable_peer_access(const char* op, int me, const int64_t* peers, int size) {
  static std::mutex mu;
  static std::set<std::pair<int, int>> enabled;
  std::lock_guard<std::mutex> lock(mu);
  for (int p = 0; p < size; ++p) {
    const int other = static_cast<int>(peers[p]);
    if (other == me || enabled.count({me, other})) continue;
    int can = 0;
    PIMHBM_FFI_RETURN_IF_ERROR(
        cuda_status(op, cudaDeviceCanAccessPeer(&can, me, other), "cudaDeviceCanAccessPeer"));
    if (!can) {
      return peer_error(op, "GPU " + std::to_string(me) + " cannot read GPU " +
                                std::to_string(other) +
                                "'s memory directly (no peer access between them): use the "
                                "collective transport");
    }
    cudaError_t err = cudaDeviceEnablePeerAccess(other, 0);
    if (err == cudaErrorPeerAccessAlreadyEnabled) {
      (void)cudaGetLastError();  // returns and clears that very "already enabled"
      err = cudaSuccess;
    }
    PIMHBM_FFI_RETURN_IF_ERROR(cuda_status(op, err, "cudaDeviceEnablePeerAccess"));
    enabled.insert({me, other});
  }
  return ffi::Error::Success();
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
    // Best effort: a failure here leaves the thread on the handler's device, which XLA sets
    // again before its next call on this thread.
    if (cudaGetDevice(&now) == cudaSuccess && now != previous_) (void)cudaSetDevice(previous_);
  }
  cudaError_t error() const { return error_; }

 private:
  int previous_ = 0;
  cudaError_t error_;
};

// The event of `rank` for `phase`, created on first use by the rank's own device.
ffi::Error event_of(const char* op, Group* group, int rank, Phase phase, cudaEvent_t* event) {
  void*& slot = group->event_slot(rank, phase);
  if (!slot) {
    cudaEvent_t e;
    PIMHBM_FFI_RETURN_IF_ERROR(cuda_status(op, cudaEventCreateWithFlags(&e, cudaEventDisableTiming),
                                           "cudaEventCreateWithFlags"));
    slot = e;
  }
  *event = static_cast<cudaEvent_t>(slot);
  return ffi::Error::Success();
}

// `stream` ordered after every other rank's event in `all`.
ffi::Error wait_for_peers(const char* op, cudaStream_t stream, const Member& m,
                          const std::vector<Payload>& all) {
  for (int p = 0; p < m.size; ++p) {
    if (p == m.rank) continue;
    PIMHBM_FFI_RETURN_IF_ERROR(
        cuda_status(op, cudaStreamWaitEvent(stream, static_cast<cudaEvent_t>(all[p].event), 0),
                    "cudaStreamWaitEvent"));
  }
  return ffi::Error::Success();
}

}  // namespace

ffi::Error meet(const ffi_util::OnCuda& on, const char* op, int32_t ordinal, const Member& m,
                Payload mine, const Work& work) {
  DeviceScope scope(ordinal);
  PIMHBM_FFI_RETURN_IF_ERROR(cuda_status(op, scope.error(), "cudaSetDevice"));
  PIMHBM_FFI_RETURN_IF_ERROR(enable_peer_access(op, ordinal, m.peers, m.size));
  cudaEvent_t ready, done;
  PIMHBM_FFI_RETURN_IF_ERROR(event_of(op, m.group, m.rank, kReady, &ready));
  PIMHBM_FFI_RETURN_IF_ERROR(event_of(op, m.group, m.rank, kDone, &done));
  PIMHBM_FFI_RETURN_IF_ERROR(cuda_status(op, cudaEventRecord(ready, on.stream), "cudaEventRecord"));
  mine.event = ready;
  std::vector<Payload> all;
  if (std::string e = m.group->exchange(m.rank, kReady, mine, &all, m.timeout); !e.empty()) {
    return peer_error(op, e);
  }
  ffi::Error failed = wait_for_peers(op, on.stream, m, all);
  if (failed.success()) failed = work(all);
  if (failed.success())
    failed = cuda_status(op, cudaEventRecord(done, on.stream), "cudaEventRecord");
  // The second meeting happens even after a failure: peers must not wait for us in vain.
  std::vector<Payload> finished;
  if (std::string e =
          m.group->exchange(m.rank, kDone, Payload{nullptr, nullptr, done}, &finished, m.timeout);
      !e.empty()) {
    return peer_error(op, e);
  }
  if (failed.success()) failed = wait_for_peers(op, on.stream, m, finished);
  return failed;
}

ffi::Error copy_segments(const ffi_util::OnCuda& on, const char* op, const Segments& segments,
                         uint8_t* out) {
  return cuda_status(op, copy_segments_cuda(segments, out, on.stream));
}

}  // namespace pimhbm::peer
