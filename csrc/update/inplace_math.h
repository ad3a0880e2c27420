// One element of the in-place update, shared by the CPU reference and the CUDA kernel: the
// state as raw words in, the new state out -- or the old one kept where a new value would not
// be finite.
#pragma once

#include <cmath>
#include <cstdint>

#include "pimhbm/adamw_math.h"

namespace pimhbm::update {

struct ElemState {
  uint32_t p;  // fp32 bits, or bf16 bits
  uint32_t r;  // the master weight's remainder (with master weights)
  float mu, nu;
};

PIMHBM_HD bool finite_bits(uint32_t bits, bool bf16) {
  return bf16 ? (bits & 0x7FFFu) < 0x7F80u : (bits & 0x7FFFFFFFu) < 0x7F800000u;
}

// The same tests as one float compare each (the GPU's kernel chains them into one predicate):
// a NaN compares false. split_finite(w): split_master(w)'s parameter is finite -- split_master
// adds 0x8000 to the bits, so from 0x7F7F8000 on the parameter is the infinity -- and so is
// float_to_bf16(w) (the largest finite bf16 is odd: from there on its tie rounds up too).
PIMHBM_HD bool finite_f32(float x) { return fabsf(x) < bits_float(0x7F800000u); }
PIMHBM_HD bool split_finite(float w) { return fabsf(w) < bits_float(0x7F7F8000u); }

// An element's new values are all finite: the parameter as stored (bf16, with or without master
// weights: split_finite, which covers its rounding), the master weight and both moments. A
// non-finite gradient value fails it through its moments. Bitwise: one predicate, no branch.
PIMHBM_HD bool new_values_finite(float w, float m, float v, bool bf16) {
  return (bf16 ? split_finite(w) : finite_f32(w)) & finite_f32(m) & finite_f32(v);
}

// Updates x with gradient g (as a float); returns false, leaving x as it was, where the new
// parameter, master weight or a moment is NaN or infinite.
PIMHBM_HD bool update_elem(ElemState& x, float g, bool bf16, bool master, const AdamWHyper& h,
                           const AdamWStep& s) {
  float w = master ? join_master(static_cast<uint16_t>(x.p), static_cast<uint16_t>(x.r))
                   : (bf16 ? bf16_to_float(static_cast<uint16_t>(x.p)) : bits_float(x.p));
  float m = x.mu, v = x.nu;
  adamw_element(g, w, m, v, h, s);
  ElemState y{0, 0, m, v};
  if (master) {
    const SplitMaster split = split_master(w);
    y.p = split.p;
    y.r = split.r;
  } else {
    y.p = bf16 ? float_to_bf16(w) : float_bits(w);
  }
  const bool ok = finite_bits(y.p, bf16) && finite_bits(float_bits(w), false) &&
                  finite_bits(float_bits(m), false) && finite_bits(float_bits(v), false);
  if (ok) x = y;
  return ok;
}

}  // namespace pimhbm::update
