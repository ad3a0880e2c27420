// What the attention tests on the GPU share: random bf16 inputs, and the error of an output
// against a reference relative to the reference's largest value.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <type_traits>
#include <vector>

#include "pimhbm/adamw_math.h"

namespace pimhbm::testing {

inline std::vector<uint16_t> random_bf16(size_t n, std::mt19937& gen) {
  std::normal_distribution<float> dist;
  std::vector<uint16_t> out(n);
  for (auto& x : out) x = float_to_bf16(dist(gen));
  return out;
}

// max |got - want| / max |want| (at least 1e-2: a gradient that is zero in exact arithmetic is
// rounding noise in both), or infinity where got has a non-finite value. T is float, or
// uint16_t holding bf16.
template <typename T>
double relative_error(const std::vector<T>& got, const std::vector<T>& want) {
  auto value = [](T x) -> double {
    if constexpr (std::is_same_v<T, float>) {
      return x;
    } else {
      return bf16_to_float(x);
    }
  };
  double err = 0, scale = 1e-2;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(value(got[i]))) return INFINITY;
    err = std::max(err, std::abs(value(got[i]) - value(want[i])));
    scale = std::max(scale, std::abs(value(want[i])));
  }
  return err / scale;
}

}  // namespace pimhbm::testing
