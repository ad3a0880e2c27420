// The snapshot ops. pimhbm_snapshot copies device (or host) buffers into a shared-memory region, off the
// critical path. On the GPU the copies run on a side stream that waits for XLA's stream;
// snapshot_wait() blocks until the last copies are done (the caller does so before anything
// may overwrite the buffers being copied), snapshot_pending() asks without blocking;
// pimhbm_snapshot_fence makes XLA's stream wait for them (before a write in place).
#pragma once

#include <cstdint>

#include "pimhbm/ffi_platform.h"

namespace pimhbm::backup {

// Waits for every snapshot copy issued so far, on every device. Throws on a CUDA error.
void snapshot_wait();
// Whether a snapshot copy is still running.
bool snapshot_pending();

}  // namespace pimhbm::backup

PIMHBM_FFI_DECLARE_HANDLERS(PimhbmSnapshot);
PIMHBM_FFI_DECLARE_HANDLERS(PimhbmSnapshotFence);
