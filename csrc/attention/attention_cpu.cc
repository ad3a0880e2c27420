// The reference: each query row on its own, in float, every sum in index order.
#include <algorithm>
#include <limits>
#include <vector>

#include "attention/attention.h"
#include "pimhbm/adamw_math.h"

namespace pimhbm::attention {
namespace {

std::vector<float> widen(const uint16_t* x, int64_t n) {
  std::vector<float> out(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) out[i] = bf16_to_float(x[i]);
  return out;
}

void narrow(const std::vector<float>& x, float factor, uint16_t* out) {
  for (size_t i = 0; i < x.size(); ++i) out[i] = float_to_bf16(factor * x[i]);
}

float dot(const float* a, const float* b, int64_t n) {
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

void add_scaled(float* acc, float factor, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) acc[i] += factor * x[i];
}

// Offsets of a query (or output) row, a key (or value) row, and an lse entry.
struct Index {
  const Shape& s;
  int64_t q(int64_t b, int64_t t, int64_t h) const {
    return ((b * s.seq + t) * s.heads + h) * s.head_dim;
  }
  int64_t kv(int64_t b, int64_t t, int64_t h) const {
    return ((b * s.seq + t) * s.kv_heads + h) * s.head_dim;
  }
  int64_t row(int64_t b, int64_t h, int64_t t) const { return (b * s.heads + h) * s.seq + t; }
  int64_t keys(int64_t t) const { return s.causal ? t + 1 : s.seq; }  // keys query t sees
};

}  // namespace

void forward_cpu(const Forward& c) {
  const Shape& s = c.shape;
  const Index at{s};
  const int64_t d = s.head_dim;
  const std::vector<float> q = widen(c.q, s.q_elems()), k = widen(c.k, s.kv_elems()),
                           v = widen(c.v, s.kv_elems());
  std::vector<float> score(static_cast<size_t>(s.seq)), out(static_cast<size_t>(d));
  for (int64_t b = 0; b < s.batch; ++b) {
    for (int64_t h = 0; h < s.heads; ++h) {
      const int64_t hk = h / s.group();
      for (int64_t t = 0; t < s.seq; ++t) {
        const float* qt = &q[at.q(b, t, h)];
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j < at.keys(t); ++j) {
          score[j] = s.scale() * dot(qt, &k[at.kv(b, j, hk)], d);
          m = std::max(m, score[j]);
        }
        float l = 0.0f;
        std::fill(out.begin(), out.end(), 0.0f);
        for (int64_t j = 0; j < at.keys(t); ++j) {
          const float p = std::exp(score[j] - m);
          l += p;
          add_scaled(out.data(), p, &v[at.kv(b, j, hk)], d);
        }
        for (int64_t i = 0; i < d; ++i) c.o[at.q(b, t, h) + i] = float_to_bf16(out[i] / l);
        c.lse[at.row(b, h, t)] = m + std::log(l);
      }
    }
  }
}

void backward_cpu(const Backward& c) {
  const Shape& s = c.shape;
  const Index at{s};
  const int64_t d = s.head_dim;
  const std::vector<float> q = widen(c.q, s.q_elems()), k = widen(c.k, s.kv_elems()),
                           v = widen(c.v, s.kv_elems()), o = widen(c.o, s.q_elems()),
                           d_o = widen(c.d_o, s.q_elems());
  std::vector<float> dq(static_cast<size_t>(s.q_elems()), 0.0f),
      dk(static_cast<size_t>(s.kv_elems()), 0.0f), dv(static_cast<size_t>(s.kv_elems()), 0.0f);
  for (int64_t b = 0; b < s.batch; ++b) {
    for (int64_t h = 0; h < s.heads; ++h) {
      const int64_t hk = h / s.group();
      for (int64_t t = 0; t < s.seq; ++t) {
        const float* qt = &q[at.q(b, t, h)];
        const float* dot_t = &d_o[at.q(b, t, h)];
        const float delta = dot(dot_t, &o[at.q(b, t, h)], d);
        const float lse = c.lse[at.row(b, h, t)];
        c.delta[at.row(b, h, t)] = delta;
        for (int64_t j = 0; j < at.keys(t); ++j) {
          const int64_t kj = at.kv(b, j, hk);
          const float p = std::exp(s.scale() * dot(qt, &k[kj], d) - lse);
          const float ds = p * (dot(dot_t, &v[kj], d) - delta);
          add_scaled(&dv[kj], p, dot_t, d);
          add_scaled(&dq[at.q(b, t, h)], ds, &k[kj], d);
          add_scaled(&dk[kj], ds, qt, d);
        }
      }
    }
  }
  narrow(dq, s.scale(), c.dq);
  narrow(dk, s.scale(), c.dk);
  narrow(dv, 1.0f, c.dv);
}

}  // namespace pimhbm::attention
