// The CUDA launch of pimhbm_inplace_precheck: its kernel on XLA's stream.
#include "pimhbm/ffi_error.h"
#include "update/precheck_ffi.h"

namespace pimhbm::update {

ffi::Error launch(const ffi_util::OnCuda& on, const PrecheckCall& c) {
  return ffi_util::cuda_status(
      "pimhbm.inplace_precheck",
      precheck_cuda(c.leaves.data(), c.leaves.size(), c.totals, on.stream));
}

}  // namespace pimhbm::update
