// CUDA handlers of pimhbm_adamw / pimhbm_restore: the same checks as on the CPU, kernels on
// XLA's stream, no synchronisation, no allocation.
#include <string>

#include "update/update_ffi.h"

namespace pimhbm::update {
namespace {

ffi::Error cuda_error(const char* op, cudaError_t err) {
  return ffi::Error::Internal(std::string(op) + ": CUDA error: " + cudaGetErrorString(err));
}

ffi::Error adamw_cuda_impl(cudaStream_t stream, ffi::AnyBuffer p, ffi::AnyBuffer master,
                           ffi::AnyBuffer mu, ffi::AnyBuffer nu, ffi::AnyBuffer g,
                           ffi::AnyBuffer d_p, ffi::AnyBuffer d_master, ffi::AnyBuffer d_mu,
                           ffi::AnyBuffer d_nu, ffi::AnyBuffer, ffi::AnyBuffer, ffi::AnyBuffer,
                           ffi::AnyBuffer, ffi::AnyBuffer, ffi::AnyBuffer, ffi::AnyBuffer,
                           ffi::AnyBuffer, ffi::AnyBuffer, ffi::AnyBuffer, ffi::AnyBuffer,
                           ffi::AnyBuffer, ffi::AnyBuffer, ffi::AnyBuffer, ffi::AnyBuffer,
                           ffi::AnyBuffer, ffi::AnyBuffer step,
                           ffi::Result<ffi::AnyBuffer> p_out,
                           ffi::Result<ffi::AnyBuffer> master_out,
                           ffi::Result<ffi::AnyBuffer> mu_out,
                           ffi::Result<ffi::AnyBuffer> nu_out, ffi::Result<ffi::AnyBuffer> dn_p,
                           ffi::Result<ffi::AnyBuffer> dn_master,
                           ffi::Result<ffi::AnyBuffer> dn_mu, ffi::Result<ffi::AnyBuffer> dn_nu,
                           ffi::Result<ffi::AnyBuffer> p_m, ffi::Result<ffi::AnyBuffer> master_m,
                           ffi::Result<ffi::AnyBuffer> mu_m, ffi::Result<ffi::AnyBuffer> nu_m,
                           ffi::Result<ffi::AnyBuffer> dm_p,
                           ffi::Result<ffi::AnyBuffer> dm_master,
                           ffi::Result<ffi::AnyBuffer> dm_mu, ffi::Result<ffi::AnyBuffer> dm_nu,
                           ffi::Result<ffi::AnyBuffer> faults,
                           ffi::Result<ffi::AnyBuffer> grad_nonfinite, int64_t chunk_elems,
                           float b1, float b2, float omb1, float omb2, float eps,
                           float eps_root, float wd) {
  AdamWBuffers b{p,     master,   mu,    nu,        g,     d_p,   d_master, d_mu,
                 d_nu,  step,     p_out, master_out, mu_out, nu_out, dn_p,   dn_master,
                 dn_mu, dn_nu,    p_m,   master_m,  mu_m,  nu_m,  dm_p,   dm_master,
                 dm_mu, dm_nu,    faults, grad_nonfinite};
  const AdamWHyper hyper{b1, b2, omb1, omb2, eps, eps_root, wd};
  AdamWLeaf leaf;
  if (auto err = validate_adamw(b, AdamWAttrs{chunk_elems, hyper}, &leaf); err.failure()) {
    return err;
  }
  cudaError_t err =
      adamw_cuda(leaf, hyper, static_cast<const float*>(step.untyped_data()), stream);
  return err == cudaSuccess ? ffi::Error::Success() : cuda_error("pimhbm.adamw", err);
}

ffi::Error restore_cuda_impl(cudaStream_t stream, ffi::AnyBuffer commit,
                             ffi::RemainingArgs args, ffi::RemainingRets rets) {
  std::vector<CopyPair> pairs;
  if (auto err = validate_restore(commit, args, rets, &pairs); err.failure()) return err;
  cudaError_t err =
      restore_cuda(static_cast<const int32_t*>(commit.untyped_data()), pairs, stream);
  return err == cudaSuccess ? ffi::Error::Success() : cuda_error("pimhbm.restore", err);
}

}  // namespace
}  // namespace pimhbm::update

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    PimhbmAdamWCuda, pimhbm::update::adamw_cuda_impl,
    PIMHBM_ADAMW_BINDING(xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()),
    {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(PimhbmRestoreCuda, pimhbm::update::restore_cuda_impl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .RemainingArgs()
                                  .RemainingRets(),
                              {xla::ffi::Traits::kCmdBufferCompatible});
