// The handlers of pimhbm_scan / pimhbm_verify for both platforms, and their CPU launches.
#include "scan/scan_ffi.h"

#include "pimhbm/ffi_util.h"
#include "scan/scan.h"

namespace pimhbm::scan {

using ffi_util::check_count;

ffi::Error launch(ffi_util::OnCpu, const ScanCall& c) {
  scan_cpu(c.data, c.nbytes, c.elem, c.chunk_bytes, c.digests, c.nonfinite, c.max_abs,
           *c.chunk_base);
  return ffi::Error::Success();
}

ffi::Error launch(ffi_util::OnCpu, const VerifyCall& c) {
  verify_cpu(c.data, c.nbytes, c.chunk_bytes, c.expected, c.mismatch, *c.chunk_base);
  return ffi::Error::Success();
}

namespace {

constexpr const char* kScan = "pimhbm.scan";
constexpr const char* kVerify = "pimhbm.verify";

// A tensor in chunks: its element class and its number of chunks.
struct Chunked {
  Elem elem;
  int64_t nchunks;
};

// What both ops check of their tensor and its digest table: the chunk size, the dtype, the
// table's shape.
ffi::ErrorOr<Chunked> check_chunked(const char* op, const ffi::AnyBuffer& x,
                                    const ffi::AnyBuffer& table, int64_t chunk_bytes) {
  PIMHBM_FFI_RETURN_IF_ERROR(ffi_util::check_chunk_bytes(op, chunk_bytes));
  PIMHBM_FFI_ASSIGN_OR_RETURN(const Elem elem, ffi_util::protected_elem(op, x));
  const int64_t n = num_chunks(static_cast<int64_t>(x.size_bytes()), chunk_bytes);
  PIMHBM_FFI_RETURN_IF_ERROR(ffi_util::check_digest_table(op, "digests", table, n));
  return Chunked{elem, n};
}

template <typename Platform>
ffi::Error scan_handler(Platform on, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> chunk_base,
                        ffi::Result<ffi::AnyBuffer> digests,
                        ffi::ResultBuffer<ffi::S32> nonfinite, ffi::ResultBuffer<ffi::F32> max_abs,
                        int64_t chunk_bytes) {
  PIMHBM_FFI_ASSIGN_OR_RETURN(const Chunked t, check_chunked(kScan, x, *digests, chunk_bytes));
  PIMHBM_FFI_RETURN_IF_ERROR(check_count(kScan, "chunk_base", chunk_base, 1));
  PIMHBM_FFI_RETURN_IF_ERROR(check_count(kScan, "nonfinite", *nonfinite, t.nchunks));
  PIMHBM_FFI_RETURN_IF_ERROR(check_count(kScan, "max_abs", *max_abs, t.nchunks));
  return launch(on, ScanCall{x.untyped_data(), static_cast<int64_t>(x.size_bytes()), t.elem,
                             chunk_bytes, static_cast<uint32_t*>(digests->untyped_data()),
                             nonfinite->typed_data(), max_abs->typed_data(),
                             chunk_base.typed_data()});
}

template <typename Platform>
ffi::Error verify_handler(Platform on, ffi::AnyBuffer x, ffi::AnyBuffer expected,
                          ffi::Buffer<ffi::S32> chunk_base, ffi::ResultBuffer<ffi::PRED> mismatch,
                          int64_t chunk_bytes) {
  PIMHBM_FFI_ASSIGN_OR_RETURN(const Chunked t, check_chunked(kVerify, x, expected, chunk_bytes));
  PIMHBM_FFI_RETURN_IF_ERROR(check_count(kVerify, "chunk_base", chunk_base, 1));
  PIMHBM_FFI_RETURN_IF_ERROR(check_count(kVerify, "mismatch", *mismatch, t.nchunks));
  return launch(on, VerifyCall{x.untyped_data(), static_cast<int64_t>(x.size_bytes()), chunk_bytes,
                               static_cast<const uint32_t*>(expected.untyped_data()),
                               reinterpret_cast<uint8_t*>(mismatch->typed_data()),
                               chunk_base.typed_data()});
}

}  // namespace
}  // namespace pimhbm::scan

// x, chunk_base int32 (1,) -> digests uint32 (n, 2), nonfinite int32 (n,), max_abs float32 (n,)
#define PIMHBM_SCAN_BINDING(bind)                 \
  bind.Arg<::xla::ffi::AnyBuffer>()               \
      .Arg<::xla::ffi::Buffer<::xla::ffi::S32>>() \
      .Ret<::xla::ffi::AnyBuffer>()               \
      .Ret<::xla::ffi::Buffer<::xla::ffi::S32>>() \
      .Ret<::xla::ffi::Buffer<::xla::ffi::F32>>() \
      .Attr<int64_t>("chunk_bytes")
PIMHBM_FFI_HANDLERS(PimhbmScan, pimhbm::scan::scan_handler, PIMHBM_SCAN_BINDING,
                    PIMHBM_FFI_CAPTURABLE);

// x, expected digests, chunk_base int32 (1,) -> mismatch bool (n,)
#define PIMHBM_VERIFY_BINDING(bind)                \
  bind.Arg<::xla::ffi::AnyBuffer>()                \
      .Arg<::xla::ffi::AnyBuffer>()                \
      .Arg<::xla::ffi::Buffer<::xla::ffi::S32>>()  \
      .Ret<::xla::ffi::Buffer<::xla::ffi::PRED>>() \
      .Attr<int64_t>("chunk_bytes")
PIMHBM_FFI_HANDLERS(PimhbmVerify, pimhbm::scan::verify_handler, PIMHBM_VERIFY_BINDING,
                    PIMHBM_FFI_CAPTURABLE);
