// The CUDA launch of pimhbm_inject: one kernel on XLA's stream, the spec read on the device.
#include "faults/inject_ffi.h"
#include "pimhbm/ffi_error.h"

namespace pimhbm::faults {

ffi::Error launch(const ffi_util::OnCuda& on, const InjectCall& c) {
  return ffi_util::cuda_status("pimhbm.inject",
                               inject_cuda(c.data, c.nbytes, c.format, c.spec, on.stream));
}

}  // namespace pimhbm::faults
