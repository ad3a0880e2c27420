// CUDA handlers of pimhbm_adamw / pimhbm_restore: the same checks as on the CPU, kernels on
// XLA's stream, no synchronisation, no allocation.
#include <string>
#include <vector>

#include "pimhbm/ffi_alias_cuda.h"
#include "update/update_ffi.h"

namespace pimhbm::update {
namespace {

ffi::Error adamw_cuda_impl(cudaStream_t stream, ffi::AnyBuffer step, ffi::RemainingArgs args,
                           ffi::RemainingRets rets, int64_t chunk_elems, float b1, float b2,
                           float omb1, float omb2, float eps, float eps_root, float wd) {
  const AdamWAttrs a{chunk_elems, AdamWHyper{b1, b2, omb1, omb2, eps, eps_root, wd}};
  std::vector<AdamWLeaf> leaves;
  std::vector<ffi_util::Unaliased> copies;
  uint64_t* totals = nullptr;
  PIMHBM_FFI_RETURN_IF_ERROR(validate_adamw_call(step, args, rets, a, &leaves, &copies, &totals));
  cudaError_t err = ffi_util::copy_unaliased_cuda(copies, stream);
  if (err == cudaSuccess) err = cudaMemsetAsync(totals, 0, 2 * sizeof(uint64_t), stream);
  if (err == cudaSuccess) {
    err = adamw_cuda(leaves.data(), leaves.size(), a.hyper,
                     static_cast<const float*>(step.untyped_data()), stream);
  }
  return ffi_util::cuda_status("pimhbm.adamw", err);
}

ffi::Error restore_cuda_impl(cudaStream_t stream, ffi::AnyBuffer commit, ffi::RemainingArgs args,
                             ffi::RemainingRets rets) {
  std::vector<CopyPair> pairs;
  std::vector<ffi_util::Unaliased> copies;
  PIMHBM_FFI_RETURN_IF_ERROR(validate_restore(commit, args, rets, &pairs, &copies));
  cudaError_t err = ffi_util::copy_unaliased_cuda(copies, stream);
  if (err == cudaSuccess)
    err = restore_cuda(static_cast<const int32_t*>(commit.untyped_data()), pairs, stream);
  return ffi_util::cuda_status("pimhbm.restore", err);
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
