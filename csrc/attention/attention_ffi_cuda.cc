// The CUDA launches of pimhbm_attention_fwd / pimhbm_attention_bwd: kernels on XLA's stream --
// Hopper's warpgroup products where the build has them, the device is sm_90 and the head dim
// theirs; the mma.sync kernels otherwise.
#include "attention/attention_ffi.h"
#include "pimhbm/cuda_check.h"
#include "pimhbm/ffi_error.h"
#if defined(PIMHBM_WITH_WGMMA)
#include "attention/attention_wgmma.h"
#endif

namespace pimhbm::attention {
namespace {

#if defined(PIMHBM_WITH_WGMMA)
// The forward schedule taken: the two measured alike (scores-ahead 1.386 ms, serial 1.389 at
// 4k; 4.941 and 4.937 at 16k: bench/NOTES.md, "Runs 148-149"); its overlap is what a ping-pong
// of the two warpgroups would build on.
constexpr WgmmaSchedule kForwardSchedule = WgmmaSchedule::kScoresAhead;
#endif

cudaError_t forward_on_device(const Forward& c, cudaStream_t stream) {
#if defined(PIMHBM_WITH_WGMMA)
  bool wgmma = false;
  PIMHBM_CUDA_RETURN_IF_ERROR(wgmma_takes(c.shape.head_dim, &wgmma));
  if (wgmma) return forward_wgmma(c, kForwardSchedule, stream);
#endif
  return forward_cuda(c, stream);
}

cudaError_t backward_on_device(const Backward& c, cudaStream_t stream) {
#if defined(PIMHBM_WITH_WGMMA)
  bool wgmma = false;
  PIMHBM_CUDA_RETURN_IF_ERROR(wgmma_takes(c.shape.head_dim, &wgmma));
  if (wgmma) return backward_wgmma(c, stream);
#endif
  return backward_cuda(c, stream);
}

}  // namespace

ffi::Error launch(const ffi_util::OnCuda& on, const Forward& c) {
  return ffi_util::cuda_status("pimhbm.attention", forward_on_device(c, on.stream));
}

ffi::Error launch(const ffi_util::OnCuda& on, const Backward& c) {
  return ffi_util::cuda_status("pimhbm.attention (backward)", backward_on_device(c, on.stream));
}

}  // namespace pimhbm::attention
