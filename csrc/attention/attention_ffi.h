// XLA FFI handlers of attention's forward ("pimhbm_attention_fwd") and backward
// ("pimhbm_attention_bwd") passes. One handler each for both platforms (attention_ffi.cc); the
// launches below are what differs.
#pragma once

#include "attention/attention.h"
#include "pimhbm/ffi_platform.h"
#include "xla/ffi/api/ffi.h"

namespace pimhbm::attention {

namespace ffi = xla::ffi;

PIMHBM_FFI_DECLARE_LAUNCHES(Forward);
PIMHBM_FFI_DECLARE_LAUNCHES(Backward);

}  // namespace pimhbm::attention

PIMHBM_FFI_DECLARE_HANDLERS(PimhbmAttentionFwd);
PIMHBM_FFI_DECLARE_HANDLERS(PimhbmAttentionBwd);
