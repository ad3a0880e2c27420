// XLA FFI handlers of the checks before the in-place update, one handler each for both
// platforms (precheck_ffi.cc).
//
// "pimhbm_inplace_precheck": operands, for each leaf, p (float32 or bfloat16), p's digest table
// (uint32 (chunks, 2)), the gradient (p's dtype and size) and chunk_base (int32 (1,),
// precheck.h). Results: for each leaf, damaged and nonfinite, int32 (chunks,) each (precheck.h).
// Attribute: chunk_elems. On XLA's stream, capturable into a command buffer.
//
// "pimhbm_inplace_precheck_begin": the same checks, run beside XLA's work: on the GPU on a side
// stream of the device (the lowest priority: it fills what XLA's kernels leave free) once
// XLA's stream reaches the op. Its results may be read only after
// "pimhbm_inplace_precheck_end": (buffers...) -> the same buffers (aliased), once every check
// begun before it on the device is done. On the host, begin checks at once and end passes
// its buffers through.
#pragma once

#include <cstdint>
#include <vector>

#include "pimhbm/ffi_platform.h"
#include "update/precheck.h"
#include "xla/ffi/api/ffi.h"

namespace pimhbm::update {

namespace ffi = xla::ffi;

inline constexpr int kPrecheckLeafOperands = 4;  // p, d_p, g, chunk_base
inline constexpr int kPrecheckLeafResults = 2;   // damaged, nonfinite

struct PrecheckCall {
  std::vector<PrecheckLeaf> leaves;
};

PIMHBM_FFI_DECLARE_LAUNCHES(PrecheckCall);

// The side stream's launch (begin) and XLA's stream's wait for it (end).
struct BesideCall {
  PrecheckCall checks;
};
struct EndOfChecks {};
PIMHBM_FFI_DECLARE_LAUNCHES(BesideCall);
PIMHBM_FFI_DECLARE_LAUNCHES(EndOfChecks);

}  // namespace pimhbm::update

PIMHBM_FFI_DECLARE_HANDLERS(PimhbmInPlacePrecheck);
PIMHBM_FFI_DECLARE_HANDLERS(PimhbmInPlacePrecheckBegin);
PIMHBM_FFI_DECLARE_HANDLERS(PimhbmInPlacePrecheckEnd);
