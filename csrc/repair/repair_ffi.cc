// The handlers of pimhbm_repair, pimhbm_repair_packed and pimhbm_restore_clean for both
// platforms, and their CPU launches.
#include "repair/repair_ffi.h"

#include <string>
#include <vector>

#include "pimhbm/ffi_alias.h"
#include "pimhbm/ffi_util.h"

namespace pimhbm::repair {

using ffi_util::check_count;
using ffi_util::check_digest_table;
using ffi_util::dtype_name;
using ffi_util::invalid;

ffi::Error launch(ffi_util::OnCpu, const RepairCall& c) {
  repair_from_cpu(c.chunks, c.nlisted, c.sources, c.dst, c.status);
  return ffi::Error::Success();
}

ffi::Error launch(ffi_util::OnCpu, const CleanCall& c) {
  for (const CleanPair& p : c.pairs) restore_clean_cpu(c.commit, p.faults, p.src, p.dst);
  return ffi::Error::Success();
}

namespace {

constexpr const char* kRestoreClean = "pimhbm.restore_clean";

std::string described(const ffi::AnyBuffer& b) {
  return dtype_name(b.element_type()) + ffi_util::shape_str(b.dimensions());
}

// A source and a target of the same dtype and size, and their digest tables.
ffi::Error check_pair(const char* op, const ffi::AnyBuffer& src, const ffi::AnyBuffer& src_table,
                      const ffi::AnyBuffer& dst, const ffi::AnyBuffer& dst_table,
                      int64_t chunk_bytes) {
  PIMHBM_FFI_RETURN_IF_ERROR(ffi_util::check_chunk_bytes(op, chunk_bytes));
  if (src.element_type() != dst.element_type() || src.size_bytes() != dst.size_bytes()) {
    return invalid(op, "source " + described(src) + " does not match target " + described(dst));
  }
  const int64_t n = num_chunks(static_cast<int64_t>(dst.size_bytes()), chunk_bytes);
  PIMHBM_FFI_RETURN_IF_ERROR(check_digest_table(op, "source digests", src_table, n));
  return check_digest_table(op, "target digests", dst_table, n);
}

// The received rows of a packed repair: one chunk per listed entry, in the target's dtype,
// and their digest rows.
ffi::Error check_rows(const char* op, const ffi::AnyBuffer& rows, const ffi::AnyBuffer& row_table,
                      const ffi::AnyBuffer& dst, const ffi::AnyBuffer& dst_table,
                      int64_t chunk_bytes, int64_t k) {
  PIMHBM_FFI_RETURN_IF_ERROR(ffi_util::check_chunk_bytes(op, chunk_bytes));
  if (rows.element_type() != dst.element_type() ||
      static_cast<int64_t>(rows.size_bytes()) != k * chunk_bytes) {
    return invalid(op, "the received rows must be " + dtype_name(dst.element_type()) + ", " +
                           std::to_string(k) + " chunks of " + std::to_string(chunk_bytes) +
                           " bytes; got " + described(rows));
  }
  PIMHBM_FFI_RETURN_IF_ERROR(check_digest_table(op, "received digests", row_table, k));
  const int64_t n = num_chunks(static_cast<int64_t>(dst.size_bytes()), chunk_bytes);
  return check_digest_table(op, "target digests", dst_table, n);
}

// pimhbm_repair (kPacked false: each listed chunk from the same chunk of the source tensor) and
// pimhbm_repair_packed (true: entry k's chunk from row k of the received rows): chunks, source
// (tensor or rows), its table, target, target table -> target, target table (aliased), status.
template <bool kPacked>
struct Repair {
  static constexpr const char* kOp = kPacked ? "pimhbm.repair_packed" : "pimhbm.repair";

  template <typename Platform>
  static ffi::Error handler(Platform on, ffi::Buffer<ffi::S32> chunks, ffi::AnyBuffer src,
                            ffi::AnyBuffer src_table, ffi::AnyBuffer dst_in,
                            ffi::AnyBuffer dst_table_in, ffi::Result<ffi::AnyBuffer> dst,
                            ffi::Result<ffi::AnyBuffer> dst_table,
                            ffi::ResultBuffer<ffi::S32> status, int64_t chunk_bytes) {
    const int64_t k = static_cast<int64_t>(chunks.element_count());
    if constexpr (kPacked) {
      PIMHBM_FFI_RETURN_IF_ERROR(check_rows(kOp, src, src_table, *dst, *dst_table, chunk_bytes, k));
    } else {
      PIMHBM_FFI_RETURN_IF_ERROR(check_pair(kOp, src, src_table, *dst, *dst_table, chunk_bytes));
    }
    PIMHBM_FFI_RETURN_IF_ERROR(check_count(kOp, "status", *status, k));
    PIMHBM_FFI_RETURN_IF_ERROR(ffi_util::copy_unaliased(
        on, ffi_util::unaliased(kOp, {{dst_in, *dst}, {dst_table_in, *dst_table}})));
    Sources sources{};
    sources.tensor[0] = chunked(src, src_table, chunk_bytes);
    sources.count = 1;
    sources.which = nullptr;
    sources.self = -1;
    sources.packed = kPacked;
    return launch(on,
                  RepairCall{kOp, chunks.typed_data(), k, sources,
                             mutable_chunked(*dst, *dst_table, chunk_bytes), status->typed_data()});
  }
};

// One tensor of pimhbm_restore_clean: args (faults, src, src_table, dst, dst_table) from
// `arg`, results (dst, dst_table) from `ret`.
ffi::Error clean_pair(const ffi::RemainingArgs& args, size_t arg, const ffi::RemainingRets& rets,
                      size_t ret, int64_t chunk_bytes, CleanPair* pair,
                      std::vector<ffi_util::Unaliased>* copies) {
  auto faults = args.get<ffi::AnyBuffer>(arg);
  auto src = args.get<ffi::AnyBuffer>(arg + 1);
  auto src_table = args.get<ffi::AnyBuffer>(arg + 2);
  auto dst_in = args.get<ffi::AnyBuffer>(arg + 3);  // aliased with the results
  auto dst_table_in = args.get<ffi::AnyBuffer>(arg + 4);
  auto dst = rets.get<ffi::AnyBuffer>(ret);
  auto dst_table = rets.get<ffi::AnyBuffer>(ret + 1);
  if (!faults || !src || !src_table || !dst_in || !dst_table_in || !dst || !dst_table) {
    return invalid(kRestoreClean, "an argument is not a buffer");
  }
  PIMHBM_FFI_RETURN_IF_ERROR(
      check_pair(kRestoreClean, *src, *src_table, **dst, **dst_table, chunk_bytes));
  const int64_t n = num_chunks(static_cast<int64_t>((*dst)->size_bytes()), chunk_bytes);
  PIMHBM_FFI_RETURN_IF_ERROR(
      ffi_util::check_buffer(kRestoreClean, "fault map", *faults, ffi::DataType::S32, n));
  *pair = {static_cast<const int32_t*>(faults->untyped_data()),
           chunked(*src, *src_table, chunk_bytes),
           mutable_chunked(**dst, **dst_table, chunk_bytes)};
  ffi_util::note_unaliased(kRestoreClean, copies, *dst_in, **dst);
  ffi_util::note_unaliased(kRestoreClean, copies, *dst_table_in, **dst_table);
  return ffi::Error::Success();
}

// The commit flag, then per tensor (faults, src, src_table, dst, dst_table) -> per tensor
// (dst, dst_table), aliased; chunk_bytes: one per tensor.
template <typename Platform>
ffi::Error restore_clean_handler(Platform on, ffi::Buffer<ffi::S32> commit, ffi::RemainingArgs args,
                                 ffi::RemainingRets rets, ffi::Span<const int64_t> chunk_bytes) {
  PIMHBM_FFI_RETURN_IF_ERROR(check_count(kRestoreClean, "commit flag", commit, 1));
  const size_t k = rets.size() / 2;
  if (rets.size() % 2 != 0 || args.size() != 5 * k || chunk_bytes.size() != k) {
    return invalid(kRestoreClean,
                   "expected 5 arguments, 2 results and one chunk_bytes per tensor, got " +
                       std::to_string(args.size()) + ", " + std::to_string(rets.size()) + " and " +
                       std::to_string(chunk_bytes.size()));
  }
  CleanCall call{commit.typed_data(), std::vector<CleanPair>(k)};
  std::vector<ffi_util::Unaliased> copies;
  for (size_t i = 0; i < k; ++i) {
    ffi::Error err = clean_pair(args, 5 * i, rets, 2 * i, chunk_bytes[i], &call.pairs[i], &copies);
    if (err.failure()) {
      if (k == 1) return err;
      return ffi_util::in_context(kRestoreClean, "tensor " + std::to_string(i) + ": ", err);
    }
  }
  PIMHBM_FFI_RETURN_IF_ERROR(ffi_util::copy_unaliased(on, copies));
  return launch(on, call);
}

}  // namespace
}  // namespace pimhbm::repair

// chunks, source (tensor or received rows), its table, target, target table -> target, target
// table (aliased), status
#define PIMHBM_REPAIR_BINDING(bind)               \
  bind.Arg<::xla::ffi::Buffer<::xla::ffi::S32>>() \
      .Arg<::xla::ffi::AnyBuffer>()               \
      .Arg<::xla::ffi::AnyBuffer>()               \
      .Arg<::xla::ffi::AnyBuffer>()               \
      .Arg<::xla::ffi::AnyBuffer>()               \
      .Ret<::xla::ffi::AnyBuffer>()               \
      .Ret<::xla::ffi::AnyBuffer>()               \
      .Ret<::xla::ffi::Buffer<::xla::ffi::S32>>() \
      .Attr<int64_t>("chunk_bytes")
PIMHBM_FFI_HANDLERS(PimhbmRepair, pimhbm::repair::Repair<false>::handler, PIMHBM_REPAIR_BINDING,
                    PIMHBM_FFI_CAPTURABLE);
PIMHBM_FFI_HANDLERS(PimhbmRepairPacked, pimhbm::repair::Repair<true>::handler,
                    PIMHBM_REPAIR_BINDING, PIMHBM_FFI_CAPTURABLE);

#define PIMHBM_RESTORE_CLEAN_BINDING(bind)        \
  bind.Arg<::xla::ffi::Buffer<::xla::ffi::S32>>() \
      .RemainingArgs()                            \
      .RemainingRets()                            \
      .Attr<::xla::ffi::Span<const int64_t>>("chunk_bytes")
PIMHBM_FFI_HANDLERS(PimhbmRestoreClean, pimhbm::repair::restore_clean_handler,
                    PIMHBM_RESTORE_CLEAN_BINDING, PIMHBM_FFI_CAPTURABLE);
