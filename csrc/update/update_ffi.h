// XLA FFI handlers of the guarded update ("pimhbm_adamw", every leaf of a tree in one call;
// its buffers are laid out by adamw_layout.h) and of commit-or-skip ("pimhbm_restore"). One
// handler each for both platforms (update_ffi.cc); the launches below are what differs.
#pragma once

#include <cstdint>
#include <vector>

#include "pimhbm/ffi_alias.h"
#include "pimhbm/ffi_platform.h"
#include "update/adamw.h"
#include "update/restore.h"
#include "xla/ffi/api/ffi.h"

namespace pimhbm::update {

namespace ffi = xla::ffi;

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
