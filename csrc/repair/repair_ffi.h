// XLA FFI handlers of "pimhbm_repair" and "pimhbm_restore_clean".
#pragma once

#include <vector>

#include "pimhbm/ffi_alias.h"
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

// Checks (chunks, rows, row_table, dst, dst_table, status) of pimhbm_repair_packed: rows holds
// one chunk per listed entry (chunk_bytes apart, dst's dtype), row_table its digest rows.
ffi::Error validate_repair_packed(const ffi::AnyBuffer& chunks, const ffi::AnyBuffer& rows,
                                  const ffi::AnyBuffer& row_table, const ffi::AnyBuffer& dst,
                                  const ffi::AnyBuffer& dst_table, const ffi::AnyBuffer& status,
                                  int64_t chunk_bytes);

// Sources for a packed repair: the received rows and their digests, one source.
inline Sources packed_sources(const ffi::AnyBuffer& rows, const ffi::AnyBuffer& row_table,
                              int64_t chunk_bytes) {
  Sources s{};
  s.tensor[0] = {static_cast<const uint8_t*>(rows.untyped_data()),
                 static_cast<int64_t>(rows.size_bytes()), chunk_bytes,
                 static_cast<const uint32_t*>(row_table.untyped_data())};
  s.count = 1;
  s.which = nullptr;
  s.self = -1;
  s.packed = true;
  return s;
}

// pimhbm_restore_clean takes the commit flag, then per tensor (faults, src, src_table, dst,
// dst_table) and returns per tensor (dst, dst_table), aliased; chunk_bytes: one per tensor.
// Checks the whole call and lists the tensors, and the results XLA did not alias with their
// operands (ffi_alias.h).
ffi::Error validate_restore_clean(const ffi::AnyBuffer& commit, const ffi::RemainingArgs& args,
                                  const ffi::RemainingRets& rets,
                                  ffi::Span<const int64_t> chunk_bytes,
                                  std::vector<CleanPair>* pairs,
                                  std::vector<ffi_util::Unaliased>* copies);

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
XLA_FFI_Error* PimhbmRepairPackedCpu(XLA_FFI_CallFrame* call_frame);
#if defined(PIMHBM_WITH_CUDA)
XLA_FFI_Error* PimhbmRepairPackedCuda(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* PimhbmRepairCuda(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* PimhbmRestoreCleanCuda(XLA_FFI_CallFrame* call_frame);
#endif
}
