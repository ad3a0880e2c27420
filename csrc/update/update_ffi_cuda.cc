// The CUDA launches of pimhbm_adamw / pimhbm_restore: kernels on XLA's stream, no
// synchronisation, no allocation.
#include "pimhbm/ffi_error.h"
#include "update/update_ffi.h"

namespace pimhbm::update {

ffi::Error launch(const ffi_util::OnCuda& on, const AdamWCall& c) {
  constexpr const char* kOp = "pimhbm.adamw";
  PIMHBM_FFI_RETURN_IF_ERROR(
      ffi_util::cuda_status(kOp, cudaMemsetAsync(c.totals, 0, 2 * sizeof(uint64_t), on.stream)));
  return ffi_util::cuda_status(
      kOp, adamw_cuda(c.leaves.data(), c.leaves.size(), c.hyper, c.step, on.stream));
}

ffi::Error launch(const ffi_util::OnCuda& on, const RestoreCall& c) {
  return ffi_util::cuda_status("pimhbm.restore", restore_cuda(c.commit, c.pairs, on.stream));
}

}  // namespace pimhbm::update
