// CPU handlers of pimhbm_scan / pimhbm_verify, and the argument checks both platforms share.
#include "scan/scan_ffi.h"

#include "scan/scan.h"

namespace pimhbm::scan {

using ffi_util::check_buffer;
using ffi_util::check_chunk_bytes;
using ffi_util::check_digest_table;

ffi::Error validate_scan(const ffi::AnyBuffer& x, const ffi::AnyBuffer& digests,
                         const ffi::AnyBuffer& nonfinite, const ffi::AnyBuffer& max_abs,
                         int64_t chunk_bytes, Elem* elem) {
  constexpr const char* kOp = "pimhbm.scan";
  PIMHBM_FFI_RETURN_IF_ERROR(check_chunk_bytes(kOp, chunk_bytes));
  auto e = ffi_util::protected_elem(kOp, x);
  if (!e) return e.error();
  const int64_t n = num_chunks(static_cast<int64_t>(x.size_bytes()), chunk_bytes);
  PIMHBM_FFI_RETURN_IF_ERROR(check_digest_table(kOp, "digests", digests, n));
  PIMHBM_FFI_RETURN_IF_ERROR(check_buffer(kOp, "nonfinite", nonfinite, ffi::DataType::S32, n));
  PIMHBM_FFI_RETURN_IF_ERROR(check_buffer(kOp, "max_abs", max_abs, ffi::DataType::F32, n));
  *elem = *e;
  return ffi::Error::Success();
}

ffi::Error validate_verify(const ffi::AnyBuffer& x, const ffi::AnyBuffer& expected,
                           const ffi::AnyBuffer& mismatch, int64_t chunk_bytes) {
  constexpr const char* kOp = "pimhbm.verify";
  PIMHBM_FFI_RETURN_IF_ERROR(check_chunk_bytes(kOp, chunk_bytes));
  auto e = ffi_util::protected_elem(kOp, x);
  if (!e) return e.error();
  const int64_t n = num_chunks(static_cast<int64_t>(x.size_bytes()), chunk_bytes);
  PIMHBM_FFI_RETURN_IF_ERROR(check_digest_table(kOp, "digests", expected, n));
  return check_buffer(kOp, "mismatch", mismatch, ffi::DataType::PRED, n);
}

namespace {

ffi::Error scan_cpu_impl(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> digests,
                         ffi::Result<ffi::AnyBuffer> nonfinite, ffi::Result<ffi::AnyBuffer> max_abs,
                         int64_t chunk_bytes) {
  Elem elem;
  PIMHBM_FFI_RETURN_IF_ERROR(validate_scan(x, *digests, *nonfinite, *max_abs, chunk_bytes, &elem));
  scan_cpu(x.untyped_data(), static_cast<int64_t>(x.size_bytes()), elem, chunk_bytes,
           static_cast<uint32_t*>(digests->untyped_data()),
           static_cast<int32_t*>(nonfinite->untyped_data()),
           static_cast<float*>(max_abs->untyped_data()));
  return ffi::Error::Success();
}

ffi::Error verify_cpu_impl(ffi::AnyBuffer x, ffi::AnyBuffer expected,
                           ffi::Result<ffi::AnyBuffer> mismatch, int64_t chunk_bytes) {
  PIMHBM_FFI_RETURN_IF_ERROR(validate_verify(x, expected, *mismatch, chunk_bytes));
  verify_cpu(x.untyped_data(), static_cast<int64_t>(x.size_bytes()), chunk_bytes,
             static_cast<const uint32_t*>(expected.untyped_data()),
             static_cast<uint8_t*>(mismatch->untyped_data()));
  return ffi::Error::Success();
}

}  // namespace
}  // namespace pimhbm::scan

XLA_FFI_DEFINE_HANDLER_SYMBOL(PimhbmScanCpu, pimhbm::scan::scan_cpu_impl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Attr<int64_t>("chunk_bytes"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(PimhbmVerifyCpu, pimhbm::scan::verify_cpu_impl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Attr<int64_t>("chunk_bytes"));
