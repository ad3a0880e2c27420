// XLA FFI handlers of the in-place update ("pimhbm_adamw_inplace") and of the redo of the chunks
// it stashed ("pimhbm_adamw_redo"). One handler each for both platforms (inplace_ffi.cc).
//
// A leaf's operands, in the order of kInPlaceOperands; its results, kInPlaceResults (the first
// twelve aliased with the operands of the same name). Before the leaves: the step scalars
// (float32 (3,)) and, for the update, the verdict `go` (int32 (1,)); for a redo, the stash
// (uint32 (entries, chunk_elems) and int32 (entries, 2)). After the leaves' results: for the
// update, the stash (capacity rows); then the totals (uint32 (4, 2): 64-bit counters as low and
// high words, inplace.h).
#pragma once

#include <cstdint>
#include <vector>

#include "pimhbm/ffi_alias.h"
#include "pimhbm/ffi_platform.h"
#include "update/inplace.h"
#include "xla/ffi/api/ffi.h"

namespace pimhbm::update {

namespace ffi = xla::ffi;

inline constexpr const char* kInPlaceOperands[] = {
    "p", "master", "mu", "nu", "d_p", "d_master", "d_mu", "d_nu",
    "q_p", "q_master", "q_mu", "q_nu", "g", "chunk_base", "checked"};
inline constexpr const char* kInPlaceResults[] = {
    "p", "master", "mu", "nu", "d_p", "d_master", "d_mu", "d_nu",
    "q_p", "q_master", "q_mu", "q_nu", "faults", "kept"};
inline constexpr int kInPlaceLeafOperands = 15;
inline constexpr int kInPlaceLeafResults = 14;
inline constexpr int kInPlaceAliased = 12;  // operands [0, 12) are results [0, 12)

struct InPlaceCall {
  std::vector<InPlaceLeaf> leaves;
  AdamWHyper hyper;
  const float* step;
  const int32_t* go;  // update only
  Stash stash;        // update only
  StashIn redo;       // redo only
  bool is_redo;
  uint64_t* totals;
  std::vector<ffi_util::Unaliased> copies;
};

PIMHBM_FFI_DECLARE_LAUNCHES(InPlaceCall);

}  // namespace pimhbm::update

PIMHBM_FFI_DECLARE_HANDLERS(PimhbmAdamWInPlace);
PIMHBM_FFI_DECLARE_HANDLERS(PimhbmAdamWRedo);
