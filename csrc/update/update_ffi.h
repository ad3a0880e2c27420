// XLA FFI handlers of the guarded update ("pimhbm_adamw") and of commit-or-skip
// ("pimhbm_restore").
#pragma once

#include <vector>

#include "pimhbm/ffi_util.h"
#include "update/adamw.h"
#include "update/restore.h"
#include "xla/ffi/api/c_api.h"

namespace pimhbm::update {

namespace ffi = xla::ffi;

// The buffers of pimhbm_adamw, in argument order (see python/pimhbm/update.py).
struct AdamWBuffers {
  ffi::AnyBuffer p, master, mu, nu, g, d_p, d_master, d_mu, d_nu, step;
  ffi::Result<ffi::AnyBuffer> p_out, master_out, mu_out, nu_out, dn_p, dn_master, dn_mu, dn_nu;
  ffi::Result<ffi::AnyBuffer> p_m, master_m, mu_m, nu_m, dm_p, dm_master, dm_mu, dm_nu;
  ffi::Result<ffi::AnyBuffer> faults, grad_nonfinite;
};

struct AdamWAttrs {
  int64_t chunk_elems;
  AdamWHyper hyper;
};

// Checks every buffer; on success fills *leaf (pointers of the write side from the results).
ffi::Error validate_adamw(const AdamWBuffers& b, const AdamWAttrs& a, AdamWLeaf* leaf);

// Checks the (commit, sources..., destinations...) of pimhbm_restore and lists the copies.
ffi::Error validate_restore(const ffi::AnyBuffer& commit, const ffi::RemainingArgs& args,
                            const ffi::RemainingRets& rets, std::vector<CopyPair>* pairs);

}  // namespace pimhbm::update

extern "C" {
XLA_FFI_Error* PimhbmAdamWCpu(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* PimhbmRestoreCpu(XLA_FFI_CallFrame* call_frame);
#if defined(PIMHBM_WITH_CUDA)
XLA_FFI_Error* PimhbmAdamWCuda(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* PimhbmRestoreCuda(XLA_FFI_CallFrame* call_frame);
#endif
}

// The binding shared by both platforms' handlers (the CUDA one adds the stream in front).
#define PIMHBM_ADAMW_BINDING(bind)                                                           \
  bind.Arg<xla::ffi::AnyBuffer>()        /* p */                                             \
      .Arg<xla::ffi::AnyBuffer>()        /* master (0 elements: none) */                     \
      .Arg<xla::ffi::AnyBuffer>()        /* mu */                                            \
      .Arg<xla::ffi::AnyBuffer>()        /* nu */                                            \
      .Arg<xla::ffi::AnyBuffer>()        /* g */                                             \
      .Arg<xla::ffi::AnyBuffer>()        /* digests of p */                                  \
      .Arg<xla::ffi::AnyBuffer>()        /* digests of master */                             \
      .Arg<xla::ffi::AnyBuffer>()        /* digests of mu */                                 \
      .Arg<xla::ffi::AnyBuffer>()        /* digests of nu */                                 \
      .Arg<xla::ffi::AnyBuffer>()        /* write side: p (aliased with result 0) */         \
      .Arg<xla::ffi::AnyBuffer>()        /* master */                                        \
      .Arg<xla::ffi::AnyBuffer>()        /* mu */                                            \
      .Arg<xla::ffi::AnyBuffer>()        /* nu */                                            \
      .Arg<xla::ffi::AnyBuffer>()        /* digests of p */                                  \
      .Arg<xla::ffi::AnyBuffer>()        /* digests of master */                             \
      .Arg<xla::ffi::AnyBuffer>()        /* digests of mu */                                 \
      .Arg<xla::ffi::AnyBuffer>()        /* digests of nu (aliased with result 7) */         \
      .Arg<xla::ffi::AnyBuffer>()        /* mirror: p (0 elements: no mirror; result 8) */   \
      .Arg<xla::ffi::AnyBuffer>()        /* master */                                        \
      .Arg<xla::ffi::AnyBuffer>()        /* mu */                                            \
      .Arg<xla::ffi::AnyBuffer>()        /* nu */                                            \
      .Arg<xla::ffi::AnyBuffer>()        /* digests of p */                                  \
      .Arg<xla::ffi::AnyBuffer>()        /* digests of master */                             \
      .Arg<xla::ffi::AnyBuffer>()        /* digests of mu */                                 \
      .Arg<xla::ffi::AnyBuffer>()        /* digests of nu (result 15) */                     \
      .Arg<xla::ffi::AnyBuffer>()        /* step scalars: lr, 1 - b1^t, 1 - b2^t */          \
      .Ret<xla::ffi::AnyBuffer>()        /* p' */                                            \
      .Ret<xla::ffi::AnyBuffer>()        /* master' */                                       \
      .Ret<xla::ffi::AnyBuffer>()        /* mu' */                                           \
      .Ret<xla::ffi::AnyBuffer>()        /* nu' */                                           \
      .Ret<xla::ffi::AnyBuffer>()        /* digests of p' */                                 \
      .Ret<xla::ffi::AnyBuffer>()        /* digests of master' */                            \
      .Ret<xla::ffi::AnyBuffer>()        /* digests of mu' */                                \
      .Ret<xla::ffi::AnyBuffer>()        /* digests of nu' */                                \
      .Ret<xla::ffi::AnyBuffer>()        /* mirror: p' */                                    \
      .Ret<xla::ffi::AnyBuffer>()        /* master' */                                       \
      .Ret<xla::ffi::AnyBuffer>()        /* mu' */                                           \
      .Ret<xla::ffi::AnyBuffer>()        /* nu' */                                           \
      .Ret<xla::ffi::AnyBuffer>()        /* digests of p' */                                 \
      .Ret<xla::ffi::AnyBuffer>()        /* digests of master' */                            \
      .Ret<xla::ffi::AnyBuffer>()        /* digests of mu' */                                \
      .Ret<xla::ffi::AnyBuffer>()        /* digests of nu' */                                \
      .Ret<xla::ffi::AnyBuffer>()        /* faults per chunk */                              \
      .Ret<xla::ffi::AnyBuffer>()        /* non-finite gradients per chunk */                \
      .Attr<int64_t>("chunk_elems")                                                          \
      .Attr<float>("b1")                                                                     \
      .Attr<float>("b2")                                                                     \
      .Attr<float>("one_minus_b1")                                                           \
      .Attr<float>("one_minus_b2")                                                           \
      .Attr<float>("eps")                                                                    \
      .Attr<float>("eps_root")                                                               \
      .Attr<float>("weight_decay")
