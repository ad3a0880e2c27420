// The CUDA launches of pimhbm_parity / pimhbm_parity_rebuild: kernels on XLA's stream.
#include "parity/parity_ffi.h"
#include "pimhbm/ffi_error.h"

namespace pimhbm::parity {

ffi::Error launch(const ffi_util::OnCuda& on, const ParityCall& c) {
  return ffi_util::cuda_status(
      "pimhbm.parity", parity_cuda(c.data, c.nbytes, c.chunk_bytes, c.group, c.rows, on.stream));
}

ffi::Error launch(const ffi_util::OnCuda& on, const RebuildCall& c) {
  return ffi_util::cuda_status("pimhbm.parity_rebuild",
                               rebuild_cuda(c.tensor, c.rows, c.list, c.count, c.status, on.stream));
}

}  // namespace pimhbm::parity
