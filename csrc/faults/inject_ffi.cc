#include "faults/inject_ffi.h"

#include "pimhbm/ffi_alias.h"

namespace pimhbm::faults {

ffi::Error validate_inject(const ffi::AnyBuffer& x, const ffi::AnyBuffer& spec, Format* format) {
  PIMHBM_FFI_RETURN_IF_ERROR(
      ffi_util::check_buffer("pimhbm.inject", "fault spec", spec, ffi::DataType::S32, 8));
  switch (x.element_type()) {
    case ffi::DataType::F32:
      *format = kFloat32;
      break;
    case ffi::DataType::BF16:
      *format = kBFloat16;
      break;
    case ffi::DataType::F16:
      *format = kFloat16;
      break;
    case ffi::DataType::F64:
      *format = kFloat64;
      break;
    default:
      *format = kRawBytes;
      break;
  }
  return ffi::Error::Success();
}

namespace {

ffi::Error inject_cpu_impl(ffi::AnyBuffer x_in, ffi::AnyBuffer spec,
                           ffi::Result<ffi::AnyBuffer> x) {
  Format format;
  PIMHBM_FFI_RETURN_IF_ERROR(validate_inject(*x, spec, &format));
  ffi_util::copy_unaliased_cpu(ffi_util::unaliased("pimhbm.inject", {{x_in, *x}}));
  inject_cpu(static_cast<uint8_t*>(x->untyped_data()), static_cast<int64_t>(x->size_bytes()),
             format, static_cast<const int32_t*>(spec.untyped_data()));
  return ffi::Error::Success();
}

}  // namespace
}  // namespace pimhbm::faults

XLA_FFI_DEFINE_HANDLER_SYMBOL(PimhbmInjectCpu, pimhbm::faults::inject_cpu_impl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>());
