// CUDA handlers of pimhbm_scan / pimhbm_verify: same checks as the CPU handlers, kernels on
// XLA's stream, no synchronisation, no allocation (so they can be captured in CUDA graphs).
#include <string>

#include "pimhbm/cuda_check.h"
#include "scan/scan.h"
#include "scan/scan_ffi.h"

namespace pimhbm::scan {
namespace {

ffi::Error scan_cuda_impl(cudaStream_t stream, ffi::AnyBuffer x,
                          ffi::Result<ffi::AnyBuffer> digests,
                          ffi::Result<ffi::AnyBuffer> nonfinite,
                          ffi::Result<ffi::AnyBuffer> max_abs, int64_t chunk_bytes) {
  Elem elem;
  PIMHBM_FFI_RETURN_IF_ERROR(validate_scan(x, *digests, *nonfinite, *max_abs, chunk_bytes, &elem));
  cudaError_t err = scan_cuda(x.untyped_data(), static_cast<int64_t>(x.size_bytes()), elem,
                              chunk_bytes, static_cast<uint32_t*>(digests->untyped_data()),
                              static_cast<int32_t*>(nonfinite->untyped_data()),
                              static_cast<float*>(max_abs->untyped_data()), stream);
  return ffi_util::cuda_status("pimhbm.scan", err);
}

ffi::Error verify_cuda_impl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer expected,
                            ffi::Result<ffi::AnyBuffer> mismatch, int64_t chunk_bytes) {
  PIMHBM_FFI_RETURN_IF_ERROR(validate_verify(x, expected, *mismatch, chunk_bytes));
  cudaError_t err = verify_cuda(x.untyped_data(), static_cast<int64_t>(x.size_bytes()), chunk_bytes,
                                static_cast<const uint32_t*>(expected.untyped_data()),
                                static_cast<uint8_t*>(mismatch->untyped_data()), stream);
  return ffi_util::cuda_status("pimhbm.verify", err);
}

}  // namespace
}  // namespace pimhbm::scan

XLA_FFI_DEFINE_HANDLER_SYMBOL(PimhbmScanCuda, pimhbm::scan::scan_cuda_impl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Attr<int64_t>("chunk_bytes"),
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(PimhbmVerifyCuda, pimhbm::scan::verify_cuda_impl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Attr<int64_t>("chunk_bytes"),
                              {xla::ffi::Traits::kCmdBufferCompatible});
