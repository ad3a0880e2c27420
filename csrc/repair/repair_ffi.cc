#include "repair/repair_ffi.h"

#include <string>
#include <vector>

namespace pimhbm::repair {

using ffi_util::check_buffer;
using ffi_util::check_chunk_bytes;
using ffi_util::check_digest_table;
using ffi_util::dtype_name;
using ffi_util::invalid;

namespace {

ffi::Error check_pair(const char* op, const ffi::AnyBuffer& src, const ffi::AnyBuffer& src_table,
                      const ffi::AnyBuffer& dst, const ffi::AnyBuffer& dst_table,
                      int64_t chunk_bytes, int64_t* nchunks) {
  PIMHBM_FFI_RETURN_IF_ERROR(check_chunk_bytes(op, chunk_bytes));
  if (src.element_type() != dst.element_type() || src.size_bytes() != dst.size_bytes()) {
    return invalid(op, "source " + dtype_name(src.element_type()) +
                           ffi_util::shape_str(src.dimensions()) + " does not match target " +
                           dtype_name(dst.element_type()) + ffi_util::shape_str(dst.dimensions()));
  }
  *nchunks = num_chunks(static_cast<int64_t>(dst.size_bytes()), chunk_bytes);
  PIMHBM_FFI_RETURN_IF_ERROR(check_digest_table(op, "source digests", src_table, *nchunks));
  return check_digest_table(op, "target digests", dst_table, *nchunks);
}

}  // namespace

ffi::Error validate_repair(const ffi::AnyBuffer& chunks, const ffi::AnyBuffer& src,
                           const ffi::AnyBuffer& src_table, const ffi::AnyBuffer& dst,
                           const ffi::AnyBuffer& dst_table, const ffi::AnyBuffer& status,
                           int64_t chunk_bytes) {
  constexpr const char* kOp = "pimhbm.repair";
  int64_t n;
  PIMHBM_FFI_RETURN_IF_ERROR(check_pair(kOp, src, src_table, dst, dst_table, chunk_bytes, &n));
  const int64_t k = static_cast<int64_t>(chunks.element_count());
  PIMHBM_FFI_RETURN_IF_ERROR(check_buffer(kOp, "chunk list", chunks, ffi::DataType::S32, k));
  return check_buffer(kOp, "status", status, ffi::DataType::S32, k);
}

ffi::Error validate_repair_packed(const ffi::AnyBuffer& chunks, const ffi::AnyBuffer& rows,
                                  const ffi::AnyBuffer& row_table, const ffi::AnyBuffer& dst,
                                  const ffi::AnyBuffer& dst_table, const ffi::AnyBuffer& status,
                                  int64_t chunk_bytes) {
  constexpr const char* kOp = "pimhbm.repair_packed";
  PIMHBM_FFI_RETURN_IF_ERROR(check_chunk_bytes(kOp, chunk_bytes));
  const int64_t k = static_cast<int64_t>(chunks.element_count());
  PIMHBM_FFI_RETURN_IF_ERROR(check_buffer(kOp, "chunk list", chunks, ffi::DataType::S32, k));
  if (rows.element_type() != dst.element_type() ||
      static_cast<int64_t>(rows.size_bytes()) != k * chunk_bytes) {
    return invalid(kOp, "the received rows must be " + dtype_name(dst.element_type()) + ", " +
                            std::to_string(k) + " chunks of " + std::to_string(chunk_bytes) +
                            " bytes; got " + dtype_name(rows.element_type()) +
                            ffi_util::shape_str(rows.dimensions()));
  }
  PIMHBM_FFI_RETURN_IF_ERROR(check_digest_table(kOp, "received digests", row_table, k));
  const int64_t n = num_chunks(static_cast<int64_t>(dst.size_bytes()), chunk_bytes);
  PIMHBM_FFI_RETURN_IF_ERROR(check_digest_table(kOp, "target digests", dst_table, n));
  return check_buffer(kOp, "status", status, ffi::DataType::S32, k);
}

ffi::Error validate_restore_clean(const ffi::AnyBuffer& commit, const ffi::RemainingArgs& args,
                                  const ffi::RemainingRets& rets,
                                  ffi::Span<const int64_t> chunk_bytes,
                                  std::vector<CleanPair>* pairs,
                                  std::vector<ffi_util::Unaliased>* copies) {
  constexpr const char* kOp = "pimhbm.restore_clean";
  PIMHBM_FFI_RETURN_IF_ERROR(check_buffer(kOp, "commit flag", commit, ffi::DataType::S32, 1));
  const size_t k = rets.size() / 2;
  if (rets.size() % 2 != 0 || args.size() != 5 * k || chunk_bytes.size() != k) {
    return invalid(kOp, "expected 5 arguments, 2 results and one chunk_bytes per tensor, got " +
                            std::to_string(args.size()) + ", " + std::to_string(rets.size()) +
                            " and " + std::to_string(chunk_bytes.size()));
  }
  pairs->clear();
  copies->clear();
  for (size_t i = 0; i < k; ++i) {
    auto faults = args.get<ffi::AnyBuffer>(5 * i);
    auto src = args.get<ffi::AnyBuffer>(5 * i + 1);
    auto src_table = args.get<ffi::AnyBuffer>(5 * i + 2);
    auto dst_in = args.get<ffi::AnyBuffer>(5 * i + 3);  // aliased with the results
    auto dst_table_in = args.get<ffi::AnyBuffer>(5 * i + 4);
    auto dst = rets.get<ffi::AnyBuffer>(2 * i);
    auto dst_table = rets.get<ffi::AnyBuffer>(2 * i + 1);
    if (!faults || !src || !src_table || !dst_in || !dst_table_in || !dst || !dst_table) {
      return invalid(kOp, "tensor " + std::to_string(i) + ": an argument is not a buffer");
    }
    const std::string where = k > 1 ? "tensor " + std::to_string(i) + ": " : "";
    int64_t n;
    if (auto err = check_pair(kOp, *src, *src_table, **dst, **dst_table, chunk_bytes[i], &n);
        err.failure()) {
      return k > 1 ? ffi_util::in_context(kOp, where, err) : err;
    }
    if (auto err = check_buffer(kOp, "fault map", *faults, ffi::DataType::S32, n); err.failure()) {
      return k > 1 ? ffi_util::in_context(kOp, where, err) : err;
    }
    pairs->push_back({static_cast<const int32_t*>(faults->untyped_data()),
                      chunked(*src, *src_table, chunk_bytes[i]),
                      mutable_chunked(**dst, **dst_table, chunk_bytes[i])});
    ffi_util::note_unaliased(kOp, copies, *dst_in, **dst);
    ffi_util::note_unaliased(kOp, copies, *dst_table_in, **dst_table);
  }
  return ffi::Error::Success();
}

namespace {

ffi::Error repair_cpu_impl(ffi::AnyBuffer chunks, ffi::AnyBuffer src, ffi::AnyBuffer src_table,
                           ffi::AnyBuffer dst_in, ffi::AnyBuffer dst_table_in,
                           ffi::Result<ffi::AnyBuffer> dst, ffi::Result<ffi::AnyBuffer> dst_table,
                           ffi::Result<ffi::AnyBuffer> status, int64_t chunk_bytes) {
  PIMHBM_FFI_RETURN_IF_ERROR(
      validate_repair(chunks, src, src_table, *dst, *dst_table, *status, chunk_bytes));
  ffi_util::copy_unaliased_cpu(
      ffi_util::unaliased("pimhbm.repair", {{dst_in, *dst}, {dst_table_in, *dst_table}}));
  repair_cpu(static_cast<const int32_t*>(chunks.untyped_data()),
             static_cast<int64_t>(chunks.element_count()), chunked(src, src_table, chunk_bytes),
             mutable_chunked(*dst, *dst_table, chunk_bytes),
             static_cast<int32_t*>(status->untyped_data()));
  return ffi::Error::Success();
}

ffi::Error restore_clean_cpu_impl(ffi::AnyBuffer commit, ffi::RemainingArgs args,
                                  ffi::RemainingRets rets, ffi::Span<const int64_t> chunk_bytes) {
  std::vector<CleanPair> pairs;
  std::vector<ffi_util::Unaliased> copies;
  PIMHBM_FFI_RETURN_IF_ERROR(
      validate_restore_clean(commit, args, rets, chunk_bytes, &pairs, &copies));
  ffi_util::copy_unaliased_cpu(copies);
  for (const CleanPair& p : pairs) {
    restore_clean_cpu(static_cast<const int32_t*>(commit.untyped_data()), p.faults, p.src, p.dst);
  }
  return ffi::Error::Success();
}

ffi::Error repair_packed_cpu_impl(ffi::AnyBuffer chunks, ffi::AnyBuffer rows,
                                  ffi::AnyBuffer row_table, ffi::AnyBuffer dst_in,
                                  ffi::AnyBuffer dst_table_in, ffi::Result<ffi::AnyBuffer> dst,
                                  ffi::Result<ffi::AnyBuffer> dst_table,
                                  ffi::Result<ffi::AnyBuffer> status, int64_t chunk_bytes) {
  PIMHBM_FFI_RETURN_IF_ERROR(
      validate_repair_packed(chunks, rows, row_table, *dst, *dst_table, *status, chunk_bytes));
  ffi_util::copy_unaliased_cpu(
      ffi_util::unaliased("pimhbm.repair_packed", {{dst_in, *dst}, {dst_table_in, *dst_table}}));
  repair_from_cpu(static_cast<const int32_t*>(chunks.untyped_data()),
                  static_cast<int64_t>(chunks.element_count()),
                  packed_sources(rows, row_table, chunk_bytes),
                  mutable_chunked(*dst, *dst_table, chunk_bytes),
                  static_cast<int32_t*>(status->untyped_data()));
  return ffi::Error::Success();
}

}  // namespace
}  // namespace pimhbm::repair

// chunks, rows, row_table, dst, dst_table -> dst, dst_table (aliased), status
XLA_FFI_DEFINE_HANDLER_SYMBOL(PimhbmRepairPackedCpu, pimhbm::repair::repair_packed_cpu_impl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Attr<int64_t>("chunk_bytes"));

// chunks, src, src_table, dst, dst_table -> dst, dst_table (aliased), status
XLA_FFI_DEFINE_HANDLER_SYMBOL(PimhbmRepairCpu, pimhbm::repair::repair_cpu_impl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Attr<int64_t>("chunk_bytes"));

// commit, then (faults, src, src_table, dst, dst_table) per tensor -> (dst, dst_table) per
// tensor (aliased)
XLA_FFI_DEFINE_HANDLER_SYMBOL(PimhbmRestoreCleanCpu, pimhbm::repair::restore_clean_cpu_impl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<xla::ffi::Span<const int64_t>>("chunk_bytes"));
