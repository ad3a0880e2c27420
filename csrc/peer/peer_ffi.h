// XLA FFI handlers of the peer-pointer ops: "pimhbm_peer_all_gather", "pimhbm_peer_all_to_all"
// and "pimhbm_peer_pull" (a repair that reads the listed chunks from a peer's copy in place).
//
// Every device of a group calls the op once per program run; the group is given by the
// attributes `ordinals` (the device ordinals of every group, row-major, `group_size` a row)
// and `tag` (one per call site). Each call meets its peers twice (see rendezvous.h), waiting at
// most `timeout_ms` for each.
#pragma once

#include <chrono>
#include <string>
#include <vector>

#include "peer/copy.h"
#include "peer/rendezvous.h"
#include "pimhbm/ffi_util.h"
#include "repair/repair.h"
#include "xla/ffi/api/c_api.h"

namespace pimhbm::peer {

namespace ffi = xla::ffi;

struct Member {
  Group* group = nullptr;
  int rank = 0;
  int size = 0;
  const int64_t* peers = nullptr;  // the ordinals of this group, by rank
  std::chrono::milliseconds timeout{0};
};

// Finds the calling device's group and rank, or an error a user understands.
ffi::ErrorOr<Member> member_of(const char* op, int32_t ordinal, int64_t tag,
                               ffi::Span<const int64_t> ordinals, int64_t group_size,
                               int64_t timeout_ms);

// Shape checks shared by both platforms.
ffi::Error validate_all_gather(const ffi::AnyBuffer& x, const ffi::AnyBuffer& out, int size);
ffi::Error validate_all_to_all(const ffi::AnyBuffer& x, const ffi::AnyBuffer& out, int size);
ffi::Error validate_pull(const ffi::AnyBuffer& chunks, const ffi::AnyBuffer& which,
                         const ffi::AnyBuffer& x, const ffi::AnyBuffer& table,
                         const ffi::AnyBuffer& status, int64_t chunk_bytes);

// What each op reads from the payloads its peers published (the same on both platforms):
// all_gather: every peer's whole input; all_to_all: block `rank` of every peer's input;
// pull: every peer's tensor and digest table, the entries' sources from `which`.
Segments gather_segments(const std::vector<Payload>& all, int64_t bytes);
Segments exchange_segments(const std::vector<Payload>& all, int rank, int64_t block_bytes);
repair::Sources pull_sources(const std::vector<Payload>& all, const Member& m,
                             const ffi::AnyBuffer& which, int64_t nbytes, int64_t chunk_bytes);

inline ffi::Error peer_error(const char* op, const std::string& what) {
  return ffi::Error::Internal(std::string(op) + ": " + what);
}

}  // namespace pimhbm::peer

// The attributes every peer op takes (see above).
#define PIMHBM_PEER_GROUP_ATTRS                        \
  .Attr<int64_t>("tag")                                \
      .Attr<xla::ffi::Span<const int64_t>>("ordinals") \
      .Attr<int64_t>("group_size")                     \
      .Attr<int64_t>("timeout_ms")

extern "C" {
XLA_FFI_Error* PimhbmPeerAllGatherCpu(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* PimhbmPeerAllToAllCpu(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* PimhbmPeerPullCpu(XLA_FFI_CallFrame* call_frame);
#if defined(PIMHBM_WITH_CUDA)
XLA_FFI_Error* PimhbmPeerAllGatherCuda(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* PimhbmPeerAllToAllCuda(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* PimhbmPeerPullCuda(XLA_FFI_CallFrame* call_frame);
#endif
}
