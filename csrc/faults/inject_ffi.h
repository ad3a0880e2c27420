// XLA FFI handler of "pimhbm_inject": (x, spec int32[8]) -> x, in place (aliased): the fault
// of the spec (inject.h) applied to x. One handler for both platforms (inject_ffi.cc).
#pragma once

#include <cstdint>

#include "faults/inject.h"
#include "pimhbm/ffi_platform.h"
#include "xla/ffi/api/ffi.h"

namespace pimhbm::faults {

namespace ffi = xla::ffi;

// A checked call: the target's bytes, its float format, the spec.
struct InjectCall {
  uint8_t* data;
  int64_t nbytes;
  Format format;
  const int32_t* spec;
};

PIMHBM_FFI_DECLARE_LAUNCHES(InjectCall);

}  // namespace pimhbm::faults

PIMHBM_FFI_DECLARE_HANDLERS(PimhbmInject);
