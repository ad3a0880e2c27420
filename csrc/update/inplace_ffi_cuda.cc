// The CUDA launches of pimhbm_adamw_inplace / pimhbm_adamw_redo: kernels on XLA's stream.
#include "pimhbm/ffi_error.h"
#include "update/inplace_ffi.h"

namespace pimhbm::update {

ffi::Error launch(const ffi_util::OnCuda& on, const InPlaceCall& c) {
  if (c.is_redo) {
    return ffi_util::cuda_status("pimhbm.adamw_redo",
                                 redo_cuda(c.leaves.data(), c.leaves.size(), c.hyper, c.step,
                                           c.redo, c.totals, on.stream));
  }
  return ffi_util::cuda_status("pimhbm.adamw_inplace",
                               inplace_cuda(c.leaves.data(), c.leaves.size(), c.hyper, c.step,
                                            c.go, c.stash, c.totals, on.stream));
}

}  // namespace pimhbm::update
