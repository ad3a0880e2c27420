// XLA FFI handlers of the guarded update ("pimhbm_adamw") and of commit-or-skip
// ("pimhbm_restore").
#pragma once

#include <vector>

#include "pimhbm/ffi_alias.h"
#include "pimhbm/ffi_util.h"
#include "update/adamw.h"
#include "update/restore.h"
#include "xla/ffi/api/c_api.h"

namespace pimhbm::update {

namespace ffi = xla::ffi;

// The buffers of one leaf of pimhbm_adamw, in argument order (see python/pimhbm/update.py).
struct AdamWBuffers {
  ffi::AnyBuffer p, master, mu, nu, g, d_p, d_master, d_mu, d_nu, step;
  ffi::Result<ffi::AnyBuffer> p_out, master_out, mu_out, nu_out, dn_p, dn_master, dn_mu, dn_nu;
  ffi::Result<ffi::AnyBuffer> p_c, master_c, mu_c, nu_c, dc_p, dc_master, dc_mu, dc_nu;
  ffi::Result<ffi::AnyBuffer> faults, grad_nonfinite;
};

// pimhbm_adamw updates every leaf of a tree in one call (one kernel launch per kind of leaf):
// the step scalars, then per leaf kArgsPerLeaf arguments -- read side (p, master, mu, nu), the
// gradient, the read side's digest tables, the write side's tensors and tables, the device copy's
// tensors and tables (0 elements: absent) -- and kRetsPerLeaf results (the write side's 8, the
// device copy's 8, the fault map, the non-finite gradient map); after the leaves' results, one
// more: the call's totals, uint32 (2, 2): two 64-bit counters as (low, high) words
// (AdamWLeaf::totals).
constexpr size_t kArgsPerLeaf = 25;
constexpr size_t kRetsPerLeaf = 18;

struct AdamWAttrs {
  int64_t chunk_elems;
  AdamWHyper hyper;
};

// Checks every buffer of one leaf; on success fills *leaf (write side from the results).
ffi::Error validate_adamw(const AdamWBuffers& b, const AdamWAttrs& a, AdamWLeaf* leaf);

// Checks the whole call (the step scalars, every leaf, the totals) and lists the leaves (their
// totals pointing at the call's), the results XLA did not alias with their operands
// (ffi_alias.h), and the totals (to be zeroed before the update).
ffi::Error validate_adamw_call(const ffi::AnyBuffer& step, const ffi::RemainingArgs& args,
                               const ffi::RemainingRets& rets, const AdamWAttrs& a,
                               std::vector<AdamWLeaf>* leaves,
                               std::vector<ffi_util::Unaliased>* copies, uint64_t** totals_out);

// Checks the (commit, sources..., destinations...) of pimhbm_restore and lists the copies to
// make, and the results XLA did not alias with their destinations.
ffi::Error validate_restore(const ffi::AnyBuffer& commit, const ffi::RemainingArgs& args,
                            const ffi::RemainingRets& rets, std::vector<CopyPair>* pairs,
                            std::vector<ffi_util::Unaliased>* copies);

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
#define PIMHBM_ADAMW_BINDING(bind)                                    \
  bind.Arg<xla::ffi::AnyBuffer>() /* lr, 1 - b1^t, 1 - b2^t */        \
      .RemainingArgs()            /* kArgsPerLeaf per leaf */         \
      .RemainingRets()            /* kRetsPerLeaf per leaf, totals */ \
      .Attr<int64_t>("chunk_elems")                                   \
      .Attr<float>("b1")                                              \
      .Attr<float>("b2")                                              \
      .Attr<float>("one_minus_b1")                                    \
      .Attr<float>("one_minus_b2")                                    \
      .Attr<float>("eps")                                             \
      .Attr<float>("eps_root")                                        \
      .Attr<float>("weight_decay")
