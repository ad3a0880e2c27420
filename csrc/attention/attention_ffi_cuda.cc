// The CUDA launches of pimhbm_attention_fwd / pimhbm_attention_bwd: kernels on XLA's stream.
#include "attention/attention_ffi.h"
#include "pimhbm/ffi_error.h"

namespace pimhbm::attention {

ffi::Error launch(const ffi_util::OnCuda& on, const Forward& c) {
  return ffi_util::cuda_status("pimhbm.attention", forward_cuda(c, on.stream));
}

ffi::Error launch(const ffi_util::OnCuda& on, const Backward& c) {
  return ffi_util::cuda_status("pimhbm.attention (backward)", backward_cuda(c, on.stream));
}

}  // namespace pimhbm::attention
