// The CPU reference of the guarded AdamW update: the math (against a plain re-statement of
// optax's formulas), the digest tables it reads and writes, and the fault reports.
#include "update/adamw.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "adamw_host_leaf.h"
#include "scan/scan.h"
#include "test_util.h"
#include "update/inplace_math.h"
#include "update/restore.h"

namespace pimhbm::update {
namespace {

using ::pimhbm::testing::rng_for_test;

using testing::HostLeaf;
using testing::kHyper;

// optax.adamw restated with plain float operations (no fused multiply-add on this target),
// bias corrections applied as products with their reciprocals (adamw_math.h says why).
void optax_step(float g, float& w, float& m, float& v, const float* s) {
  m = 0.1f * g + 0.9f * m;
  v = 0.001f * (g * g) + 0.999f * v;
  const float inv_bc1 = 1.0f / s[1], inv_bc2 = 1.0f / s[2];
  const float m_hat = m * inv_bc1, v_hat = v * inv_bc2;
  float u = m_hat / (std::sqrt(v_hat + 0.0f) + 1e-8f);
  u = u + 1e-4f * w;
  w = w + (-s[0]) * u;
}

// The split master (adamw_math.h): a bijection on every fp32 bit pattern but NaNs (which stay
// NaN), whose p is the master rounded to nearest, ties away from zero -- so it differs from
// round to nearest even only on exact ties whose upper half is even.
TEST(SplitMaster, JoinsBackExactlyAndRoundsToNearestTiesAway) {
  PIMHBM_SEED_TRACE();
  auto rng = rng_for_test();
  std::vector<uint32_t> patterns;
  for (uint32_t hi : {0x0000u, 0x0001u, 0x3F80u, 0x3F81u, 0x7F7Eu, 0x7F7Fu, 0x7F80u, 0x7FC0u}) {
    for (uint32_t sign : {0u, 0x80000000u}) {
      for (uint32_t lo : {0x0000u, 0x0001u, 0x7FFFu, 0x8000u, 0x8001u, 0xFFFFu}) {
        patterns.push_back(sign | hi << 16 | lo);
      }
    }
  }
  for (int k = 0; k < (1 << 22); ++k) patterns.push_back(static_cast<uint32_t>(rng()));
  int ties_differ = 0;
  for (const uint32_t bits : patterns) {
    const float w = bits_float(bits);
    const SplitMaster s = split_master(w);
    const float back = join_master(s.p, s.r);
    if (std::isnan(w)) {
      ASSERT_TRUE(std::isnan(back)) << std::hex << bits;
      ASSERT_EQ(s.p, 0x7FC0u) << std::hex << bits;
      ASSERT_EQ(s.r, 0u) << std::hex << bits;
      continue;
    }
    ASSERT_EQ(float_bits(back), bits) << std::hex << bits;
    const uint16_t even = float_to_bf16(w);
    const uint32_t lo = bits & 0xFFFFu, hi = bits >> 16;
    if (lo == 0x8000u && hi % 2 == 0) {  // a tie that round to nearest even keeps down
      ASSERT_EQ(s.p, static_cast<uint16_t>(hi + 1)) << std::hex << bits;
      ASSERT_EQ(even, static_cast<uint16_t>(hi)) << std::hex << bits;
      ++ties_differ;
    } else {
      ASSERT_EQ(s.p, even) << std::hex << bits;
    }
  }
  EXPECT_GT(ties_differ, 0);
}

// Bit patterns near every boundary the update's finiteness tests draw (zeros, the denormals,
// the largest finite values, the split limit 0x7F7F8000, the infinities, NaNs), both signs,
// and random ones.
std::vector<uint32_t> edge_patterns(std::mt19937_64& rng) {
  std::vector<uint32_t> out;
  for (uint32_t base : {0x00000000u, 0x00800000u, 0x3F800000u, 0x7F7F0000u, 0x7F7F8000u,
                        0x7F800000u, 0x7FC00000u}) {
    for (int d = -3; d <= 3; ++d) {
      for (uint32_t sign : {0u, 0x80000000u}) out.push_back(sign | (base + d) & 0x7FFFFFFFu);
    }
  }
  for (int k = 0; k < (1 << 20); ++k) out.push_back(static_cast<uint32_t>(rng()));
  return out;
}

// The GPU kernel's one-compare tests agree with the reference's bit tests on every pattern:
// split_finite(w) is "split_master(w)'s parameter is finite" and "w's bf16 rounding is finite"
// (finite_bits on them), finite_f32 is finite_bits of the fp32 word.
TEST(InPlaceMath, FloatComparesAreTheReferencesBitTests) {
  PIMHBM_SEED_TRACE();
  auto rng = rng_for_test();
  int split_limits = 0;
  for (const uint32_t bits : edge_patterns(rng)) {
    const float w = bits_float(bits);
    ASSERT_EQ(split_finite(w), finite_bits(split_master(w).p, true)) << std::hex << bits;
    // ... and "w rounded to a bf16 parameter (nearest even) is finite": the kernel's test of
    // bf16 parameters without master weights.
    ASSERT_EQ(split_finite(w), finite_bits(float_to_bf16(w), true)) << std::hex << bits;
    ASSERT_EQ(finite_f32(w), finite_bits(bits, false)) << std::hex << bits;
    split_limits += finite_bits(bits, false) && !split_finite(w);  // finite, yet p overflows
  }
  EXPECT_GT(split_limits, 0);  // the patterns reach the split limit
}

// adamw_element<false> (eps_root's addition left out) gives adamw_element's bits for every
// state and gradient wherever eps_root_free holds; where eps_root is not zero it does not (the
// control: the comparison sees a difference when there is one).
TEST(AdamWElement, LeavingOutAZeroEpsRootChangesNoBit) {
  PIMHBM_SEED_TRACE();
  auto rng = rng_for_test();
  const std::vector<uint32_t> patterns = edge_patterns(rng);
  const auto pick = [&] { return bits_float(patterns[rng() % patterns.size()]); };
  const AdamWStep step = adamw_step(std::array<float, 3>{1e-3f, 0.1f, 0.001f}.data());
  for (const float eps_root : {0.0f, -0.0f, 1e-12f}) {
    AdamWHyper h = testing::kHyper;
    h.eps_root = eps_root;
    int differ = 0;
    for (int k = 0; k < (1 << 20); ++k) {
      float w0 = pick(), m0 = std::fabs(pick()), v0 = std::fabs(pick());
      const float g = pick();
      if (k % 4 == 0) v0 = -0.0f;  // the one value whose root's sign the addition changes
      float w1 = w0, m1 = m0, v1 = v0;
      adamw_element<true>(g, w0, m0, v0, h, step);
      adamw_element<false>(g, w1, m1, v1, h, step);
      const bool same = float_bits(w0) == float_bits(w1) && float_bits(m0) == float_bits(m1) &&
                        float_bits(v0) == float_bits(v1);
      if (eps_root_free(h)) ASSERT_TRUE(same) << k;
      differ += same ? 0 : 1;
    }
    if (!eps_root_free(h)) EXPECT_GT(differ, 0);
  }
}

class AdamWCpu : public ::testing::TestWithParam<std::tuple<bool, bool>> {};

TEST_P(AdamWCpu, MatchesOptaxFormulasAndWritesTheDigestsOfWhatItWrote) {
  PIMHBM_SEED_TRACE();
  auto rng = rng_for_test();
  const auto [bf16, master] = GetParam();
  const float step[3] = {1e-3f, 1.0f - std::pow(0.9f, 3.0f), 1.0f - std::pow(0.999f, 3.0f)};
  for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{3}, int64_t{17}, int64_t{1000}, int64_t{16384},
                    int64_t{40001}}) {
    HostLeaf h(rng, n, 16 * (1 + static_cast<int64_t>(rng() % 100)), bf16, master);
    adamw_cpu(h.view(), kHyper, step);
    for (int64_t i = 0; i < n; ++i) {
      float w = master ? h.master_of(h.p, h.w, i) : h.get(h.p, i), m = h.mu[i], v = h.nu[i];
      optax_step(h.get(h.g, i), w, m, v, step);
      ASSERT_EQ(h.mu_out[i], m) << i;
      ASSERT_EQ(h.nu_out[i], v) << i;
      if (master) {
        ASSERT_EQ(float_bits(h.master_of(h.p_out, h.w_out, i)), float_bits(w)) << i;
        ASSERT_EQ(h.get(h.p_out, i), bf16_to_float(split_master(w).p)) << i;
      } else {
        ASSERT_EQ(h.get(h.p_out, i), bf16 ? bf16_to_float(float_to_bf16(w)) : w) << i;
      }
    }
    EXPECT_EQ(h.dn_p, HostLeaf::table_of(h.p_out.data(), n, h.psize(), h.chunk));
    EXPECT_EQ(h.dn_mu, HostLeaf::table_of(h.mu_out.data(), n, 4, h.chunk));
    EXPECT_EQ(h.dn_nu, HostLeaf::table_of(h.nu_out.data(), n, 4, h.chunk));
    if (master) EXPECT_EQ(h.dn_w, HostLeaf::table_of(h.w_out.data(), n, 2, h.chunk));
    for (int64_t c = 0; c < h.chunks(); ++c) {
      EXPECT_EQ(h.faults[c], 0);
      EXPECT_EQ(h.bad[c], 0);
    }
    EXPECT_EQ(h.totals, (std::vector<uint64_t>{0, 0}));
  }
}

// eps 0 where both moments are 0 makes every new value 0 / 0; a finite gradient whose square
// overflows makes the second moment infinite: each such element counts as one with a NaN
// gradient (the step commits nothing), and the counts are exact with intact state.
TEST_P(AdamWCpu, CountsElementsWhoseNewValuesAreNotFinite) {
  PIMHBM_SEED_TRACE();
  auto rng = rng_for_test();
  const auto [bf16, master] = GetParam();
  const float step[3] = {1e-3f, 0.1f, 0.001f};
  // A ragged length, a chunk of any size the kernels take, the eps-0 elements anywhere.
  HostLeaf h(rng, 3000 + static_cast<int64_t>(rng() % 100), 16 * (1 + rng() % 64), bf16, master);
  std::vector<int32_t> want(h.chunks(), 0);
  const int64_t huge = static_cast<int64_t>(rng() % h.n);
  int64_t zeros = 0;
  for (int64_t i = 0; i < h.n; ++i) {
    if (i == huge || rng() % 4 != 0) continue;
    h.set(h.g, i, 0.0f);
    h.mu[i] = h.nu[i] = 0.0f;
    ++want[i / h.chunk];
    ++zeros;
  }
  h.set(h.g, huge, 1e30f);
  ++want[huge / h.chunk];
  h.d_mu = HostLeaf::table_of(h.mu.data(), h.n, 4, h.chunk);
  h.d_nu = HostLeaf::table_of(h.nu.data(), h.n, 4, h.chunk);
  AdamWHyper eps0 = kHyper;
  eps0.eps = 0.0f;
  adamw_cpu(h.view(), eps0, step);
  EXPECT_EQ(h.faults, std::vector<int32_t>(h.chunks(), 0));
  EXPECT_EQ(h.bad, want);
  EXPECT_EQ(h.totals, (std::vector<uint64_t>{0, static_cast<uint64_t>(zeros + 1)}));
  // Control: eps 1e-8 (kHyper) makes the zeros' new values finite; the overflow still counts.
  HostLeaf again = h;
  again.bad.assign(h.chunks(), -1);
  again.totals.assign(2, 0);
  adamw_cpu(again.view(), kHyper, step);
  std::vector<int32_t> one(h.chunks(), 0);
  one[huge / h.chunk] = 1;
  EXPECT_EQ(again.bad, one);
  EXPECT_EQ(again.totals, (std::vector<uint64_t>{0, 1}));
}

TEST_P(AdamWCpu, ReportsDamagedStateAndNonFiniteGradientsByChunk) {
  PIMHBM_SEED_TRACE();
  auto rng = rng_for_test();
  const auto [bf16, master] = GetParam();
  const float step[3] = {1e-3f, 0.1f, 0.001f};
  HostLeaf h(rng, 50000, 1024, bf16, master);
  // One bit flipped in each state tensor, NaN/Inf in the gradient, at random places.
  const int64_t ip = rng() % h.n, imu = rng() % h.n, inu = rng() % h.n, iw = rng() % h.n;
  h.p[ip * h.psize() + rng() % h.psize()] ^= static_cast<uint8_t>(1u << (rng() % 8));
  reinterpret_cast<uint8_t*>(h.mu.data())[imu * 4 + rng() % 4] ^=
      static_cast<uint8_t>(1u << (rng() % 8));
  reinterpret_cast<uint8_t*>(h.nu.data())[inu * 4 + rng() % 4] ^=
      static_cast<uint8_t>(1u << (rng() % 8));
  if (master) reinterpret_cast<uint8_t*>(h.w.data())[iw * 2 + rng() % 2] ^= 0x10;
  std::vector<int32_t> want_bad(h.chunks(), 0);
  for (int k = 0; k < 7; ++k) {
    const int64_t i = rng() % h.n;
    if (!std::isfinite(h.get(h.g, i))) continue;
    h.set(h.g, i, k % 2 ? INFINITY : NAN);
    ++want_bad[i / h.chunk];
  }
  // Each damaged element whose gradient is finite may overflow: one more count at the most.
  std::vector<int32_t> may_overflow(h.chunks(), 0);
  std::vector<int64_t> damaged{ip, imu, inu};
  if (master) damaged.push_back(iw);
  std::sort(damaged.begin(), damaged.end());
  damaged.erase(std::unique(damaged.begin(), damaged.end()), damaged.end());
  for (const int64_t i : damaged) may_overflow[i / h.chunk] += std::isfinite(h.get(h.g, i)) ? 1 : 0;
  adamw_cpu(h.view(), kHyper, step);
  std::vector<int32_t> want(h.chunks(), 0);
  want[ip / h.chunk] |= kFaultParam;
  want[imu / h.chunk] |= kFaultMu;
  want[inu / h.chunk] |= kFaultNu;
  if (master) want[iw / h.chunk] |= kFaultMaster;
  EXPECT_EQ(h.faults, want);
  // A flipped bit can make a damaged chunk's new values overflow: counted too (that chunk is
  // damaged anyway). Everywhere else the count is the gradients' non-finite values exactly.
  for (int64_t c = 0; c < h.chunks(); ++c) {
    if (want[c] == 0) {
      EXPECT_EQ(h.bad[c], want_bad[c]) << "chunk " << c;
    } else {
      EXPECT_GE(h.bad[c], want_bad[c]) << "chunk " << c;
      EXPECT_LE(h.bad[c], want_bad[c] + may_overflow[c]) << "chunk " << c;
    }
  }
  EXPECT_EQ(h.totals, h.totals_of_maps());
  EXPECT_GT(h.totals[0], 0u);
  EXPECT_GT(h.totals[1], 0u);
}

TEST(AdamWTotals, AddUpOverTheLeavesOfACall) {
  PIMHBM_SEED_TRACE();
  auto rng = rng_for_test();
  const float step[3] = {1e-3f, 0.1f, 0.001f};
  std::vector<uint64_t> shared{0, 0}, want{0, 0};
  for (int i = 0; i < 5; ++i) {
    HostLeaf h(rng, 1 + static_cast<int64_t>(rng() % 20000), 16 * (1 + rng() % 64), i % 2 == 1,
               i == 3);
    const int64_t k = rng() % h.n;
    reinterpret_cast<uint8_t*>(h.mu.data())[4 * k + rng() % 4] ^= 0x10;  // damage: one bit
    if (i % 2 == 0) h.set(h.g, rng() % h.n, NAN);
    AdamWLeaf L = h.view();
    L.totals = shared.data();
    adamw_cpu(L, kHyper, step);
    const auto t = h.totals_of_maps();
    want[0] += t[0], want[1] += t[1];
  }
  EXPECT_EQ(shared, want);
  EXPECT_EQ(want[0], 5u);
  EXPECT_EQ(want[1], 3u);
}

INSTANTIATE_TEST_SUITE_P(ParamKinds, AdamWCpu, testing::param_kinds(), testing::param_kind_name);

TEST(Restore, CopiesOnlyWhenTheStepDoesNotCommit) {
  PIMHBM_SEED_TRACE();
  auto rng = rng_for_test();
  auto a = ::pimhbm::testing::random_bytes(rng, 1001),
       b = ::pimhbm::testing::random_bytes(rng, 1001);
  const auto b0 = b;
  const int32_t commit = 1, skip = 0;
  restore_cpu(&commit, {{a.data(), b.data(), 1001}});
  EXPECT_EQ(b, b0);
  restore_cpu(&skip, {{a.data(), b.data(), 1001}});
  EXPECT_EQ(b, a);
}

}  // namespace
}  // namespace pimhbm::update
