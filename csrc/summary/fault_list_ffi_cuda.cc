// The CUDA launch of pimhbm_fault_list: its two kernels on XLA's stream.
#include "pimhbm/ffi_error.h"
#include "summary/fault_list_ffi.h"

namespace pimhbm::summary {

ffi::Error launch(const ffi_util::OnCuda& on, const FaultListCall& c) {
  return ffi_util::cuda_status("pimhbm.fault_list", fault_list_cuda(c.maps.data(), c.maps.size(),
                                                                    c.scratch, c.out, on.stream));
}

}  // namespace pimhbm::summary
