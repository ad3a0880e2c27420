// Element classes: what the finite check and max |x| mean for each protected dtype.
// The digest itself works on raw bytes and does not care about the class.
#pragma once

#include <cstdint>
#include <cstring>

#include "pimhbm/digest.h"

namespace pimhbm {

enum class Elem : int32_t {
  kRaw = 0,    // integers and bool: digest only, never non-finite, max |x| reported as 0
  kF64 = 1,
  kF32 = 2,
  kF16 = 3,
  kBF16 = 4,
  kF8E4M3FN = 5,  // no infinities; 0x7f / 0xff are NaN
  kF8E5M2 = 6,
};

PIMHBM_HD bool elem_is_float(Elem e) { return e != Elem::kRaw; }

PIMHBM_HD float bits_to_float(uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
#endif
}

// The value of |x| from its bit pattern with the sign cleared, for finite x. Exact in float.
// fp8 e4m3fn: bias 7, 3 mantissa bits; subnormals are m * 2^-9.
PIMHBM_HD float f8e4m3fn_abs_to_float(uint32_t bits) {
  uint32_t e = (bits >> 3) & 0xF, m = bits & 0x7;
  return e == 0 ? static_cast<float>(m) * (1.0f / 512.0f)
                : bits_to_float(((e - 7 + 127) << 23) | (m << 20));
}

// IEEE half: bias 15, 10 mantissa bits; subnormals are m * 2^-24.
PIMHBM_HD float f16_abs_to_float(uint32_t bits) {
  uint32_t e = (bits >> 10) & 0x1F, m = bits & 0x3FF;
  return e == 0 ? static_cast<float>(m) * (1.0f / 16777216.0f)
                : bits_to_float(((e - 15 + 127) << 23) | (m << 13));
}

// fp8 e5m2 is the upper byte of an IEEE half.
PIMHBM_HD float f8e5m2_abs_to_float(uint32_t bits) { return f16_abs_to_float(bits << 8); }

}  // namespace pimhbm
