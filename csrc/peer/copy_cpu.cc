#include <cstring>

#include "peer/copy.h"

namespace pimhbm::peer {

void copy_segments_cpu(const Segments& segments, uint8_t* out) {
  for (int p = 0; p < segments.count; ++p) {
    if (segments.bytes > 0) std::memcpy(out + p * segments.bytes, segments.src[p], segments.bytes);
  }
}

}  // namespace pimhbm::peer
