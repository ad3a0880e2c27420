// XLA FFI handler of the checks before the in-place update ("pimhbm_inplace_precheck"), one
// handler for both platforms (precheck_ffi.cc).
//
// Operands: for each leaf, p (float32 or bfloat16), p's digest table (uint32 (chunks, 2)), the
// gradient (p's dtype and size) and chunk_base (int32 (1,), precheck.h). Results: for each leaf,
// damaged and nonfinite, int32 (chunks,) each; after the leaves', the totals, uint32 (2, 2): two
// 64-bit counters as low and high words (precheck.h). Attributes: chunk_elems, gradients
// (false: no gradient operand a leaf, p's digests alone, every nonfinite map 0).
#pragma once

#include <cstdint>
#include <vector>

#include "pimhbm/ffi_platform.h"
#include "update/precheck.h"
#include "xla/ffi/api/ffi.h"

namespace pimhbm::update {

namespace ffi = xla::ffi;

inline constexpr int kPrecheckLeafResults = 2;   // damaged, nonfinite

struct PrecheckCall {
  std::vector<PrecheckLeaf> leaves;
  uint64_t* totals;  // kPrecheckTotals counters
};

PIMHBM_FFI_DECLARE_LAUNCHES(PrecheckCall);

}  // namespace pimhbm::update

PIMHBM_FFI_DECLARE_HANDLERS(PimhbmInPlacePrecheck);
