// XLA FFI handlers of the scan op ("pimhbm_scan") and the verify op ("pimhbm_verify").
#pragma once

#include <cstdint>

#include "pimhbm/ffi_util.h"
#include "xla/ffi/api/c_api.h"

namespace pimhbm::scan {

namespace ffi = xla::ffi;

// Checks the arguments of pimhbm_scan; on success sets *elem.
ffi::Error validate_scan(const ffi::AnyBuffer& x, const ffi::AnyBuffer& digests,
                         const ffi::AnyBuffer& nonfinite, const ffi::AnyBuffer& max_abs,
                         int64_t chunk_bytes, Elem* elem);

// Checks the arguments of pimhbm_verify.
ffi::Error validate_verify(const ffi::AnyBuffer& x, const ffi::AnyBuffer& expected,
                           const ffi::AnyBuffer& mismatch, int64_t chunk_bytes);

}  // namespace pimhbm::scan

extern "C" {
XLA_FFI_Error* PimhbmScanCpu(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* PimhbmVerifyCpu(XLA_FFI_CallFrame* call_frame);
#if defined(PIMHBM_WITH_CUDA)
XLA_FFI_Error* PimhbmScanCuda(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* PimhbmVerifyCuda(XLA_FFI_CallFrame* call_frame);
#endif
}
