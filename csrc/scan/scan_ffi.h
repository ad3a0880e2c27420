// XLA FFI handlers of the scan op ("pimhbm_scan": per chunk of a tensor its digest, its NaN/Inf
// count and its largest |x|) and of the verify op ("pimhbm_verify": the chunks that do not match
// a digest table). One handler each for both platforms (scan_ffi.cc); the launches below are
// what differs.
#pragma once

#include <cstdint>

#include "pimhbm/elem.h"
#include "pimhbm/ffi_platform.h"
#include "xla/ffi/api/ffi.h"

namespace pimhbm::scan {

namespace ffi = xla::ffi;

// A checked call of pimhbm_scan.
struct ScanCall {
  const void* data;
  int64_t nbytes;
  Elem elem;
  int64_t chunk_bytes;
  uint32_t* digests;
  int32_t* nonfinite;
  float* max_abs;
  const int32_t* chunk_base;  // one int32, in the buffers' memory (scan.h)
};

// A checked call of pimhbm_verify.
struct VerifyCall {
  const void* data;
  int64_t nbytes;
  int64_t chunk_bytes;
  const uint32_t* expected;
  uint8_t* mismatch;
  const int32_t* chunk_base;
};

PIMHBM_FFI_DECLARE_LAUNCHES(ScanCall);
PIMHBM_FFI_DECLARE_LAUNCHES(VerifyCall);

}  // namespace pimhbm::scan

PIMHBM_FFI_DECLARE_HANDLERS(PimhbmScan);
PIMHBM_FFI_DECLARE_HANDLERS(PimhbmVerify);
