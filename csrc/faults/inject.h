// Fault injection into real buffers, in place: what tests, the demo and the benchmarks use to
// damage state the way failing memory or arithmetic would. Deterministic from its spec.
//
// The spec is data (int32[8], on the device), not a compile-time attribute, so that one
// compiled program injects any fault into a tensor of a given shape:
//   spec[0] kind: 0 none, 1 flip a bit, 2 overwrite a byte range with random bytes (a failed
//           row), 3 write NaN/+Inf/-Inf into one element, 4 overwrite the whole buffer with
//           random bytes (a lost shard)
//   spec[1], spec[2]  offset, low and high 32 bits: a byte offset (kinds 1, 2) or an element
//                     index (kind 3)
//   spec[3] length in bytes (kind 2)
//   spec[4] bit 0..7 within the byte (kind 1)
//   spec[5] seed of the random bytes (kinds 2, 4)
//   spec[6] value (kind 3): 0 NaN, 1 +Inf, 2 -Inf
// Anything out of range is clipped to the buffer: an injection never writes outside it.
#pragma once

#include <cstdint>

#if defined(PIMHBM_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace pimhbm::faults {

enum Kind : int32_t { kNone = 0, kFlipBit = 1, kOverwrite = 2, kNonFinite = 3, kWipe = 4 };

// Element width and float format of the target, for kNonFinite.
enum Format : int32_t { kRawBytes = 0, kFloat32 = 1, kBFloat16 = 2, kFloat16 = 3, kFloat64 = 4 };

void inject_cpu(uint8_t* data, int64_t nbytes, Format format, const int32_t* spec);

#if defined(PIMHBM_WITH_CUDA)
cudaError_t inject_cuda(uint8_t* data, int64_t nbytes, Format format, const int32_t* spec,
                        cudaStream_t stream);
#endif

}  // namespace pimhbm::faults
