// XLA FFI handlers of "pimhbm_repair" and "pimhbm_restore_clean".
#pragma once

#include "pimhbm/ffi_util.h"
#include "repair/repair.h"
#include "xla/ffi/api/c_api.h"

namespace pimhbm::repair {

namespace ffi = xla::ffi;

// Checks (chunks, src, src_table, dst, dst_table, status) of pimhbm_repair.
ffi::Error validate_repair(const ffi::AnyBuffer& chunks, const ffi::AnyBuffer& src,
                           const ffi::AnyBuffer& src_table, const ffi::AnyBuffer& dst,
                           const ffi::AnyBuffer& dst_table, const ffi::AnyBuffer& status,
                           int64_t chunk_bytes);

// Checks (commit, faults, src, src_table, dst, dst_table) of pimhbm_restore_clean.
ffi::Error validate_restore_clean(const ffi::AnyBuffer& commit, const ffi::AnyBuffer& faults,
                                  const ffi::AnyBuffer& src, const ffi::AnyBuffer& src_table,
                                  const ffi::AnyBuffer& dst, const ffi::AnyBuffer& dst_table,
                                  int64_t chunk_bytes);

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

extern "C" {
XLA_FFI_Error* PimhbmRepairCpu(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* PimhbmRestoreCleanCpu(XLA_FFI_CallFrame* call_frame);
#if defined(PIMHBM_WITH_CUDA)
XLA_FFI_Error* PimhbmRepairCuda(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* PimhbmRestoreCleanCuda(XLA_FFI_CallFrame* call_frame);
#endif
}
