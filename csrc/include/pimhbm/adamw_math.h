// AdamW on one element, shared by the CPU reference and the CUDA kernel.
//
// The same operations in the same order as optax.adamw (scale_by_adam, add_decayed_weights,
// scale_by_learning_rate, apply_updates), each rounded on its own: no fused multiply-add on
// either side (the intrinsics below on the GPU; the CPU build does not contract), and IEEE
// division and square root. So the CPU and CUDA paths agree bit for bit, and both agree with
// optax to fp32 rounding. One deliberate difference: the bias corrections are applied as
// multiplications by 1 / (1 - b^t), rounded once per step, instead of two divisions per
// element (an IEEE division costs the GPU ~15 instructions; the results differ from optax by
// at most an ulp of m_hat and v_hat). The bias corrections 1 - b^t are computed outside (by
// XLA, from the step count held on the device) and passed in.
#pragma once

#include <cstdint>
#include <cstring>

#include "pimhbm/digest.h"

namespace pimhbm {

struct AdamWHyper {
  float b1, b2;                      // moment decays
  float one_minus_b1, one_minus_b2;  // rounded as optax rounds (1 - b) in float32
  float eps, eps_root;
  float weight_decay;
};

// Per-step scalars: the learning rate and the reciprocals of the two bias corrections.
struct AdamWStep {
  float lr, inv_bc1, inv_bc2;
};

PIMHBM_HD float fmul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
PIMHBM_HD float fadd(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
PIMHBM_HD float fdiv(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
PIMHBM_HD float fsqrt(float a) {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(a);
#else
  return __builtin_sqrtf(a);
#endif
}

// From the three step scalars as passed in (lr, 1 - b1^t, 1 - b2^t).
PIMHBM_HD AdamWStep adamw_step(const float* s) {
  return AdamWStep{s[0], fdiv(1.0f, s[1]), fdiv(1.0f, s[2])};
}

// Whether adamw_element<false> gives adamw_element's results: eps_root is zero (of either sign)
// and eps positive. Then v_hat + eps_root is v_hat itself but for v_hat = -0, whose square root
// -0 differs from +0's only in a sign that adding eps > 0 takes away.
PIMHBM_HD bool eps_root_free(const AdamWHyper& h) { return h.eps_root == 0.0f && h.eps > 0.0f; }

// One AdamW step of one element: w is the fp32 weight (master, or the parameter itself).
// kEpsRoot false leaves out the addition of eps_root (only where eps_root_free holds).
template <bool kEpsRoot = true>
PIMHBM_HD void adamw_element(float g, float& w, float& m, float& v, const AdamWHyper& h,
                             const AdamWStep& s) {
  m = fadd(fmul(h.one_minus_b1, g), fmul(h.b1, m));
  v = fadd(fmul(h.one_minus_b2, fmul(g, g)), fmul(h.b2, v));
  const float m_hat = fmul(m, s.inv_bc1);
  const float v_hat = fmul(v, s.inv_bc2);
  const float root_arg = kEpsRoot ? fadd(v_hat, h.eps_root) : v_hat;
  float u = fdiv(m_hat, fadd(fsqrt(root_arg), h.eps));
  u = fadd(u, fmul(h.weight_decay, w));
  w = fadd(w, fmul(-s.lr, u));
}

// bfloat16 <-> float, round to nearest even (NaN stays NaN).
PIMHBM_HD float bf16_to_float(uint16_t b) {
  uint32_t bits = static_cast<uint32_t>(b) << 16;
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}
// The rounding to nearest even alone, for bits known not to be a NaN.
PIMHBM_HD uint32_t bf16_round_bits(uint32_t bits) {
  return (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
}
PIMHBM_HD uint16_t float_to_bf16(float f) {
#if defined(__CUDA_ARCH__)
  uint32_t bits = __float_as_uint(f);
#else
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
#endif
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);  // NaN
  return static_cast<uint16_t>(bf16_round_bits(bits));
}

// Master weights are stored split: the bf16 parameter p and a 16-bit remainder r, with
//   bits(master) + 0x8000 == p << 16 | r   (mod 2^32).
// That is a bijection, so the fp32 master is kept exactly in 4 bytes that include the
// parameter itself: the update reads and writes 2 bytes fewer a parameter than with a
// separate fp32 master, and p's digest check covers half of the master. p is the master
// rounded to nearest with ties away from zero (adding half a bf16 step to the magnitude's
// bits); round to nearest even could not be inverted (an even p has one preimage too many).
// A NaN master is stored as the canonical NaN (p = 0x7FC0, r = 0; it joins back to a NaN):
// sign and payload, which the CPU and the GPU produce differently, are not kept.
struct SplitMaster {
  uint16_t p, r;
};
PIMHBM_HD uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  return bits;
#endif
}
PIMHBM_HD float bits_float(uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}
PIMHBM_HD SplitMaster split_master(float w) {
  const uint32_t bits = float_bits(w);
  const uint32_t up = (bits & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC00000u : bits + 0x8000u;
  return SplitMaster{static_cast<uint16_t>(up >> 16), static_cast<uint16_t>(up & 0xFFFFu)};
}
PIMHBM_HD float join_master(uint16_t p, uint16_t r) {
  return bits_float(((static_cast<uint32_t>(p) << 16) | r) - 0x8000u);
}

}  // namespace pimhbm
