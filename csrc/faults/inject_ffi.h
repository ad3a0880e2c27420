// XLA FFI handler of "pimhbm_inject": (x, spec int32[8]) -> x, in place (aliased).
#pragma once

#include "faults/inject.h"
#include "pimhbm/ffi_util.h"
#include "xla/ffi/api/c_api.h"

namespace pimhbm::faults {

namespace ffi = xla::ffi;

// Checks the spec buffer; on success sets *format from x's dtype.
ffi::Error validate_inject(const ffi::AnyBuffer& x, const ffi::AnyBuffer& spec, Format* format);

}  // namespace pimhbm::faults

extern "C" {
XLA_FFI_Error* PimhbmInjectCpu(XLA_FFI_CallFrame* call_frame);
#if defined(PIMHBM_WITH_CUDA)
XLA_FFI_Error* PimhbmInjectCuda(XLA_FFI_CallFrame* call_frame);
#endif
}
