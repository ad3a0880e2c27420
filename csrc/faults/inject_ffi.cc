// The handler of pimhbm_inject for both platforms, and its CPU launch.
#include "faults/inject_ffi.h"

#include "pimhbm/ffi_alias.h"
#include "pimhbm/ffi_util.h"

namespace pimhbm::faults {

ffi::Error launch(ffi_util::OnCpu, const InjectCall& c) {
  inject_cpu(c.data, c.nbytes, c.format, c.spec);
  return ffi::Error::Success();
}

namespace {

constexpr const char* kInject = "pimhbm.inject";

// How kNonFinite writes into elements of this dtype (others: as raw bytes).
Format format_of(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32:
      return kFloat32;
    case ffi::DataType::BF16:
      return kBFloat16;
    case ffi::DataType::F16:
      return kFloat16;
    case ffi::DataType::F64:
      return kFloat64;
    default:
      return kRawBytes;
  }
}

template <typename Platform>
ffi::Error inject_handler(Platform on, ffi::AnyBuffer x_in, ffi::Buffer<ffi::S32, 1> spec,
                          ffi::Result<ffi::AnyBuffer> x) {
  PIMHBM_FFI_RETURN_IF_ERROR(ffi_util::check_count(kInject, "fault spec", spec, 8));
  PIMHBM_FFI_RETURN_IF_ERROR(
      ffi_util::copy_unaliased(on, ffi_util::unaliased(kInject, {{x_in, *x}})));
  return launch(on, InjectCall{static_cast<uint8_t*>(x->untyped_data()),
                               static_cast<int64_t>(x->size_bytes()), format_of(x->element_type()),
                               spec.typed_data()});
}

}  // namespace
}  // namespace pimhbm::faults

// x, spec int32[8] -> x (aliased)
#define PIMHBM_INJECT_BINDING(bind)                  \
  bind.Arg<::xla::ffi::AnyBuffer>()                  \
      .Arg<::xla::ffi::Buffer<::xla::ffi::S32, 1>>() \
      .Ret<::xla::ffi::AnyBuffer>()
PIMHBM_FFI_HANDLERS(PimhbmInject, pimhbm::faults::inject_handler, PIMHBM_INJECT_BINDING,
                    PIMHBM_FFI_CAPTURABLE);
