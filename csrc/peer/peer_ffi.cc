// The handlers of the peer ops for both platforms, and how a call meets its peers on the host
// platform: the same protocol as on GPUs, with plain copies (every "device" is host memory).
// That is the reference the CUDA version is tested against, and what runs the multi-device
// logic in CI.
#include "peer/peer_ffi.h"

#include <string>
#include <vector>

#include "pimhbm/ffi_alias.h"
#include "pimhbm/ffi_util.h"
#include "repair/repair_ffi.h"

namespace pimhbm::peer {

using ffi_util::dtype_name;
using ffi_util::invalid;
using ffi_util::shape_str;

ffi::Error meet(ffi_util::OnCpu, const char* op, int32_t, const Member& m, Payload mine,
                const Work& work) {
  std::vector<Payload> all;
  if (std::string e = m.group->exchange(m.rank, kReady, mine, &all, m.timeout); !e.empty()) {
    return peer_error(op, e);
  }
  ffi::Error result = work(all);
  std::vector<Payload> done;
  if (std::string e = m.group->exchange(m.rank, kDone, Payload{}, &done, m.timeout); !e.empty()) {
    return peer_error(op, e);
  }
  return result;
}

ffi::Error copy_segments(ffi_util::OnCpu, const char*, const Segments& segments, uint8_t* out) {
  copy_segments_cpu(segments, out);
  return ffi::Error::Success();
}

namespace {

constexpr const char* kPull = "pimhbm.peer.pull";

// The calling device's group and rank, or an error a user understands.
ffi::ErrorOr<Member> member_of(const char* op, int32_t ordinal, int64_t tag,
                               ffi::Span<const int64_t> ordinals, int64_t group_size,
                               int64_t timeout_ms) {
  const int64_t count = static_cast<int64_t>(ordinals.size());
  if (group_size < 1 || group_size > kMaxGroup || count % group_size != 0) {
    return invalid(op, "groups of " + std::to_string(group_size) + " devices over " +
                           std::to_string(count) + " ordinals: a group has 1 to " +
                           std::to_string(kMaxGroup) + " devices and the groups are equal");
  }
  if (timeout_ms <= 0) return invalid(op, "timeout_ms must be positive");
  Member m;
  int64_t group;
  if (!find_rank(ordinals.begin(), count, group_size, ordinal, &group, &m.rank)) {
    return invalid(op, "device ordinal " + std::to_string(ordinal) +
                           " is in none of the op's groups (every device of a group must be "
                           "local to this process)");
  }
  std::string error;
  m.group = group_for(tag, group, static_cast<int>(group_size), &error);
  if (!m.group) return invalid(op, error);
  m.size = static_cast<int>(group_size);
  m.peers = ordinals.begin() + group * group_size;
  m.timeout = std::chrono::milliseconds(timeout_ms);
  return m;
}

std::string described(const ffi::AnyBuffer& b) {
  return dtype_name(b.element_type()) + shape_str(b.dimensions());
}

// all_gather: out holds `size` copies of x. all_to_all: x has one block per peer (its first
// dimension is the group size) and out matches it.
ffi::Error check_collective(const char* op, bool all_to_all, const ffi::AnyBuffer& x,
                            const ffi::AnyBuffer& out, int size) {
  if (all_to_all && (x.dimensions().size() == 0 || x.dimensions()[0] != size)) {
    return invalid(op, "the input's first dimension must be the group size " +
                           std::to_string(size) + " (one block per peer), got shape " +
                           shape_str(x.dimensions()));
  }
  const size_t want = x.size_bytes() * static_cast<size_t>(all_to_all ? 1 : size);
  if (out.element_type() != x.element_type() || out.size_bytes() != want) {
    return invalid(
        op, "output " + described(out) +
                (all_to_all ? " must match the input "
                            : " must hold " + std::to_string(size) + " copies of the input ") +
                described(x));
  }
  return ffi::Error::Success();
}

// The operands past an op's own: at most one, `after` (peer.py), never read.
ffi::Error check_after(const char* op, const ffi::RemainingArgs& after) {
  if (after.size() <= 1) return ffi::Error::Success();
  return invalid(op, "at most one `after` operand, got " + std::to_string(after.size()));
}

// What a collective reads from its peers: all_gather every peer's whole input, all_to_all
// block `rank` of every peer's input.
Segments segments_of(const std::vector<Payload>& all, int rank, int64_t bytes, bool all_to_all) {
  Segments s{};
  s.count = static_cast<int>(all.size());
  s.bytes = all_to_all ? bytes / s.count : bytes;
  for (int p = 0; p < s.count; ++p) {
    s.src[p] = static_cast<const uint8_t*>(all[p].in) + (all_to_all ? rank * s.bytes : 0);
  }
  return s;
}

// pimhbm_peer_all_gather (kAllToAll false): x[, after] -> out (n, *x.shape), every peer's x in
// rank order. pimhbm_peer_all_to_all (true): x (n, ...)[, after] -> out (n, ...), out[p] = peer
// p's x[rank]. `after`, not read, orders the call behind the op that wrote it (as the pull's).
template <bool kAllToAll>
struct Collective {
  static constexpr const char* kOp =
      kAllToAll ? "pimhbm.peer.all_to_all" : "pimhbm.peer.all_gather";

  template <typename Platform>
  static ffi::Error handler(Platform on, int32_t ordinal, ffi::AnyBuffer x,
                            ffi::RemainingArgs after, ffi::Result<ffi::AnyBuffer> out, int64_t tag,
                            ffi::Span<const int64_t> ordinals, int64_t group_size,
                            int64_t timeout_ms) {
    PIMHBM_FFI_ASSIGN_OR_RETURN(const Member m,
                                member_of(kOp, ordinal, tag, ordinals, group_size, timeout_ms));
    PIMHBM_FFI_RETURN_IF_ERROR(check_after(kOp, after));
    PIMHBM_FFI_RETURN_IF_ERROR(check_collective(kOp, kAllToAll, x, *out, m.size));
    const auto bytes = static_cast<int64_t>(x.size_bytes());
    return meet(on, kOp, ordinal, m, Payload{x.untyped_data()},
                [&](const std::vector<Payload>& all) {
                  return copy_segments(on, kOp, segments_of(all, m.rank, bytes, kAllToAll),
                                       static_cast<uint8_t*>(out->untyped_data()));
                });
  }
};

// The listed chunks (chunk list, source list, status: one entry each) of a tensor and its
// digest table.
ffi::Error check_pull(const ffi::Buffer<ffi::S32>& chunks, const ffi::Buffer<ffi::S32>& which,
                      const ffi::AnyBuffer& x, const ffi::AnyBuffer& table,
                      const ffi::Buffer<ffi::S32>& status, int64_t chunk_bytes) {
  PIMHBM_FFI_RETURN_IF_ERROR(ffi_util::check_chunk_bytes(kPull, chunk_bytes));
  const int64_t n = num_chunks(static_cast<int64_t>(x.size_bytes()), chunk_bytes);
  PIMHBM_FFI_RETURN_IF_ERROR(ffi_util::check_digest_table(kPull, "digests", table, n));
  const int64_t k = static_cast<int64_t>(chunks.element_count());
  PIMHBM_FFI_RETURN_IF_ERROR(ffi_util::check_count(kPull, "source list", which, k));
  return ffi_util::check_count(kPull, "status", status, k);
}

// Every peer's tensor and digest table as the pull's sources; entry k's from peer which[k].
repair::Sources pull_sources(const std::vector<Payload>& all, const Member& m, const int32_t* which,
                             int64_t nbytes, int64_t chunk_bytes) {
  repair::Sources sources{};
  sources.count = m.size;
  sources.self = m.rank;
  sources.which = which;
  for (int p = 0; p < m.size; ++p) {
    sources.tensor[p] = {static_cast<const uint8_t*>(all[p].in), nbytes, chunk_bytes,
                         static_cast<const uint32_t*>(all[p].extra)};
  }
  return sources;
}

// chunks, which, x, table[, after] -> x, table (aliased), status. `after` is not read: it is
// there so that the runtime orders this call after the op that wrote it (peer.py's `after`).
template <typename Platform>
ffi::Error pull_handler(Platform on, int32_t ordinal, ffi::Buffer<ffi::S32> chunks,
                        ffi::Buffer<ffi::S32> which, ffi::AnyBuffer x_in, ffi::AnyBuffer table_in,
                        ffi::RemainingArgs after, ffi::Result<ffi::AnyBuffer> x,
                        ffi::Result<ffi::AnyBuffer> table, ffi::ResultBuffer<ffi::S32> status,
                        int64_t chunk_bytes, int64_t tag, ffi::Span<const int64_t> ordinals,
                        int64_t group_size, int64_t timeout_ms) {
  PIMHBM_FFI_ASSIGN_OR_RETURN(const Member m,
                              member_of(kPull, ordinal, tag, ordinals, group_size, timeout_ms));
  PIMHBM_FFI_RETURN_IF_ERROR(check_after(kPull, after));
  PIMHBM_FFI_RETURN_IF_ERROR(check_pull(chunks, which, *x, *table, *status, chunk_bytes));
  // The target starts as the operand where XLA did not alias them (ffi_alias.h), before the
  // peers meet: what they read of this device is its current state.
  PIMHBM_FFI_RETURN_IF_ERROR(
      ffi_util::copy_unaliased(on, ffi_util::unaliased(kPull, {{x_in, *x}, {table_in, *table}})));
  const auto nbytes = static_cast<int64_t>(x->size_bytes());
  const Payload mine{x->untyped_data(), table->untyped_data()};
  return meet(on, kPull, ordinal, m, mine, [&](const std::vector<Payload>& all) {
    return repair::launch(
        on,
        repair::RepairCall{kPull, chunks.typed_data(), static_cast<int64_t>(chunks.element_count()),
                           pull_sources(all, m, which.typed_data(), nbytes, chunk_bytes),
                           repair::mutable_chunked(*x, *table, chunk_bytes), status->typed_data()});
  });
}

}  // namespace
}  // namespace pimhbm::peer

// The attributes every peer op takes (see peer_ffi.h).
#define PIMHBM_PEER_GROUP_ATTRS                          \
  .Attr<int64_t>("tag")                                  \
      .Attr<::xla::ffi::Span<const int64_t>>("ordinals") \
      .Attr<int64_t>("group_size")                       \
      .Attr<int64_t>("timeout_ms")

#define PIMHBM_PEER_COLLECTIVE_BINDING(bind) \
  bind.Ctx<::xla::ffi::DeviceOrdinal>()      \
      .Arg<::xla::ffi::AnyBuffer>()          \
      .RemainingArgs()                       \
      .Ret<::xla::ffi::AnyBuffer>() PIMHBM_PEER_GROUP_ATTRS
// Not capturable into a command buffer: each call meets its peers on the host.
PIMHBM_FFI_HANDLERS(PimhbmPeerAllGather, pimhbm::peer::Collective<false>::handler,
                    PIMHBM_PEER_COLLECTIVE_BINDING, PIMHBM_FFI_NOT_CAPTURABLE);
PIMHBM_FFI_HANDLERS(PimhbmPeerAllToAll, pimhbm::peer::Collective<true>::handler,
                    PIMHBM_PEER_COLLECTIVE_BINDING, PIMHBM_FFI_NOT_CAPTURABLE);

#define PIMHBM_PEER_PULL_BINDING(bind)            \
  bind.Ctx<::xla::ffi::DeviceOrdinal>()           \
      .Arg<::xla::ffi::Buffer<::xla::ffi::S32>>() \
      .Arg<::xla::ffi::Buffer<::xla::ffi::S32>>() \
      .Arg<::xla::ffi::AnyBuffer>()               \
      .Arg<::xla::ffi::AnyBuffer>()               \
      .RemainingArgs()                            \
      .Ret<::xla::ffi::AnyBuffer>()               \
      .Ret<::xla::ffi::AnyBuffer>()               \
      .Ret<::xla::ffi::Buffer<::xla::ffi::S32>>() \
      .Attr<int64_t>("chunk_bytes") PIMHBM_PEER_GROUP_ATTRS
PIMHBM_FFI_HANDLERS(PimhbmPeerPull, pimhbm::peer::pull_handler, PIMHBM_PEER_PULL_BINDING,
                    PIMHBM_FFI_NOT_CAPTURABLE);
