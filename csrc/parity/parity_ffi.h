// XLA FFI handlers of the parity rows ("pimhbm_parity") and of a rebuild from them
// ("pimhbm_parity_rebuild"). One handler each for both platforms (parity_ffi.cc); the launches
// below are what differs.
#pragma once

#include <cstdint>
#include <vector>

#include "parity/parity.h"
#include "pimhbm/ffi_alias.h"
#include "pimhbm/ffi_platform.h"
#include "xla/ffi/api/ffi.h"

namespace pimhbm::parity {

namespace ffi = xla::ffi;

struct ParityCall {
  const uint8_t* data;
  int64_t nbytes, chunk_bytes, group;
  uint32_t* rows;
};

struct RebuildCall {
  Grouped tensor;
  const uint32_t* rows;
  const int32_t* list;
  int64_t count;
  int32_t* status;
};

PIMHBM_FFI_DECLARE_LAUNCHES(ParityCall);
PIMHBM_FFI_DECLARE_LAUNCHES(RebuildCall);

}  // namespace pimhbm::parity

PIMHBM_FFI_DECLARE_HANDLERS(PimhbmParity);
PIMHBM_FFI_DECLARE_HANDLERS(PimhbmParityRebuild);
