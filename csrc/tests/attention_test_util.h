// What the attention tests on the GPU share: random bf16 inputs, and the error of an output
// against a reference relative to the reference's largest value.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <sstream>
#include <string>
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
double value_of(T x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    return bf16_to_float(x);
  }
}

template <typename T>
double relative_error(const std::vector<T>& got, const std::vector<T>& want) {
  const auto value = [](T x) { return value_of(x); };
  double err = 0, scale = 1e-2;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(value(got[i]))) return INFINITY;
    err = std::max(err, std::abs(value(got[i]) - value(want[i])));
    scale = std::max(scale, std::abs(value(want[i])));
  }
  return err / scale;
}

// An element's sequence position and column (its place in the head dim; 0 for lse).
struct Position {
  int64_t t, col;
};

// Positions in a [batch, seq, heads, head_dim] tensor.
inline auto bthd(int64_t seq, int64_t heads, int64_t head_dim) {
  return [=](int64_t i) { return Position{i / (heads * head_dim) % seq, i % head_dim}; };
}

// Where an output is off by more than `tol` x its reference's largest value: how many elements,
// which positions (first, last, and by t mod 64 in eight slabs of 8 rows: the fragments of a
// 64-row wgmma tile), which columns (by col mod 8 and by 8-wide block), and the first few. For
// the message of a failed check: one GPU run then says which part of a tile is wrong.
template <typename T, typename Locate>
std::string where_wrong(const std::vector<T>& got, const std::vector<T>& want, Locate locate,
                        double tol = 2e-2) {
  double scale = 1e-2;
  for (T x : want) scale = std::max(scale, std::abs(value_of(x)));
  int64_t bad = 0, first = -1, last = -1;
  std::vector<int64_t> slab(8), col_lane(8), col_block;
  std::ostringstream firsts;
  for (size_t i = 0; i < got.size(); ++i) {
    const double g = value_of(got[i]), w = value_of(want[i]);
    if (std::isfinite(g) && std::abs(g - w) <= tol * scale) continue;
    const Position at = locate(static_cast<int64_t>(i));
    ++bad;
    first = first < 0 ? at.t : std::min(first, at.t);
    last = std::max(last, at.t);
    ++slab[at.t % 64 / 8];
    ++col_lane[at.col % 8];
    if (static_cast<int64_t>(col_block.size()) <= at.col / 8) col_block.resize(at.col / 8 + 1);
    ++col_block[at.col / 8];
    if (bad <= 3) firsts << " t " << at.t << " col " << at.col << ": " << g << " want " << w << ";";
  }
  std::ostringstream out;
  const auto list = [&](const std::vector<int64_t>& v) {
    for (int64_t n : v) out << " " << n;
  };
  out << bad << " of " << got.size() << " off (t " << first << ".." << last
      << "); by t mod 64 / 8:";
  list(slab);
  out << "; by col mod 8:";
  list(col_lane);
  out << "; by col / 8:";
  list(col_block);
  out << ";" << firsts.str();
  return out.str();
}

}  // namespace pimhbm::testing
