#include <string>
#include <vector>

#include "pimhbm/ffi_alias_cuda.h"
#include "repair/repair_ffi.h"

namespace pimhbm::repair {
namespace {

ffi::Error repair_cuda_impl(cudaStream_t stream, ffi::AnyBuffer chunks, ffi::AnyBuffer src,
                            ffi::AnyBuffer src_table, ffi::AnyBuffer dst_in,
                            ffi::AnyBuffer dst_table_in, ffi::Result<ffi::AnyBuffer> dst,
                            ffi::Result<ffi::AnyBuffer> dst_table,
                            ffi::Result<ffi::AnyBuffer> status, int64_t chunk_bytes) {
  PIMHBM_FFI_RETURN_IF_ERROR(
      validate_repair(chunks, src, src_table, *dst, *dst_table, *status, chunk_bytes));
  cudaError_t err = ffi_util::copy_unaliased_cuda(
      ffi_util::unaliased("pimhbm.repair", {{dst_in, *dst}, {dst_table_in, *dst_table}}), stream);
  if (err == cudaSuccess)
    err = repair_cuda(static_cast<const int32_t*>(chunks.untyped_data()),
                      static_cast<int64_t>(chunks.element_count()),
                      chunked(src, src_table, chunk_bytes),
                      mutable_chunked(*dst, *dst_table, chunk_bytes),
                      static_cast<int32_t*>(status->untyped_data()), stream);
  return ffi_util::cuda_status("pimhbm.repair", err);
}

ffi::Error restore_clean_cuda_impl(cudaStream_t stream, ffi::AnyBuffer commit,
                                   ffi::RemainingArgs args, ffi::RemainingRets rets,
                                   ffi::Span<const int64_t> chunk_bytes) {
  std::vector<CleanPair> pairs;
  std::vector<ffi_util::Unaliased> copies;
  PIMHBM_FFI_RETURN_IF_ERROR(
      validate_restore_clean(commit, args, rets, chunk_bytes, &pairs, &copies));
  cudaError_t err = ffi_util::copy_unaliased_cuda(copies, stream);
  if (err == cudaSuccess)
    err = restore_clean_cuda(static_cast<const int32_t*>(commit.untyped_data()), pairs.data(),
                             pairs.size(), stream);
  return ffi_util::cuda_status("pimhbm.restore_clean", err);
}

ffi::Error repair_packed_cuda_impl(cudaStream_t stream, ffi::AnyBuffer chunks, ffi::AnyBuffer rows,
                                   ffi::AnyBuffer row_table, ffi::AnyBuffer dst_in,
                                   ffi::AnyBuffer dst_table_in, ffi::Result<ffi::AnyBuffer> dst,
                                   ffi::Result<ffi::AnyBuffer> dst_table,
                                   ffi::Result<ffi::AnyBuffer> status, int64_t chunk_bytes) {
  PIMHBM_FFI_RETURN_IF_ERROR(
      validate_repair_packed(chunks, rows, row_table, *dst, *dst_table, *status, chunk_bytes));
  cudaError_t err = ffi_util::copy_unaliased_cuda(
      ffi_util::unaliased("pimhbm.repair_packed", {{dst_in, *dst}, {dst_table_in, *dst_table}}),
      stream);
  if (err == cudaSuccess)
    err = repair_from_cuda(static_cast<const int32_t*>(chunks.untyped_data()),
                           static_cast<int64_t>(chunks.element_count()),
                           packed_sources(rows, row_table, chunk_bytes),
                           mutable_chunked(*dst, *dst_table, chunk_bytes),
                           static_cast<int32_t*>(status->untyped_data()), stream);
  return ffi_util::cuda_status("pimhbm.repair_packed", err);
}

}  // namespace
}  // namespace pimhbm::repair

XLA_FFI_DEFINE_HANDLER_SYMBOL(PimhbmRepairPackedCuda, pimhbm::repair::repair_packed_cuda_impl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Attr<int64_t>("chunk_bytes"),
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(PimhbmRepairCuda, pimhbm::repair::repair_cuda_impl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Attr<int64_t>("chunk_bytes"),
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(PimhbmRestoreCleanCuda, pimhbm::repair::restore_clean_cuda_impl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<xla::ffi::Span<const int64_t>>("chunk_bytes"),
                              {xla::ffi::Traits::kCmdBufferCompatible});
