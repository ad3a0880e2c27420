// The CUDA launches of the chunk repairs and of pimhbm_restore_clean: kernels on XLA's stream,
// no synchronisation, no allocation.
#include "pimhbm/ffi_error.h"
#include "repair/repair_ffi.h"

namespace pimhbm::repair {

ffi::Error launch(const ffi_util::OnCuda& on, const RepairCall& c) {
  return ffi_util::cuda_status(
      c.op, repair_from_cuda(c.chunks, c.nlisted, c.sources, c.dst, c.status, on.stream));
}

ffi::Error launch(const ffi_util::OnCuda& on, const CleanCall& c) {
  return ffi_util::cuda_status(
      "pimhbm.restore_clean",
      restore_clean_cuda(c.commit, c.pairs.data(), c.pairs.size(), on.stream));
}

}  // namespace pimhbm::repair
