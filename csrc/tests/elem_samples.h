// Random elements of every protected float dtype with their truth (finite? |x|?) computed by
// decoders written from the formats' definitions -- independent of the code under test.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "pimhbm/elem.h"

namespace pimhbm::testing {

struct Sample {
  std::vector<uint8_t> bytes;     // the raw buffer
  std::vector<bool> finite;       // per element
  std::vector<double> magnitude;  // |x| per element (finite ones)
  int elem_size = 0;
};

// |x| of a small float format with `e_bits` exponent and `m_bits` mantissa bits, from fields.
inline double decode_small(uint32_t bits, int e_bits, int m_bits, int bias) {
  const uint32_t m = bits & ((1u << m_bits) - 1), e = (bits >> m_bits) & ((1u << e_bits) - 1);
  if (e == 0) return std::ldexp(static_cast<double>(m), 1 - bias - m_bits);
  return std::ldexp(static_cast<double>(m + (1u << m_bits)), static_cast<int>(e) - bias - m_bits);
}

inline bool finite_small(uint32_t bits, Elem elem) {
  switch (elem) {
    case Elem::kF16: return ((bits >> 10) & 0x1F) != 0x1F;
    case Elem::kBF16: return ((bits >> 7) & 0xFF) != 0xFF;
    case Elem::kF8E4M3FN: return (bits & 0x7F) != 0x7F;
    case Elem::kF8E5M2: return ((bits >> 2) & 0x1F) != 0x1F;
    default: return true;
  }
}

inline double magnitude_small(uint32_t bits, Elem elem) {
  switch (elem) {
    case Elem::kF16: return decode_small(bits & 0x7FFF, 5, 10, 15);
    case Elem::kBF16: return decode_small(bits & 0x7FFF, 8, 7, 127);
    case Elem::kF8E4M3FN: return decode_small(bits & 0x7F, 4, 3, 7);
    case Elem::kF8E5M2: return decode_small(bits & 0x7F, 5, 2, 15);
    default: return 0;
  }
}

inline int elem_size(Elem e) {
  switch (e) {
    case Elem::kF64: return 8;
    case Elem::kF32: return 4;
    case Elem::kF16:
    case Elem::kBF16: return 2;
    default: return 1;
  }
}

// `count` random elements; about `bad_fraction` of them NaN or +-Inf.
inline Sample make_sample(std::mt19937_64& rng, Elem elem, size_t count, double bad_fraction) {
  Sample s;
  s.elem_size = elem_size(elem);
  s.bytes.resize(count * s.elem_size);
  s.finite.resize(count);
  s.magnitude.resize(count);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  std::normal_distribution<double> normal(0.0, 1.0);
  for (size_t i = 0; i < count; ++i) {
    const bool bad = unit(rng) < bad_fraction;
    uint8_t* p = s.bytes.data() + i * s.elem_size;
    if (elem == Elem::kF32 || elem == Elem::kF64) {
      double v = normal(rng) * std::ldexp(1.0, static_cast<int>(rng() % 40) - 20);
      if (bad) {
        const int kind = static_cast<int>(rng() % 3);
        v = kind == 0 ? NAN : kind == 1 ? INFINITY : -INFINITY;
      }
      if (elem == Elem::kF32) {
        const float f = static_cast<float>(v);
        std::memcpy(p, &f, 4);
        s.finite[i] = std::isfinite(f);
        s.magnitude[i] = std::fabs(static_cast<double>(f));
      } else {
        std::memcpy(p, &v, 8);
        s.finite[i] = std::isfinite(v);
        s.magnitude[i] = std::fabs(v);
      }
      continue;
    }
    // Small formats: uniformly random bit patterns, drawn again until (non-)finite as wanted.
    uint32_t bits;
    do {
      bits = static_cast<uint32_t>(rng()) & (s.elem_size == 2 ? 0xFFFFu : 0xFFu);
    } while (finite_small(bits, elem) == bad);
    std::memcpy(p, &bits, s.elem_size);
    s.finite[i] = !bad;
    s.magnitude[i] = bad ? 0.0 : magnitude_small(bits, elem);
  }
  return s;
}

}  // namespace pimhbm::testing
