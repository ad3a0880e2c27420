// The peer ops on the host platform: the same meeting protocol as on GPUs, with plain copies
// (every "device" is host memory). This is the reference the CUDA version is tested against,
// and what runs the multi-device logic in CI.
#include "peer/peer_ffi.h"

#include "pimhbm/ffi_alias.h"
#include "repair/repair_ffi.h"

namespace pimhbm::peer {

using ffi_util::dtype_name;
using ffi_util::invalid;
using ffi_util::shape_str;

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

ffi::Error validate_all_gather(const ffi::AnyBuffer& x, const ffi::AnyBuffer& out, int size) {
  constexpr const char* kOp = "pimhbm.peer.all_gather";
  if (out.element_type() != x.element_type() ||
      out.size_bytes() != x.size_bytes() * static_cast<size_t>(size)) {
    return invalid(kOp, "output " + dtype_name(out.element_type()) + shape_str(out.dimensions()) +
                            " must hold " + std::to_string(size) + " copies of the input " +
                            dtype_name(x.element_type()) + shape_str(x.dimensions()));
  }
  return ffi::Error::Success();
}

ffi::Error validate_all_to_all(const ffi::AnyBuffer& x, const ffi::AnyBuffer& out, int size) {
  constexpr const char* kOp = "pimhbm.peer.all_to_all";
  auto dims = x.dimensions();
  if (dims.size() == 0 || dims[0] != size) {
    return invalid(kOp, "the input's first dimension must be the group size " +
                            std::to_string(size) + " (one block per peer), got shape " +
                            shape_str(dims));
  }
  if (out.element_type() != x.element_type() || out.size_bytes() != x.size_bytes()) {
    return invalid(kOp, "output " + dtype_name(out.element_type()) + shape_str(out.dimensions()) +
                            " must match the input " + dtype_name(x.element_type()) +
                            shape_str(dims));
  }
  return ffi::Error::Success();
}

ffi::Error validate_pull(const ffi::AnyBuffer& chunks, const ffi::AnyBuffer& which,
                         const ffi::AnyBuffer& x, const ffi::AnyBuffer& table,
                         const ffi::AnyBuffer& status, int64_t chunk_bytes) {
  constexpr const char* kOp = "pimhbm.peer.pull";
  PIMHBM_FFI_RETURN_IF_ERROR(ffi_util::check_chunk_bytes(kOp, chunk_bytes));
  const int64_t n = num_chunks(static_cast<int64_t>(x.size_bytes()), chunk_bytes);
  PIMHBM_FFI_RETURN_IF_ERROR(ffi_util::check_digest_table(kOp, "digests", table, n));
  const int64_t k = static_cast<int64_t>(chunks.element_count());
  PIMHBM_FFI_RETURN_IF_ERROR(
      ffi_util::check_buffer(kOp, "chunk list", chunks, ffi::DataType::S32, k));
  PIMHBM_FFI_RETURN_IF_ERROR(
      ffi_util::check_buffer(kOp, "source list", which, ffi::DataType::S32, k));
  return ffi_util::check_buffer(kOp, "status", status, ffi::DataType::S32, k);
}

Segments gather_segments(const std::vector<Payload>& all, int64_t bytes) {
  Segments s{};
  s.count = static_cast<int>(all.size());
  s.bytes = bytes;
  for (int p = 0; p < s.count; ++p) s.src[p] = static_cast<const uint8_t*>(all[p].in);
  return s;
}

Segments exchange_segments(const std::vector<Payload>& all, int rank, int64_t block_bytes) {
  Segments s = gather_segments(all, block_bytes);
  for (int p = 0; p < s.count; ++p) s.src[p] += rank * block_bytes;
  return s;
}

repair::Sources pull_sources(const std::vector<Payload>& all, const Member& m,
                             const ffi::AnyBuffer& which, int64_t nbytes, int64_t chunk_bytes) {
  repair::Sources sources{};
  sources.count = m.size;
  sources.self = m.rank;
  sources.which = static_cast<const int32_t*>(which.untyped_data());
  for (int p = 0; p < m.size; ++p) {
    sources.tensor[p] = {static_cast<const uint8_t*>(all[p].in), nbytes, chunk_bytes,
                         static_cast<const uint32_t*>(all[p].extra)};
  }
  return sources;
}

namespace {

// Meets the peers with `mine`, runs `work(all)`, meets them again (so that nobody writes a
// buffer a peer still reads). The second meeting happens even when the work failed.
template <typename Work>
ffi::Error meet_and_run(const char* op, const Member& m, const Payload& mine, Work work) {
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

ffi::Error all_gather_cpu(int32_t ordinal, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> out,
                          int64_t tag, ffi::Span<const int64_t> ordinals, int64_t group_size,
                          int64_t timeout_ms) {
  constexpr const char* kOp = "pimhbm.peer.all_gather";
  auto m = member_of(kOp, ordinal, tag, ordinals, group_size, timeout_ms);
  if (m.has_error()) return m.error();
  PIMHBM_FFI_RETURN_IF_ERROR(validate_all_gather(x, *out, m->size));
  return meet_and_run(kOp, *m, Payload{x.untyped_data()}, [&](const std::vector<Payload>& all) {
    copy_segments_cpu(gather_segments(all, static_cast<int64_t>(x.size_bytes())),
                      static_cast<uint8_t*>(out->untyped_data()));
    return ffi::Error::Success();
  });
}

ffi::Error all_to_all_cpu(int32_t ordinal, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> out,
                          int64_t tag, ffi::Span<const int64_t> ordinals, int64_t group_size,
                          int64_t timeout_ms) {
  constexpr const char* kOp = "pimhbm.peer.all_to_all";
  auto m = member_of(kOp, ordinal, tag, ordinals, group_size, timeout_ms);
  if (m.has_error()) return m.error();
  PIMHBM_FFI_RETURN_IF_ERROR(validate_all_to_all(x, *out, m->size));
  return meet_and_run(kOp, *m, Payload{x.untyped_data()}, [&](const std::vector<Payload>& all) {
    copy_segments_cpu(
        exchange_segments(all, m->rank, static_cast<int64_t>(x.size_bytes()) / m->size),
        static_cast<uint8_t*>(out->untyped_data()));
    return ffi::Error::Success();
  });
}

ffi::Error pull_cpu(int32_t ordinal, ffi::AnyBuffer chunks, ffi::AnyBuffer which,
                    ffi::AnyBuffer x_in, ffi::AnyBuffer table_in, ffi::Result<ffi::AnyBuffer> x,
                    ffi::Result<ffi::AnyBuffer> table, ffi::Result<ffi::AnyBuffer> status,
                    int64_t chunk_bytes, int64_t tag, ffi::Span<const int64_t> ordinals,
                    int64_t group_size, int64_t timeout_ms) {
  constexpr const char* kOp = "pimhbm.peer.pull";
  auto m = member_of(kOp, ordinal, tag, ordinals, group_size, timeout_ms);
  if (m.has_error()) return m.error();
  PIMHBM_FFI_RETURN_IF_ERROR(validate_pull(chunks, which, *x, *table, *status, chunk_bytes));
  // The target starts as the operand where XLA did not alias them (ffi_alias.h), before the
  // peers meet: what they read of this device is its current state.
  ffi_util::copy_unaliased_cpu(ffi_util::unaliased(kOp, {{x_in, *x}, {table_in, *table}}));
  Payload mine{x->untyped_data(), table->untyped_data()};
  return meet_and_run(kOp, *m, mine, [&](const std::vector<Payload>& all) {
    repair::repair_from_cpu(
        static_cast<const int32_t*>(chunks.untyped_data()),
        static_cast<int64_t>(chunks.element_count()),
        pull_sources(all, *m, which, static_cast<int64_t>(x->size_bytes()), chunk_bytes),
        repair::mutable_chunked(*x, *table, chunk_bytes),
        static_cast<int32_t*>(status->untyped_data()));
    return ffi::Error::Success();
  });
}

}  // namespace
}  // namespace pimhbm::peer

// x -> out (n, *x.shape)
XLA_FFI_DEFINE_HANDLER_SYMBOL(PimhbmPeerAllGatherCpu, pimhbm::peer::all_gather_cpu,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::DeviceOrdinal>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>() PIMHBM_PEER_GROUP_ATTRS);

// x (n, ...) -> out (n, ...): out[p] = peer p's x[rank]
XLA_FFI_DEFINE_HANDLER_SYMBOL(PimhbmPeerAllToAllCpu, pimhbm::peer::all_to_all_cpu,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::DeviceOrdinal>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>() PIMHBM_PEER_GROUP_ATTRS);

// chunks, which, x, table -> x, table (aliased), status
XLA_FFI_DEFINE_HANDLER_SYMBOL(PimhbmPeerPullCpu, pimhbm::peer::pull_cpu,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::DeviceOrdinal>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Attr<int64_t>("chunk_bytes") PIMHBM_PEER_GROUP_ATTRS);
