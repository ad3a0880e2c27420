#include <cuda_runtime.h>

#include "faults/inject_common.h"
#include "pimhbm/cuda_check.h"

namespace pimhbm::faults {
namespace {

// One launch for every kind: the spec is read on the device (no host sync); kinds that touch
// one element use thread 0 only.
__global__ void inject_kernel(uint8_t* data, uint64_t size, Format format,
                              const int32_t* __restrict__ spec) {
  const int32_t kind = spec[0];
  const uint64_t off = spec_offset(spec);
  const uint64_t tid = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x;
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  if (kind == kFlipBit) {
    if (tid == 0 && off < size) data[off] ^= static_cast<uint8_t>(1u << (spec[4] & 7));
  } else if (kind == kOverwrite || kind == kWipe) {
    const uint64_t first = kind == kWipe ? 0 : off;
    const uint64_t end = kind == kWipe ? size : min(size, off + static_cast<uint32_t>(spec[3]));
    for (uint64_t i = first + tid; i < end; i += stride) {
      data[i] = random_byte_hd(static_cast<uint32_t>(spec[5]), i);
    }
  } else if (kind == kNonFinite) {
    const uint64_t w = static_cast<uint64_t>(element_size(format));
    if (tid == 0 && format != kRawBytes && (off + 1) * w <= size) {
      write_nonfinite(data + off * w, format, spec[6]);
    }
  }
}

}  // namespace

cudaError_t inject_cuda(uint8_t* data, int64_t nbytes, Format format, const int32_t* spec,
                        cudaStream_t stream) {
  if (nbytes == 0) return cudaSuccess;
  inject_kernel<<<1024, 256, 0, stream>>>(data, static_cast<uint64_t>(nbytes), format, spec);
  PIMHBM_CUDA_RETURN_LAUNCH_ERROR();
  return cudaSuccess;
}

}  // namespace pimhbm::faults
