// XLA FFI handlers of the guarded update ("pimhbm_adamw") and of commit-or-skip
// ("pimhbm_restore"). One handler each for both platforms (update_ffi.cc); the launches below
// are what differs.
#pragma once

#include <vector>

#include "pimhbm/ffi_alias.h"
#include "pimhbm/ffi_platform.h"
#include "pimhbm/ffi_util.h"
#include "update/adamw.h"
#include "update/restore.h"

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

// A checked pimhbm_adamw call: every leaf (their totals pointing at the call's), the step
// scalars (lr, 1 - b1^t, 1 - b2^t), the call's totals (zeroed before the update), and the
// results XLA did not alias with their operands (ffi_alias.h), copied in first.
struct AdamWCall {
  std::vector<AdamWLeaf> leaves;
  AdamWHyper hyper;
  const float* step;
  uint64_t* totals;
  std::vector<ffi_util::Unaliased> copies;
};

// A checked pimhbm_restore call: the commit flag, the copies to make unless it commits.
struct RestoreCall {
  const int32_t* commit;
  std::vector<CopyPair> pairs;
  std::vector<ffi_util::Unaliased> copies;
};

PIMHBM_FFI_DECLARE_LAUNCHES(AdamWCall);
PIMHBM_FFI_DECLARE_LAUNCHES(RestoreCall);

}  // namespace pimhbm::update

PIMHBM_FFI_DECLARE_HANDLERS(PimhbmAdamW);
PIMHBM_FFI_DECLARE_HANDLERS(PimhbmRestore);
