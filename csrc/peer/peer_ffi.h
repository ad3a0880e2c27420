// XLA FFI handlers of the peer-pointer ops: "pimhbm_peer_all_gather", "pimhbm_peer_all_to_all"
// and "pimhbm_peer_pull" (a repair that reads the listed chunks from a peer's copy in place).
//
// Every device of a group calls the op once per program run; the group is given by the
// attributes `ordinals` (the device ordinals of every group, row-major, `group_size` a row)
// and `tag` (one per call site). Each call meets its peers twice (see rendezvous.h), waiting at
// most `timeout_ms` for each. One handler each for both platforms (peer_ffi.cc); how a call
// meets its peers and copies is what differs (below).
#pragma once

#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include "peer/copy.h"
#include "peer/rendezvous.h"
#include "pimhbm/ffi_platform.h"
#include "xla/ffi/api/ffi.h"

namespace pimhbm::peer {

namespace ffi = xla::ffi;

// The calling device's place in its group.
struct Member {
  Group* group = nullptr;
  int rank = 0;
  int size = 0;
  const int64_t* peers = nullptr;  // the ordinals of this group, by rank
  std::chrono::milliseconds timeout{0};
};

// What a call does between its two meetings, given every peer's payload (indexed by rank).
using Work = std::function<ffi::Error(const std::vector<Payload>& all)>;

// Meets the peers with `mine`, runs `work`, meets them again (so that nobody writes a buffer a
// peer still reads); the second meeting happens even when the work failed. On the host the
// work runs between the meetings; on the GPU it is enqueued on the stream between waits for
// the peers' events (their inputs are ready; they finished reading ours).
ffi::Error meet(ffi_util::OnCpu, const char* op, int32_t ordinal, const Member& m, Payload mine,
                const Work& work);
// The copy of the collectives: out[p] = segment p.
ffi::Error copy_segments(ffi_util::OnCpu, const char* op, const Segments& segments, uint8_t* out);
#if defined(PIMHBM_WITH_CUDA)
ffi::Error meet(const ffi_util::OnCuda& on, const char* op, int32_t ordinal, const Member& m,
                Payload mine, const Work& work);
ffi::Error copy_segments(const ffi_util::OnCuda& on, const char* op, const Segments& segments,
                         uint8_t* out);
#endif

inline ffi::Error peer_error(const char* op, const std::string& what) {
  return ffi::Error::Internal(std::string(op) + ": " + what);
}

}  // namespace pimhbm::peer

PIMHBM_FFI_DECLARE_HANDLERS(PimhbmPeerAllGather);
PIMHBM_FFI_DECLARE_HANDLERS(PimhbmPeerAllToAll);
PIMHBM_FFI_DECLARE_HANDLERS(PimhbmPeerPull);
