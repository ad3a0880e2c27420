// The CUDA launches of the checks before the in-place update: pimhbm_inplace_precheck's kernel
// on XLA's stream; pimhbm_inplace_precheck_begin's on a side stream of the device
// (pimhbm/side_stream.h), and pimhbm_inplace_precheck_end's wait for it.
#include "pimhbm/cuda_check.h"
#include "pimhbm/ffi_error.h"
#include "pimhbm/side_stream.h"
#include "update/precheck_ffi.h"

namespace pimhbm::update {

ffi::Error launch(const ffi_util::OnCuda& on, const PrecheckCall& c) {
  return ffi_util::cuda_status("pimhbm.inplace_precheck",
                               precheck_cuda(c.leaves.data(), c.leaves.size(), on.stream));
}

namespace {

ffi_util::SideStreams& beside() {
  static auto* streams = new ffi_util::SideStreams();  // never destroyed: used at exit
  return *streams;
}

cudaError_t begin(cudaStream_t xla_stream, const PrecheckCall& c) {
  return beside().on_current_device([&](const ffi_util::SideStream& side) {
    PIMHBM_CUDA_RETURN_IF_ERROR(side.follow(xla_stream));
    PIMHBM_CUDA_RETURN_IF_ERROR(precheck_cuda(c.leaves.data(), c.leaves.size(), side.stream));
    return side.mark_done();
  });
}

// XLA's stream waits for this device's checks (none begun: nothing to wait for).
cudaError_t end(cudaStream_t xla_stream) {
  return beside().if_on_current_device(
      [&](const ffi_util::SideStream& side) { return side.join(xla_stream); });
}

}  // namespace

ffi::Error launch(const ffi_util::OnCuda& on, const BesideCall& c) {
  return ffi_util::cuda_status("pimhbm.inplace_precheck_begin", begin(on.stream, c.checks));
}

ffi::Error launch(const ffi_util::OnCuda& on, const EndOfChecks&) {
  return ffi_util::cuda_status("pimhbm.inplace_precheck_end", end(on.stream));
}

}  // namespace pimhbm::update
