#include <algorithm>

#include "faults/inject_common.h"

namespace pimhbm::faults {

void inject_cpu(uint8_t* data, int64_t nbytes, Format format, const int32_t* spec) {
  const uint64_t size = static_cast<uint64_t>(nbytes);
  const uint64_t off = spec_offset(spec);
  switch (spec[0]) {
    case kFlipBit:
      if (off < size) data[off] ^= static_cast<uint8_t>(1u << (spec[4] & 7));
      break;
    case kOverwrite: {
      const uint64_t end = std::min<uint64_t>(size, off + static_cast<uint32_t>(spec[3]));
      for (uint64_t i = off; i < end; ++i) data[i] = random_byte_hd(static_cast<uint32_t>(spec[5]), i);
      break;
    }
    case kNonFinite: {
      const uint64_t w = static_cast<uint64_t>(element_size(format));
      if (format != kRawBytes && (off + 1) * w <= size) write_nonfinite(data + off * w, format, spec[6]);
      break;
    }
    case kWipe:
      for (uint64_t i = 0; i < size; ++i) data[i] = random_byte_hd(static_cast<uint32_t>(spec[5]), i);
      break;
    default:
      break;
  }
}

}  // namespace pimhbm::faults
