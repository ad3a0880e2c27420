// XLA FFI handler of the fault lists ("pimhbm_fault_list"), one handler for both platforms
// (fault_list_ffi.cc).
//
// Operands: the per-chunk maps, int32 of any shape each (read flat, one after another).
// Results: index and value, int32 (capacity,) each; totals, uint32 (2, 2) (two 64-bit counters
// as low and high words, fault_list.h); scratch, uint8 (range_count * sizeof(Range),): the
// counting launch's table on a GPU (untouched on the CPU).
#pragma once

#include <cstdint>
#include <vector>

#include "pimhbm/ffi_platform.h"
#include "summary/fault_list.h"
#include "xla/ffi/api/ffi.h"

namespace pimhbm::summary {

namespace ffi = xla::ffi;

inline constexpr int kFaultListResults = 4;  // index, value, totals, scratch

struct FaultListCall {
  std::vector<MapView> maps;
  ListOut out;
  Range* scratch;
};

PIMHBM_FFI_DECLARE_LAUNCHES(FaultListCall);

}  // namespace pimhbm::summary

PIMHBM_FFI_DECLARE_HANDLERS(PimhbmFaultList);
