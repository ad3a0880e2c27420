// A parameter tensor's AdamW state on both sides (read and write), with digest tables, in host
// memory: random contents, poisoned outputs; and a device copy of it. Shared by the CPU and CUDA
// update tests and the benchmark's variant tests.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "scan/scan.h"
#include "test_util.h"
#include "update/adamw.h"

namespace pimhbm::update::testing {

inline constexpr AdamWHyper kHyper{0.9f, 0.999f, 0.1f, 0.001f, 1e-8f, 0.0f, 1e-4f};

// A tensor's state on both sides, with digest tables, in host memory.
struct HostLeaf {
  int64_t n, chunk;
  bool bf16, master;
  std::vector<uint8_t> p, g, p_out;
  std::vector<float> mu, nu, mu_out, nu_out;
  std::vector<uint16_t> w, w_out;  // the master weights' remainders (split_master), if any
  std::vector<uint32_t> d_p, d_w, d_mu, d_nu, dn_p, dn_w, dn_mu, dn_nu;
  std::vector<int32_t> faults, bad;
  std::vector<uint64_t> totals{0, 0};  // AdamWLeaf::totals of a call of this leaf alone

  // The totals the reports imply: chunks with a fault, and the elements grad_nonfinite counts.
  std::vector<uint64_t> totals_of_maps() const {
    std::vector<uint64_t> t{0, 0};
    for (int64_t c = 0; c < chunks(); ++c) {
      t[0] += faults[c] != 0 ? 1 : 0;
      t[1] += static_cast<uint64_t>(bad[c]);
    }
    return t;
  }

  int psize() const { return bf16 ? 2 : 4; }
  int64_t chunks() const { return n == 0 ? 0 : (n + chunk - 1) / chunk; }

  // The digest table of n elements of `size` bytes, in chunks of `chunk` elements.
  static std::vector<uint32_t> table_of(const void* data, int64_t n, int size, int64_t chunk) {
    return ::pimhbm::testing::digest_table(data, n * size, chunk * size);
  }

  HostLeaf(std::mt19937_64& rng, int64_t n_, int64_t chunk_, bool bf16_, bool master_)
      : n(n_), chunk(chunk_), bf16(bf16_), master(master_) {
    std::normal_distribution<float> normal;
    p.resize(n * psize());
    g.resize(n * psize());
    w.resize(master ? n : 0);
    mu.resize(n);
    nu.resize(n);
    for (int64_t i = 0; i < n; ++i) {
      const float pv = normal(rng), gv = normal(rng);
      set(g, i, gv);
      if (master) {  // a master near p; p is its upper half
        const SplitMaster split = split_master(pv + 1e-3f * normal(rng));
        std::memcpy(p.data() + 2 * i, &split.p, 2);
        w[i] = split.r;
      } else {
        set(p, i, pv);
      }
      mu[i] = 0.1f * normal(rng);
      nu[i] = std::fabs(0.01f * normal(rng));
    }
    d_p = table_of(p.data(), n, psize(), chunk);
    d_w = table_of(w.data(), master ? n : 0, 2, chunk);
    d_mu = table_of(mu.data(), n, 4, chunk);
    d_nu = table_of(nu.data(), n, 4, chunk);
    p_out.assign(p.size(), 0xAB);  // poisoned: every byte must be written
    w_out.assign(w.size(), 0xABAB);
    mu_out.assign(n, NAN);
    nu_out.assign(n, NAN);
    dn_p.assign(d_p.size(), 0xDEAD);
    dn_w.assign(d_w.size(), 0xDEAD);
    dn_mu.assign(d_mu.size(), 0xDEAD);
    dn_nu.assign(d_nu.size(), 0xDEAD);
    faults.assign(chunks(), -1);
    bad.assign(chunks(), -1);
  }

  // The fp32 master weight of element i: from p (or p_out) and w (or w_out).
  float master_of(const std::vector<uint8_t>& pv, const std::vector<uint16_t>& wv,
                  int64_t i) const {
    uint16_t b;
    std::memcpy(&b, pv.data() + 2 * i, 2);
    return join_master(b, wv[i]);
  }

  float get(const std::vector<uint8_t>& v, int64_t i) const {
    if (bf16) {
      uint16_t b;
      std::memcpy(&b, v.data() + 2 * i, 2);
      return bf16_to_float(b);
    }
    float f;
    std::memcpy(&f, v.data() + 4 * i, 4);
    return f;
  }
  void set(std::vector<uint8_t>& v, int64_t i, float f) {
    if (bf16) {
      const uint16_t b = float_to_bf16(f);
      std::memcpy(v.data() + 2 * i, &b, 2);
    } else {
      std::memcpy(v.data() + 4 * i, &f, 4);
    }
  }

  AdamWLeaf view() {
    AdamWLeaf L;
    L.n = n;
    L.chunk_elems = chunk;
    L.param_bf16 = bf16;
    L.has_master = master;
    L.p = p.data(), L.master = w.data(), L.mu = mu.data(), L.nu = nu.data(), L.g = g.data();
    L.d_p = d_p.data(), L.d_master = d_w.data(), L.d_mu = d_mu.data(), L.d_nu = d_nu.data();
    L.p_out = p_out.data(), L.master_out = w_out.data(), L.mu_out = mu_out.data();
    L.nu_out = nu_out.data();
    L.dn_p = dn_p.data(), L.dn_master = dn_w.data(), L.dn_mu = dn_mu.data();
    L.dn_nu = dn_nu.data();
    L.faults = faults.data(), L.grad_nonfinite = bad.data();
    L.totals = totals.data();
    return L;
  }
};

// A device copy of a leaf's state (AdamWLeaf::has_copy) in host memory, every element and
// table entry filled with a pattern that the update overwrites only where the chunk verified.
struct HostCopy {
  std::vector<uint8_t> p;
  std::vector<uint16_t> w;
  std::vector<float> mu, nu;
  std::vector<uint32_t> dp, dw, dmu, dnu;

  explicit HostCopy(const HostLeaf& h, uint8_t byte = 0x5A, uint16_t word = 7, float f = 7.0f,
                    uint32_t entry = 3)
      : p(h.p.size(), byte),
        w(h.w.size(), word),
        mu(h.n, f),
        nu(h.n, f),
        dp(h.d_p.size(), entry),
        dw(h.d_w.size(), entry),
        dmu(h.d_mu.size(), entry),
        dnu(h.d_nu.size(), entry) {}

  // `L` (a view of the leaf) writing into this copy too.
  AdamWLeaf attach(AdamWLeaf L) {
    L.has_copy = true;
    L.p_copy = p.data(), L.master_copy = w.data(), L.mu_copy = mu.data(), L.nu_copy = nu.data();
    L.dc_p = dp.data(), L.dc_master = dw.data(), L.dc_mu = dmu.data(), L.dc_nu = dnu.data();
    return L;
  }
};

// The kinds of leaf the update tests run on, (bf16, master): fp32, bf16, bf16 with master
// weights; and their names in the tests' names.
inline auto param_kinds() {
  return ::testing::Values(std::make_tuple(false, false), std::make_tuple(true, false),
                           std::make_tuple(true, true));
}
inline std::string param_kind_name(const ::testing::TestParamInfo<std::tuple<bool, bool>>& info) {
  return std::string(std::get<0>(info.param) ? "bf16" : "fp32") +
         (std::get<1>(info.param) ? "_master" : "");
}

}  // namespace pimhbm::update::testing
