// Where an FFI handler runs, and the one place that binds an op's handler for both platforms.
//
// Every op has one handler, a function template over the platform. Its first argument says
// where it runs: OnCpu (host memory, now) or OnCuda (XLA's CUDA stream). XLA decodes it like
// any other context (the CtxDecoding specializations below), so one description of the op's
// arguments, results and attributes serves both platforms; what differs between them -- the
// kernel launch, a copy -- is an overload on that first argument, the CUDA ones in the op's
// *_ffi_cuda.cc. PIMHBM_FFI_HANDLERS defines the op's C symbols (PimhbmScanCpu and, with CUDA,
// PimhbmScanCuda) from that one description; python_module.cc registers them under one name.
#pragma once

#include <optional>

#include "xla/ffi/api/ffi.h"

#if defined(PIMHBM_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace pimhbm::ffi_util {

struct OnCpu {};

#if defined(PIMHBM_WITH_CUDA)
struct OnCuda {
  cudaStream_t stream;  // XLA's stream for the op: kernels and copies go there, in order
};
#endif

}  // namespace pimhbm::ffi_util

namespace xla::ffi {

template <>
struct CtxDecoding<pimhbm::ffi_util::OnCpu> {
  using Type = pimhbm::ffi_util::OnCpu;
  static std::optional<Type> Decode(const XLA_FFI_Api*, XLA_FFI_InvokeContext*, DiagnosticEngine&) {
    return Type{};
  }
};

#if defined(PIMHBM_WITH_CUDA)
template <>
struct CtxDecoding<pimhbm::ffi_util::OnCuda> {
  using Type = pimhbm::ffi_util::OnCuda;
  static std::optional<Type> Decode(const XLA_FFI_Api* api, XLA_FFI_InvokeContext* ctx,
                                    DiagnosticEngine& diagnostic) {
    auto stream = CtxDecoding<PlatformStream<cudaStream_t>>::Decode(api, ctx, diagnostic);
    if (!stream) return std::nullopt;
    return Type{*stream};
  }
};
#endif

}  // namespace xla::ffi

// The CUDA handler's traits: capturable into an XLA command buffer (a CUDA graph) -- the
// handler only enqueues work on XLA's stream -- or not (it meets peers or waits on the host).
// clang-format off
#define PIMHBM_FFI_CAPTURABLE {::xla::ffi::Traits::kCmdBufferCompatible}
#define PIMHBM_FFI_NOT_CAPTURABLE {}
// clang-format on

// Defines name##Cpu and, with CUDA, name##Cuda: handler<OnCpu> / handler<OnCuda> bound by
// binding(start), a macro that continues the chain `start` (Ffi::Bind() with the platform
// decoded first) with the op's arguments, results and attributes.
#define PIMHBM_FFI_CPU_HANDLER_(name, handler, binding)                        \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name##Cpu, handler<::pimhbm::ffi_util::OnCpu>, \
                                binding(::xla::ffi::Ffi::Bind().Ctx<::pimhbm::ffi_util::OnCpu>()))
#if defined(PIMHBM_WITH_CUDA)
#define PIMHBM_FFI_HANDLERS(name, handler, binding, cuda_traits) \
  PIMHBM_FFI_CPU_HANDLER_(name, handler, binding);               \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(                                 \
      name##Cuda, handler<::pimhbm::ffi_util::OnCuda>,           \
      binding(::xla::ffi::Ffi::Bind().Ctx<::pimhbm::ffi_util::OnCuda>()), cuda_traits)
#else
#define PIMHBM_FFI_HANDLERS(name, handler, binding, cuda_traits) \
  PIMHBM_FFI_CPU_HANDLER_(name, handler, binding)
#endif

// Declares an op's launches of a checked call (a struct of the op's): launch(OnCpu, call) in
// the op's *_ffi.cc and, with CUDA, launch(OnCuda, call) in its *_ffi_cuda.cc.
#if defined(PIMHBM_WITH_CUDA)
#define PIMHBM_FFI_DECLARE_LAUNCHES(Call)                                \
  ::xla::ffi::Error launch(::pimhbm::ffi_util::OnCpu, const Call& call); \
  ::xla::ffi::Error launch(const ::pimhbm::ffi_util::OnCuda& on, const Call& call)
#else
#define PIMHBM_FFI_DECLARE_LAUNCHES(Call) \
  ::xla::ffi::Error launch(::pimhbm::ffi_util::OnCpu, const Call& call)
#endif

// Declares the C symbols PIMHBM_FFI_HANDLERS defines.
#if defined(PIMHBM_WITH_CUDA)
#define PIMHBM_FFI_DECLARE_HANDLERS(name)    \
  XLA_FFI_DECLARE_HANDLER_SYMBOL(name##Cpu); \
  XLA_FFI_DECLARE_HANDLER_SYMBOL(name##Cuda)
#else
#define PIMHBM_FFI_DECLARE_HANDLERS(name) XLA_FFI_DECLARE_HANDLER_SYMBOL(name##Cpu)
#endif
