// The data movement of the peer-pointer collectives: out[p] = bytes read from peer p.
//   all_gather:  peer p's whole input                   (segment p of the output)
//   all_to_all:  block `rank` of peer p's input          (segment p of the output)
// The GPU version is one kernel that reads every peer's memory directly (peer access), with
// 16-byte loads where the addresses allow it; the CPU version is the reference.
#pragma once

#include <cstdint>

#include "peer/rendezvous.h"

#if defined(PIMHBM_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace pimhbm::peer {

struct Segments {
  const uint8_t* src[kMaxGroup];  // where segment p is read (already offset into peer p's input)
  int count;
  int64_t bytes;  // bytes per segment
};

void copy_segments_cpu(const Segments& segments, uint8_t* out);

#if defined(PIMHBM_WITH_CUDA)
cudaError_t copy_segments_cuda(const Segments& segments, uint8_t* out, cudaStream_t stream);
#endif

}  // namespace pimhbm::peer
