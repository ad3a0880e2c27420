// The CUDA launches of pimhbm_scan / pimhbm_verify: kernels on XLA's stream, no
// synchronisation, no allocation (so that they can be captured into CUDA graphs).
#include "pimhbm/ffi_error.h"
#include "scan/scan.h"
#include "scan/scan_ffi.h"

namespace pimhbm::scan {

ffi::Error launch(const ffi_util::OnCuda& on, const ScanCall& c) {
  return ffi_util::cuda_status(
      "pimhbm.scan", scan_cuda(c.data, c.nbytes, c.elem, c.chunk_bytes, c.digests, c.nonfinite,
                               c.max_abs, on.stream, c.chunk_base));
}

ffi::Error launch(const ffi_util::OnCuda& on, const VerifyCall& c) {
  return ffi_util::cuda_status("pimhbm.verify", verify_cuda(c.data, c.nbytes, c.chunk_bytes,
                                                            c.expected, c.mismatch, on.stream,
                                                            c.chunk_base));
}

}  // namespace pimhbm::scan
