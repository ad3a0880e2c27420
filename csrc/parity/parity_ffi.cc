// The handlers of pimhbm_parity / pimhbm_parity_rebuild for both platforms, and their CPU
// launches.
#include "parity/parity_ffi.h"

#include <string>

#include "pimhbm/digest.h"
#include "pimhbm/ffi_util.h"

namespace pimhbm::parity {

using ffi_util::check_count;
using ffi_util::invalid;

ffi::Error launch(ffi_util::OnCpu, const ParityCall& c) {
  parity_cpu(c.data, c.nbytes, c.chunk_bytes, c.group, c.rows);
  return ffi::Error::Success();
}

ffi::Error launch(ffi_util::OnCpu, const RebuildCall& c) {
  rebuild_cpu(c.tensor, c.rows, c.list, c.count, c.status);
  return ffi::Error::Success();
}

namespace {

constexpr const char* kParity = "pimhbm.parity";
constexpr const char* kRebuild = "pimhbm.parity_rebuild";

// The chunking of a tensor and the shape its parity rows must have: uint32 (groups,
// chunk_bytes / 4).
ffi::Error check_rows(const char* op, const ffi::AnyBuffer& x, const ffi::AnyBuffer& rows,
                      int64_t chunk_bytes, int64_t group) {
  PIMHBM_FFI_RETURN_IF_ERROR(ffi_util::check_chunk_bytes(op, chunk_bytes));
  if (auto elem = ffi_util::protected_elem(op, x); elem.has_error()) return elem.error();
  if (group < 1 || group > kMaxGroup) {
    return invalid(op, "group must be 1 to " + std::to_string(kMaxGroup) + ", got " +
                           std::to_string(group));
  }
  const int64_t nbytes = static_cast<int64_t>(x.size_bytes());
  if ((nbytes + chunk_bytes - 1) / chunk_bytes > kMaxChunks) {
    return invalid(op, "a tensor of " + std::to_string(nbytes) + " bytes has more than " +
                           std::to_string(kMaxChunks) + " chunks of " +
                           std::to_string(chunk_bytes) + " bytes: use larger chunks");
  }
  const int64_t groups = num_groups(nbytes, chunk_bytes, group);
  auto dims = rows.dimensions();
  if (rows.element_type() != ffi::DataType::U32 || dims.size() != 2 || dims[0] != groups ||
      dims[1] != chunk_bytes / 4) {
    return invalid(op, "parity rows must be uint32 of shape (" + std::to_string(groups) + ", " +
                           std::to_string(chunk_bytes / 4) + "), got " +
                           ffi_util::dtype_name(rows.element_type()) +
                           ffi_util::shape_str(dims));
  }
  return ffi::Error::Success();
}

template <typename Platform>
ffi::Error parity_handler(Platform on, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> rows,
                          int64_t chunk_bytes, int64_t group) {
  PIMHBM_FFI_RETURN_IF_ERROR(check_rows(kParity, x, *rows, chunk_bytes, group));
  return launch(on, ParityCall{static_cast<const uint8_t*>(x.untyped_data()),
                               static_cast<int64_t>(x.size_bytes()), chunk_bytes, group,
                               static_cast<uint32_t*>(rows->untyped_data())});
}

// list, x, its digests, its parity rows, chunk_base -> x (aliased), status
template <typename Platform>
ffi::Error rebuild_handler(Platform on, ffi::Buffer<ffi::S32> list, ffi::AnyBuffer x_in,
                           ffi::AnyBuffer table, ffi::AnyBuffer rows,
                           ffi::Buffer<ffi::S32> chunk_base, ffi::Result<ffi::AnyBuffer> x,
                           ffi::ResultBuffer<ffi::S32> status, int64_t chunk_bytes,
                           int64_t group) {
  PIMHBM_FFI_RETURN_IF_ERROR(check_count(kRebuild, "chunk_base", chunk_base, 1));
  PIMHBM_FFI_RETURN_IF_ERROR(check_rows(kRebuild, *x, rows, chunk_bytes, group));
  const int64_t nbytes = static_cast<int64_t>(x->size_bytes());
  PIMHBM_FFI_RETURN_IF_ERROR(
      ffi_util::check_digest_table(kRebuild, "digests", table, num_chunks(nbytes, chunk_bytes)));
  const int64_t k = static_cast<int64_t>(list.element_count());
  PIMHBM_FFI_RETURN_IF_ERROR(check_count(kRebuild, "status", *status, k));
  PIMHBM_FFI_RETURN_IF_ERROR(
      ffi_util::copy_unaliased(on, ffi_util::unaliased(kRebuild, {{x_in, *x}})));
  const Grouped t{static_cast<uint8_t*>(x->untyped_data()), nbytes, chunk_bytes, group,
                  static_cast<const uint32_t*>(table.untyped_data()), chunk_base.typed_data()};
  return launch(on, RebuildCall{t, static_cast<const uint32_t*>(rows.untyped_data()),
                                list.typed_data(), k, status->typed_data()});
}

}  // namespace
}  // namespace pimhbm::parity

// x -> parity rows uint32 (groups, chunk_bytes / 4)
#define PIMHBM_PARITY_BINDING(bind)  \
  bind.Arg<::xla::ffi::AnyBuffer>()  \
      .Ret<::xla::ffi::AnyBuffer>()  \
      .Attr<int64_t>("chunk_bytes")  \
      .Attr<int64_t>("group")
PIMHBM_FFI_HANDLERS(PimhbmParity, pimhbm::parity::parity_handler, PIMHBM_PARITY_BINDING,
                    PIMHBM_FFI_CAPTURABLE);

// list, x, digests, parity rows, chunk_base int32 (1,) -> x (aliased), status
#define PIMHBM_REBUILD_BINDING(bind)              \
  bind.Arg<::xla::ffi::Buffer<::xla::ffi::S32>>() \
      .Arg<::xla::ffi::AnyBuffer>()               \
      .Arg<::xla::ffi::AnyBuffer>()               \
      .Arg<::xla::ffi::AnyBuffer>()               \
      .Arg<::xla::ffi::Buffer<::xla::ffi::S32>>() \
      .Ret<::xla::ffi::AnyBuffer>()               \
      .Ret<::xla::ffi::Buffer<::xla::ffi::S32>>() \
      .Attr<int64_t>("chunk_bytes")               \
      .Attr<int64_t>("group")
PIMHBM_FFI_HANDLERS(PimhbmParityRebuild, pimhbm::parity::rebuild_handler, PIMHBM_REBUILD_BINDING,
                    PIMHBM_FFI_CAPTURABLE);
