// The fused CUDA update against the CPU reference, bit for bit: every parameter kind, ragged
// sizes and chunk sizes, damaged state and non-finite gradients; and the predicated restore.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <vector>

#include "adamw_host_leaf.h"
#include "cuda_test_util.h"
#include "test_util.h"
#include "update/adamw.h"
#include "update/restore.h"

namespace pimhbm::update {
namespace {

using ::pimhbm::testing::DeviceBuffer;
using ::pimhbm::testing::rng_for_test;
using testing::HostLeaf;
using testing::kHyper;

template <typename T>
struct Mirror {  // a host vector and its device copy
  std::vector<T>& host;
  DeviceBuffer<T> dev;
  explicit Mirror(std::vector<T>& h) : host(h), dev(h.size()) {}
  cudaError_t up() { return dev.upload(host); }
  cudaError_t down() {
    cudaError_t err;
    host = dev.download(&err);
    return err;
  }
};

// The device copy's side of a run.
struct MirrorOut {
  std::vector<uint8_t> p;
  std::vector<uint16_t> w;
  std::vector<float> mu, nu;
  std::vector<uint32_t> dp, dw, dmu, dnu;
};

// A leaf's buffers on the device (the mirror's filled with a pattern when `mirror`); finish()
// brings the results back into the host leaf (and the mirror's into *mirror_out).
struct DeviceLeaf {
  HostLeaf& h;
  Mirror<uint8_t> p, g, p_out;
  Mirror<uint16_t> w, w_out;
  Mirror<float> mu, nu, mu_out, nu_out;
  Mirror<uint32_t> d_p, d_w, d_mu, d_nu, dn_p, dn_w, dn_mu, dn_nu;
  Mirror<int32_t> faults, bad;
  Mirror<uint64_t> totals;
  std::vector<uint8_t> pm;
  std::vector<uint16_t> wm;
  std::vector<float> mum, num;
  std::vector<uint32_t> tp, tw, tmu, tnu;
  Mirror<uint8_t> m_p;
  Mirror<uint16_t> m_w;
  Mirror<float> m_mu, m_nu;
  Mirror<uint32_t> m_dp, m_dw, m_dmu, m_dnu;
  AdamWLeaf L;

  DeviceLeaf(HostLeaf& host, bool mirror)
      : h(host),
        p(h.p),
        g(h.g),
        p_out(h.p_out),
        w(h.w),
        mu(h.mu),
        nu(h.nu),
        w_out(h.w_out),
        mu_out(h.mu_out),
        nu_out(h.nu_out),
        d_p(h.d_p),
        d_w(h.d_w),
        d_mu(h.d_mu),
        d_nu(h.d_nu),
        dn_p(h.dn_p),
        dn_w(h.dn_w),
        dn_mu(h.dn_mu),
        dn_nu(h.dn_nu),
        faults(h.faults),
        bad(h.bad),
        totals(h.totals),
        pm(h.p.size(), 0x5A),
        wm(h.w.size(), 7),
        mum(h.n, 7.0f),
        num(h.n, 7.0f),
        tp(h.d_p.size(), 3),
        tw(h.d_w.size(), 3),
        tmu(h.d_mu.size(), 3),
        tnu(h.d_nu.size(), 3),
        m_p(pm),
        m_w(wm),
        m_mu(mum),
        m_nu(num),
        m_dp(tp),
        m_dw(tw),
        m_dmu(tmu),
        m_dnu(tnu) {
    L.n = h.n, L.chunk_elems = h.chunk, L.param_bf16 = h.bf16, L.has_master = h.master;
    L.p = p.dev.get(), L.master = w.dev.get(), L.mu = mu.dev.get(), L.nu = nu.dev.get();
    L.g = g.dev.get();
    L.d_p = d_p.dev.get(), L.d_master = d_w.dev.get(), L.d_mu = d_mu.dev.get();
    L.d_nu = d_nu.dev.get();
    L.p_out = p_out.dev.get(), L.master_out = w_out.dev.get(), L.mu_out = mu_out.dev.get();
    L.nu_out = nu_out.dev.get();
    L.dn_p = dn_p.dev.get(), L.dn_master = dn_w.dev.get(), L.dn_mu = dn_mu.dev.get();
    L.dn_nu = dn_nu.dev.get();
    L.faults = faults.dev.get(), L.grad_nonfinite = bad.dev.get();
    L.totals = totals.dev.get();
    if (mirror) {
      L.has_mirror = true;
      L.p_mirror = m_p.dev.get(), L.master_mirror = m_w.dev.get(), L.mu_mirror = m_mu.dev.get();
      L.nu_mirror = m_nu.dev.get();
      L.dm_p = m_dp.dev.get(), L.dm_master = m_dw.dev.get(), L.dm_mu = m_dmu.dev.get();
      L.dm_nu = m_dnu.dev.get();
    }
  }

  cudaError_t upload() {
    for (cudaError_t e :
         {p.up(),      g.up(),      p_out.up(), w.up(),      mu.up(),    nu.up(),    w_out.up(),
          mu_out.up(), nu_out.up(), d_p.up(),   d_w.up(),    d_mu.up(),  d_nu.up(),  dn_p.up(),
          dn_w.up(),   dn_mu.up(),  dn_nu.up(), faults.up(), bad.up(),   m_p.up(),   m_w.up(),
          m_mu.up(),   m_nu.up(),   m_dp.up(),  m_dw.up(),   m_dmu.up(), m_dnu.up(), totals.up()}) {
      if (e != cudaSuccess) return e;
    }
    return cudaSuccess;
  }

  cudaError_t finish(MirrorOut* mirror_out) {
    for (cudaError_t e :
         {p_out.down(), w_out.down(), mu_out.down(), nu_out.down(), dn_p.down(), dn_w.down(),
          dn_mu.down(), dn_nu.down(), faults.down(), bad.down(), totals.down()}) {
      if (e != cudaSuccess) return e;
    }
    if (mirror_out) {
      for (cudaError_t e : {m_p.down(), m_w.down(), m_mu.down(), m_nu.down(), m_dp.down(),
                            m_dw.down(), m_dmu.down(), m_dnu.down()}) {
        if (e != cudaSuccess) return e;
      }
      *mirror_out = MirrorOut{pm, wm, mum, num, tp, tw, tmu, tnu};
    }
    return cudaSuccess;
  }
};

// Runs the CUDA update on a copy of `h` and leaves the results in `h`'s write side (and the
// device copy's in *mirror, when given).
void run_gpu(HostLeaf& h, const float* step_host, AdamWLaunch launch, MirrorOut* mirror = nullptr) {
  DeviceLeaf d(h, mirror != nullptr);
  PIMHBM_ASSERT_CUDA(d.upload());
  DeviceBuffer<float> step(3);
  PIMHBM_ASSERT_CUDA(step.upload(std::vector<float>(step_host, step_host + 3)));
  PIMHBM_ASSERT_CUDA(adamw_cuda(d.L, kHyper, step.get(), nullptr, launch));
  PIMHBM_ASSERT_CUDA(cudaDeviceSynchronize());
  PIMHBM_ASSERT_CUDA(d.finish(mirror));
}

// Every NaN bit pattern replaced by one; compared as bit patterns (NaN != NaN as floats).
std::vector<uint32_t> canonical(const std::vector<float>& v) {
  std::vector<uint32_t> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    const float x = std::isnan(v[i]) ? NAN : v[i];
    std::memcpy(&out[i], &x, 4);
  }
  return out;
}
std::vector<uint8_t> canonical_params(const HostLeaf& h, std::vector<uint8_t> v) {
  for (int64_t i = 0; i < h.n; ++i) {
    if (std::isnan(h.get(v, i))) {
      if (h.bf16) {
        v[2 * i] = 0xC0, v[2 * i + 1] = 0x7F;
      } else {
        const float q = NAN;
        std::memcpy(v.data() + 4 * i, &q, 4);
      }
    }
  }
  return v;
}

void expect_same_but_nan_patterns(const HostLeaf& gpu, const HostLeaf& cpu,
                                  const std::string& what) {
  EXPECT_EQ(canonical_params(gpu, gpu.p_out), canonical_params(cpu, cpu.p_out)) << what;
  EXPECT_EQ(gpu.w_out, cpu.w_out) << what;  // a NaN master is stored canonical
  EXPECT_EQ(canonical(gpu.mu_out), canonical(cpu.mu_out)) << what;
  EXPECT_EQ(canonical(gpu.nu_out), canonical(cpu.nu_out)) << what;
  for (int64_t c = 0; c < cpu.chunks(); ++c) {
    if (cpu.bad[c] != 0) continue;
    using Table = std::vector<uint32_t> HostLeaf::*;
    for (Table t : {Table{&HostLeaf::dn_p}, Table{&HostLeaf::dn_w}, Table{&HostLeaf::dn_mu},
                    Table{&HostLeaf::dn_nu}}) {
      if ((cpu.*t).empty()) continue;
      EXPECT_EQ((gpu.*t)[2 * c], (cpu.*t)[2 * c]) << what << " chunk " << c;
      EXPECT_EQ((gpu.*t)[2 * c + 1], (cpu.*t)[2 * c + 1]) << what << " chunk " << c;
    }
  }
}

void damage(std::mt19937_64& rng, HostLeaf& h) {
  if (h.n == 0) return;
  h.p[(rng() % h.n) * h.psize()] ^= 0x04;
  reinterpret_cast<uint8_t*>(h.mu.data())[(rng() % h.n) * 4 + 3] ^= 0x80;
  if (h.master) h.w[rng() % h.n] ^= 0x0100;
  for (int k = 0; k < 3; ++k) h.set(h.g, rng() % h.n, NAN);
}

class AdamWCuda : public ::testing::TestWithParam<std::tuple<bool, bool>> {};

TEST_P(AdamWCuda, MatchesTheCpuReferenceBitForBit) {
  PIMHBM_SKIP_WITHOUT_GPU();
  PIMHBM_SEED_TRACE();
  auto rng = rng_for_test();
  const auto [bf16, master] = GetParam();
  const float step[3] = {3e-4f, 0.271f, 0.002997f};
  std::vector<int64_t> sizes = {0, 1, 2, 3, 5, 15, 16, 17, 1000, 16383, 16384, 16385, 100003};
  if (!::pimhbm::testing::small_sizes()) sizes.push_back(3000017);
  for (int64_t n : sizes) {
    for (int64_t chunk : {int64_t{16}, int64_t{1024}, int64_t{16384},
                          16 * (1 + static_cast<int64_t>(rng() % 3000))}) {
      for (bool damaged : {false, true}) {
        HostLeaf cpu(rng, n, chunk, bf16, master);
        if (damaged) damage(rng, cpu);
        const HostLeaf input = cpu;
        adamw_cpu(cpu.view(), kHyper, step);
        for (const AdamWLaunch launch :
             {AdamWLaunch{1}, AdamWLaunch{2}, AdamWLaunch{1, MirrorPass::kDefault, 2},
              AdamWLaunch{1, MirrorPass::kDefault, 4}, AdamWLaunch{1, MirrorPass::kDefault, 0, 2},
              AdamWLaunch{1, MirrorPass::kDefault, 0, 3},
              AdamWLaunch{1, MirrorPass::kDefault, 0, 4},
              AdamWLaunch{1, MirrorPass::kDefault, 0, 0, 4},
              AdamWLaunch{1, MirrorPass::kDefault, 0, 0, 0, true}}) {
          HostLeaf gpu = input;
          run_gpu(gpu, step, launch);
          const std::string what = "n " + std::to_string(n) + " chunk " + std::to_string(chunk) +
                                   " in flight " + std::to_string(launch.groups_in_flight) +
                                   " prefetch " + std::to_string(launch.prefetch) + " stages " +
                                   std::to_string(launch.stages) + " min blocks " +
                                   std::to_string(launch.min_blocks) + " plain loads " +
                                   std::to_string(launch.plain_loads);
          ASSERT_EQ(gpu.faults, cpu.faults) << what;
          ASSERT_EQ(gpu.bad, cpu.bad) << what;
          ASSERT_EQ(gpu.totals, cpu.totals) << what;
          ASSERT_EQ(cpu.totals, cpu.totals_of_maps()) << what;
          if (damaged) {
            // NaN gradients make NaN state, whose bit patterns differ between CPU and GPU
            // arithmetic; such a step never commits. Compare the state with every NaN
            // pattern made one, and the new digests only of chunks without a NaN gradient.
            expect_same_but_nan_patterns(gpu, cpu, what);
          } else {
            ASSERT_EQ(gpu.p_out, cpu.p_out) << what;
            ASSERT_EQ(gpu.w_out, cpu.w_out) << what;
            ASSERT_EQ(gpu.mu_out, cpu.mu_out) << what;
            ASSERT_EQ(gpu.nu_out, cpu.nu_out) << what;
            ASSERT_EQ(gpu.dn_p, cpu.dn_p) << what;
            ASSERT_EQ(gpu.dn_w, cpu.dn_w) << what;
            ASSERT_EQ(gpu.dn_mu, cpu.dn_mu) << what;
            ASSERT_EQ(gpu.dn_nu, cpu.dn_nu) << what;
          }
        }
      }
    }
  }
}

TEST_P(AdamWCuda, DeviceCopyMatchesTheCpuReference) {
  PIMHBM_SKIP_WITHOUT_GPU();
  PIMHBM_SEED_TRACE();
  auto rng = rng_for_test();
  const auto [bf16, master] = GetParam();
  const float step[3] = {3e-4f, 0.271f, 0.002997f};
  // Chunk sizes for every register layout of kRegisters (1, 2, 4 groups per thread; 8192
  // elements do not fit and fall back), ragged tensor sizes, and one random size of each.
  const int64_t random_n = 1 + static_cast<int64_t>(rng() % 200000);
  const int64_t random_chunk = 16 * (1 + static_cast<int64_t>(rng() % 512));
  for (int64_t n : {int64_t{1}, int64_t{5}, int64_t{4097}, int64_t{100003}, random_n}) {
    for (int64_t chunk : {int64_t{16}, int64_t{1024}, int64_t{2048}, int64_t{2064}, int64_t{4096},
                          int64_t{8192}, random_chunk}) {
      HostLeaf cpu(rng, n, chunk, bf16, master);
      // Damage one state chunk: the mirror must keep its old content there.
      cpu.mu[rng() % n] += 1.0f;
      HostLeaf gpu = cpu;
      std::vector<uint8_t> pm(cpu.p.size(), 0x5A);
      std::vector<uint16_t> wm(cpu.w.size(), 7);
      std::vector<float> mum(n, 7.0f), num(n, 7.0f);
      std::vector<uint32_t> tp(cpu.d_p.size(), 3), tw(cpu.d_w.size(), 3), tmu(cpu.d_mu.size(), 3),
          tnu(cpu.d_nu.size(), 3);
      AdamWLeaf L = cpu.view();
      L.has_mirror = true;
      L.p_mirror = pm.data(), L.master_mirror = wm.data(), L.mu_mirror = mum.data();
      L.nu_mirror = num.data();
      L.dm_p = tp.data(), L.dm_master = tw.data(), L.dm_mu = tmu.data(), L.dm_nu = tnu.data();
      adamw_cpu(L, kHyper, step);
      for (const AdamWLaunch launch :
           {AdamWLaunch{1, MirrorPass::kRegisters}, AdamWLaunch{1, MirrorPass::kTwoReads},
            AdamWLaunch{2, MirrorPass::kTwoReads}, AdamWLaunch{1, MirrorPass::kTwoReadsKeep},
            AdamWLaunch{0, MirrorPass::kDefault},
            AdamWLaunch{0, MirrorPass::kDefault, 0, 0, 0,
                        true}}) {  // plain loads: not with the copy
        HostLeaf g = gpu;
        MirrorOut out;
        run_gpu(g, step, launch, &out);
        const std::string what = "n " + std::to_string(n) + " chunk " + std::to_string(chunk) +
                                 " pass " + std::to_string(static_cast<int>(launch.mirror_pass)) +
                                 " in flight " + std::to_string(launch.groups_in_flight);
        ASSERT_EQ(g.faults, cpu.faults) << what;
        ASSERT_EQ(g.totals, cpu.totals) << what;
        ASSERT_EQ(g.p_out, cpu.p_out) << what;
        ASSERT_EQ(out.p, pm) << what;
        ASSERT_EQ(out.w, wm) << what;
        ASSERT_EQ(out.mu, mum) << what;
        ASSERT_EQ(out.nu, num) << what;
        ASSERT_EQ(out.dp, tp) << what;
        ASSERT_EQ(out.dw, tw) << what;
        ASSERT_EQ(out.dmu, tmu) << what;
        ASSERT_EQ(out.dnu, tnu) << what;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(ParamKinds, AdamWCuda,
                         ::testing::Values(std::make_tuple(false, false),
                                           std::make_tuple(true, false),
                                           std::make_tuple(true, true)),
                         [](const auto& info) {
                           return std::string(std::get<0>(info.param) ? "bf16" : "fp32") +
                                  (std::get<1>(info.param) ? "_master" : "");
                         });

// A tree's leaves in one call: kinds mixed (each kind its own launch, in the order given),
// more leaves than one launch's table holds, empty and ragged leaves, damaged ones; with and
// without the device copy. Every leaf must equal its own CPU run.
TEST(AdamWCudaTree, EveryLeafOfOneCallMatchesTheCpuReference) {
  PIMHBM_SKIP_WITHOUT_GPU();
  PIMHBM_SEED_TRACE();
  auto rng = rng_for_test();
  const float step[3] = {3e-4f, 0.271f, 0.002997f};
  // Without the device copy also through the shared-memory pipeline (3 stages), and with the
  // FFI's default launch (plain loads; stages -1 here).
  for (const auto [mirror, stages] :
       {std::pair{false, 0}, std::pair{false, 3}, std::pair{false, -1}, std::pair{true, 0}}) {
    const int64_t chunk = mirror ? 1024 : 16 * (1 + static_cast<int64_t>(rng() % 300));
    const int count = 70 + static_cast<int>(rng() % 20);
    std::vector<HostLeaf> cpu, gpu;
    for (int i = 0; i < count; ++i) {
      const int kind = static_cast<int>(rng() % 3);  // fp32, bf16, bf16 + master
      const int64_t n = i % 17 == 0 ? 0 : 1 + static_cast<int64_t>(rng() % 9000);
      cpu.emplace_back(rng, n, chunk, kind != 0, kind == 2);
      if (n != 0 && rng() % 4 == 0) damage(rng, cpu.back());
    }
    gpu = cpu;
    std::vector<std::unique_ptr<DeviceLeaf>> dev;
    std::vector<AdamWLeaf> leaves;
    DeviceBuffer<uint64_t> totals(2);  // the call's, shared by every leaf
    PIMHBM_ASSERT_CUDA(totals.upload(std::vector<uint64_t>{0, 0}));
    for (HostLeaf& h : gpu) {
      dev.push_back(std::make_unique<DeviceLeaf>(h, mirror));
      PIMHBM_ASSERT_CUDA(dev.back()->upload());
      leaves.push_back(dev.back()->L);
      leaves.back().totals = totals.get();
    }
    DeviceBuffer<float> dstep(3);
    PIMHBM_ASSERT_CUDA(dstep.upload(std::vector<float>(step, step + 3)));
    PIMHBM_ASSERT_CUDA(adamw_cuda(
        leaves.data(), leaves.size(), kHyper, dstep.get(), nullptr,
        stages < 0 ? default_launch() : AdamWLaunch{0, MirrorPass::kDefault, 0, stages}));
    PIMHBM_ASSERT_CUDA(cudaDeviceSynchronize());
    std::vector<uint64_t> want_totals{0, 0};
    for (int i = 0; i < count; ++i) {
      MirrorOut out;
      PIMHBM_ASSERT_CUDA(dev[i]->finish(mirror ? &out : nullptr));
      AdamWLeaf L = cpu[i].view();
      std::vector<uint8_t> pm(cpu[i].p.size(), 0x5A);
      std::vector<uint16_t> wm(cpu[i].w.size(), 7);
      std::vector<float> mum(cpu[i].n, 7.0f), num(cpu[i].n, 7.0f);
      std::vector<uint32_t> tp(cpu[i].d_p.size(), 3), tw(cpu[i].d_w.size(), 3),
          tmu(cpu[i].d_mu.size(), 3), tnu(cpu[i].d_nu.size(), 3);
      if (mirror) {
        L.has_mirror = true;
        L.p_mirror = pm.data(), L.master_mirror = wm.data(), L.mu_mirror = mum.data();
        L.nu_mirror = num.data();
        L.dm_p = tp.data(), L.dm_master = tw.data(), L.dm_mu = tmu.data(), L.dm_nu = tnu.data();
      }
      adamw_cpu(L, kHyper, step);
      const std::string what = "leaf " + std::to_string(i) + " of " + std::to_string(count) +
                               ", n " + std::to_string(cpu[i].n) + ", mirror " +
                               std::to_string(mirror) + ", stages " + std::to_string(stages);
      ASSERT_EQ(gpu[i].faults, cpu[i].faults) << what;
      ASSERT_EQ(gpu[i].bad, cpu[i].bad) << what;
      want_totals[0] += cpu[i].totals[0], want_totals[1] += cpu[i].totals[1];
      expect_same_but_nan_patterns(gpu[i], cpu[i], what);
      if (mirror) {
        ASSERT_EQ(canonical(out.mu), canonical(mum)) << what;
        ASSERT_EQ(canonical(out.nu), canonical(num)) << what;
        ASSERT_EQ(out.w, wm) << what;
        for (int64_t c = 0; c < cpu[i].chunks(); ++c) {  // NaN patterns differ: their digests too
          if (cpu[i].bad[c] != 0) continue;
          for (int k : {0, 1}) {
            ASSERT_EQ(out.dmu[2 * c + k], tmu[2 * c + k]) << what << " chunk " << c;
            ASSERT_EQ(out.dp[2 * c + k], tp[2 * c + k]) << what << " chunk " << c;
          }
        }
      }
    }
    cudaError_t err;
    EXPECT_EQ(totals.download(&err), want_totals) << "mirror " << mirror << ", stages " << stages;
    PIMHBM_ASSERT_CUDA(err);
    EXPECT_GT(want_totals[0], 0u);  // some leaves were damaged
  }
}

TEST(AdamWLaunchPlan, RegisterLayoutsCoverChunksUpTo4096Elements) {
  EXPECT_EQ(resident_groups(16), 1);
  EXPECT_EQ(resident_groups(1024), 1);
  EXPECT_EQ(resident_groups(1040), 2);
  EXPECT_EQ(resident_groups(2048), 2);
  EXPECT_EQ(resident_groups(2064), 4);
  EXPECT_EQ(resident_groups(4096), 4);
  EXPECT_EQ(resident_groups(4112), 0);
  EXPECT_EQ(resident_groups(16384), 0);
}

// Launch options out of range are refused before anything runs (no GPU needed).
TEST(AdamWLaunchPlan, RefusesOptionsOutOfRange) {
  AdamWLeaf leaf;
  for (const AdamWLaunch bad :
       {AdamWLaunch{3}, AdamWLaunch{-1}, AdamWLaunch{1, MirrorPass::kDefault, 3},
        AdamWLaunch{1, MirrorPass::kDefault, 0, 1}, AdamWLaunch{1, MirrorPass::kDefault, 0, 5},
        AdamWLaunch{1, MirrorPass::kDefault, 0, 0, 2},
        AdamWLaunch{1, MirrorPass::kDefault, 0, 0, 5}}) {
    EXPECT_EQ(adamw_cuda(&leaf, 1, kHyper, nullptr, nullptr, bad), cudaErrorInvalidValue)
        << bad.groups_in_flight << " " << bad.prefetch << " " << bad.stages << " "
        << bad.min_blocks;
  }
}

TEST(RestoreCuda, CopiesOnlyWhenTheStepDoesNotCommit) {
  PIMHBM_SKIP_WITHOUT_GPU();
  PIMHBM_SEED_TRACE();
  auto rng = rng_for_test();
  // More pairs than one launch takes, ragged and odd sizes.
  std::vector<std::vector<uint8_t>> src, dst;
  for (int k = 0; k < 70; ++k) {
    const size_t n = rng() % 5000;
    src.push_back(::pimhbm::testing::random_bytes(rng, n));
    dst.push_back(::pimhbm::testing::random_bytes(rng, n));
  }
  for (int32_t commit : {1, 0}) {
    std::vector<std::unique_ptr<DeviceBuffer<uint8_t>>> ds, dd;
    std::vector<CopyPair> pairs;
    for (size_t k = 0; k < src.size(); ++k) {
      ds.push_back(std::make_unique<DeviceBuffer<uint8_t>>(src[k].size()));
      dd.push_back(std::make_unique<DeviceBuffer<uint8_t>>(dst[k].size()));
      PIMHBM_ASSERT_CUDA(ds.back()->upload(src[k]));
      PIMHBM_ASSERT_CUDA(dd.back()->upload(dst[k]));
      pairs.push_back({ds.back()->get(), dd.back()->get(), static_cast<int64_t>(src[k].size())});
    }
    std::vector<int32_t> flag_host = {commit};
    DeviceBuffer<int32_t> flag(1);
    PIMHBM_ASSERT_CUDA(flag.upload(flag_host));
    PIMHBM_ASSERT_CUDA(restore_cuda(flag.get(), pairs, nullptr));
    PIMHBM_ASSERT_CUDA(cudaDeviceSynchronize());
    for (size_t k = 0; k < src.size(); ++k) {
      cudaError_t err;
      const auto got = dd[k]->download(&err);
      PIMHBM_ASSERT_CUDA(err);
      ASSERT_EQ(got, commit ? dst[k] : src[k]) << "pair " << k << " commit " << commit;
    }
  }
}

}  // namespace
}  // namespace pimhbm::update
