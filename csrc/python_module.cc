// The one compiled Python module, pimhbm._core: hands the FFI handlers to JAX.
// Every op has one target name for both platforms (cpu and CUDA).
#include <nanobind/nanobind.h>

#include "pimhbm/digest.h"
#include "scan/scan_ffi.h"
#include "update/update_ffi.h"

namespace nb = nanobind;

namespace {

template <typename Fn>
nb::capsule capsule(Fn* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

nb::dict registrations() {
  nb::dict cpu;
  cpu["pimhbm_scan"] = capsule(PimhbmScanCpu);
  cpu["pimhbm_verify"] = capsule(PimhbmVerifyCpu);
  cpu["pimhbm_adamw"] = capsule(PimhbmAdamWCpu);
  cpu["pimhbm_restore"] = capsule(PimhbmRestoreCpu);
  nb::dict out;
  out["cpu"] = cpu;
#if defined(PIMHBM_WITH_CUDA)
  nb::dict cuda;
  cuda["pimhbm_scan"] = capsule(PimhbmScanCuda);
  cuda["pimhbm_verify"] = capsule(PimhbmVerifyCuda);
  cuda["pimhbm_adamw"] = capsule(PimhbmAdamWCuda);
  cuda["pimhbm_restore"] = capsule(PimhbmRestoreCuda);
  out["CUDA"] = cuda;
#endif
  return out;
}

}  // namespace

NB_MODULE(_core, m) {
  m.doc() = "pim-hbm-bypass: FFI handlers (CPU and CUDA) for JAX";
  m.def("registrations", &registrations,
        "Map platform -> {target name -> FFI handler capsule}, for jax.ffi.register_ffi_target.");
#if defined(PIMHBM_WITH_CUDA)
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
  m.attr("default_chunk_bytes") = pimhbm::kDefaultChunkBytes;
  m.attr("chunk_align") = pimhbm::kChunkAlign;
}
