#include <string>

#include "faults/inject_ffi.h"
#include "pimhbm/ffi_alias_cuda.h"

namespace pimhbm::faults {
namespace {

ffi::Error inject_cuda_impl(cudaStream_t stream, ffi::AnyBuffer x_in, ffi::AnyBuffer spec,
                            ffi::Result<ffi::AnyBuffer> x) {
  Format format;
  PIMHBM_FFI_RETURN_IF_ERROR(validate_inject(*x, spec, &format));
  cudaError_t err =
      ffi_util::copy_unaliased_cuda(ffi_util::unaliased("pimhbm.inject", {{x_in, *x}}), stream);
  if (err == cudaSuccess)
    err =
        inject_cuda(static_cast<uint8_t*>(x->untyped_data()), static_cast<int64_t>(x->size_bytes()),
                    format, static_cast<const int32_t*>(spec.untyped_data()), stream);
  return ffi_util::cuda_status("pimhbm.inject", err);
}

}  // namespace
}  // namespace pimhbm::faults

XLA_FFI_DEFINE_HANDLER_SYMBOL(PimhbmInjectCuda, pimhbm::faults::inject_cuda_impl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>(),
                              {xla::ffi::Traits::kCmdBufferCompatible});
