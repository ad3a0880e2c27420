// XLA FFI handlers of the chunk repairs -- "pimhbm_repair" (from a backup tensor) and
// "pimhbm_repair_packed" (from chunks received from another device) -- and of the device
// copy's commit-or-skip, "pimhbm_restore_clean". One handler each for both platforms
// (repair_ffi.cc); the launches below are what differs. The peer pull (peer/peer_ffi.h)
// launches the same repair.
#pragma once

#include <cstdint>
#include <vector>

#include "pimhbm/ffi_platform.h"
#include "repair/repair.h"
#include "xla/ffi/api/ffi.h"

namespace pimhbm::repair {

namespace ffi = xla::ffi;

// A checked repair: the listed chunks (int32, -1 = none), where each comes from, the target
// and its table, a status per entry.
struct RepairCall {
  const char* op;  // for errors: "pimhbm.repair"
  const int32_t* chunks;
  int64_t nlisted;
  Sources sources;
  MutableChunkedTensor dst;
  int32_t* status;
};

// A checked pimhbm_restore_clean: the commit flag (device or host memory) and every tensor.
struct CleanCall {
  const int32_t* commit;
  std::vector<CleanPair> pairs;
};

PIMHBM_FFI_DECLARE_LAUNCHES(RepairCall);
PIMHBM_FFI_DECLARE_LAUNCHES(CleanCall);

inline ChunkedTensor chunked(const ffi::AnyBuffer& data, const ffi::AnyBuffer& table,
                             int64_t chunk_bytes) {
  return {static_cast<const uint8_t*>(data.untyped_data()), static_cast<int64_t>(data.size_bytes()),
          chunk_bytes, static_cast<const uint32_t*>(table.untyped_data())};
}
inline MutableChunkedTensor mutable_chunked(ffi::AnyBuffer data, ffi::AnyBuffer table,
                                            int64_t chunk_bytes) {
  return {static_cast<uint8_t*>(data.untyped_data()), static_cast<int64_t>(data.size_bytes()),
          chunk_bytes, static_cast<uint32_t*>(table.untyped_data())};
}

}  // namespace pimhbm::repair

PIMHBM_FFI_DECLARE_HANDLERS(PimhbmRepair);
PIMHBM_FFI_DECLARE_HANDLERS(PimhbmRepairPacked);
PIMHBM_FFI_DECLARE_HANDLERS(PimhbmRestoreClean);
