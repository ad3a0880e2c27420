// A HostLeaf (adamw_host_leaf.h) on the device, and the comparisons of a GPU update with the
// CPU reference. Shared by the CUDA update tests and the benchmark's variant tests.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "adamw_host_leaf.h"
#include "cuda_test_util.h"
#include "pimhbm/cuda_check.h"
#include "update/adamw.h"

namespace pimhbm::update::testing {

using ::pimhbm::testing::DeviceBuffer;

// A host vector and a device buffer of its size; up() and down() copy between them.
template <typename T>
struct OnDevice {
  std::vector<T>& host;
  DeviceBuffer<T> dev;
  explicit OnDevice(std::vector<T>& h) : host(h), dev(h.size()) {}
  cudaError_t up() { return dev.upload(host); }
  cudaError_t down() {
    cudaError_t err;
    host = dev.download(&err);
    return err;
  }
};

// The first error of a list of CUDA calls' results.
inline cudaError_t first_error(std::initializer_list<cudaError_t> results) {
  for (cudaError_t e : results) {
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

// A leaf's buffers on the device (and its device copy's, filled with HostCopy's pattern, when
// `with_copy`); finish() brings the results back into the host leaf (and the copy's into
// *copy_out).
struct DeviceLeaf {
  HostLeaf& h;
  HostCopy copy;
  OnDevice<uint8_t> p, g, p_out, c_p;
  OnDevice<uint16_t> w, w_out, c_w;
  OnDevice<float> mu, nu, mu_out, nu_out, c_mu, c_nu;
  OnDevice<uint32_t> d_p, d_w, d_mu, d_nu, dn_p, dn_w, dn_mu, dn_nu, c_dp, c_dw, c_dmu, c_dnu;
  OnDevice<int32_t> faults, bad;
  OnDevice<uint64_t> totals;
  AdamWLeaf L;

  DeviceLeaf(HostLeaf& host, bool with_copy)
      : h(host),
        copy(host),
        p(h.p),
        g(h.g),
        p_out(h.p_out),
        c_p(copy.p),
        w(h.w),
        w_out(h.w_out),
        c_w(copy.w),
        mu(h.mu),
        nu(h.nu),
        mu_out(h.mu_out),
        nu_out(h.nu_out),
        c_mu(copy.mu),
        c_nu(copy.nu),
        d_p(h.d_p),
        d_w(h.d_w),
        d_mu(h.d_mu),
        d_nu(h.d_nu),
        dn_p(h.dn_p),
        dn_w(h.dn_w),
        dn_mu(h.dn_mu),
        dn_nu(h.dn_nu),
        c_dp(copy.dp),
        c_dw(copy.dw),
        c_dmu(copy.dmu),
        c_dnu(copy.dnu),
        faults(h.faults),
        bad(h.bad),
        totals(h.totals) {
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
    if (with_copy) {
      L.has_copy = true;
      L.p_copy = c_p.dev.get(), L.master_copy = c_w.dev.get(), L.mu_copy = c_mu.dev.get();
      L.nu_copy = c_nu.dev.get();
      L.dc_p = c_dp.dev.get(), L.dc_master = c_dw.dev.get(), L.dc_mu = c_dmu.dev.get();
      L.dc_nu = c_dnu.dev.get();
    }
  }

  cudaError_t upload() {
    return first_error({p.up(),     g.up(),      p_out.up(),  w.up(),     mu.up(),    nu.up(),
                        w_out.up(), mu_out.up(), nu_out.up(), d_p.up(),   d_w.up(),   d_mu.up(),
                        d_nu.up(),  dn_p.up(),   dn_w.up(),   dn_mu.up(), dn_nu.up(), faults.up(),
                        bad.up(),   c_p.up(),    c_w.up(),    c_mu.up(),  c_nu.up(),  c_dp.up(),
                        c_dw.up(),  c_dmu.up(),  c_dnu.up(),  totals.up()});
  }

  cudaError_t finish(HostCopy* copy_out) {
    PIMHBM_CUDA_RETURN_IF_ERROR(first_error(
        {p_out.down(), w_out.down(), mu_out.down(), nu_out.down(), dn_p.down(), dn_w.down(),
         dn_mu.down(), dn_nu.down(), faults.down(), bad.down(), totals.down()}));
    if (copy_out == nullptr) return cudaSuccess;
    PIMHBM_CUDA_RETURN_IF_ERROR(
        first_error({c_p.down(), c_w.down(), c_mu.down(), c_nu.down(), c_dp.down(), c_dw.down(),
                     c_dmu.down(), c_dnu.down()}));
    *copy_out = copy;
    return cudaSuccess;
  }
};

// Runs launch(leaf on the device, step in device memory) -- an update of one leaf -- on a copy
// of `h` and leaves the results in `h`'s write side (and the device copy's in *copy, when
// given).
template <typename Launch>
void run_gpu(HostLeaf& h, const float* step_host, Launch launch, HostCopy* copy = nullptr) {
  DeviceLeaf d(h, copy != nullptr);
  PIMHBM_ASSERT_CUDA(d.upload());
  DeviceBuffer<float> step(3);
  PIMHBM_ASSERT_CUDA(step.upload(std::vector<float>(step_host, step_host + 3)));
  PIMHBM_ASSERT_CUDA(launch(d.L, step.get()));
  PIMHBM_ASSERT_CUDA(cudaDeviceSynchronize());
  PIMHBM_ASSERT_CUDA(d.finish(copy));
}

// Every NaN bit pattern replaced by one; compared as bit patterns (NaN != NaN as floats).
inline std::vector<uint32_t> canonical(const std::vector<float>& v) {
  std::vector<uint32_t> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    const float x = std::isnan(v[i]) ? NAN : v[i];
    std::memcpy(&out[i], &x, 4);
  }
  return out;
}
inline std::vector<uint8_t> canonical_params(const HostLeaf& h, std::vector<uint8_t> v) {
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

inline void expect_same_but_nan_patterns(const HostLeaf& gpu, const HostLeaf& cpu,
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

// A vector's bytes: float vectors compared by value would call two equal NaN patterns unequal.
template <class T>
std::vector<uint8_t> bytes_of(const std::vector<T>& v) {
  std::vector<uint8_t> out(v.size() * sizeof(T));
  if (!v.empty()) std::memcpy(out.data(), v.data(), out.size());
  return out;
}

// The whole write side, bit for bit (tensors, then digest tables).
inline void expect_same_bits(const HostLeaf& gpu, const HostLeaf& cpu, const std::string& what) {
  const auto tensors = [](const HostLeaf& h) {
    return std::make_tuple(bytes_of(h.p_out), bytes_of(h.w_out), bytes_of(h.mu_out),
                           bytes_of(h.nu_out));
  };
  const auto tables = [](const HostLeaf& h) { return std::tie(h.dn_p, h.dn_w, h.dn_mu, h.dn_nu); };
  EXPECT_EQ(tensors(gpu), tensors(cpu)) << what;
  EXPECT_EQ(tables(gpu), tables(cpu)) << what;
}

// The device copy, bit for bit (tensors, then digest tables).
inline void expect_same_copy(const HostCopy& gpu, const HostCopy& cpu, const std::string& what) {
  const auto tensors = [](const HostCopy& c) {
    return std::make_tuple(bytes_of(c.p), bytes_of(c.w), bytes_of(c.mu), bytes_of(c.nu));
  };
  const auto tables = [](const HostCopy& c) { return std::tie(c.dp, c.dw, c.dmu, c.dnu); };
  EXPECT_EQ(tensors(gpu), tensors(cpu)) << what;
  EXPECT_EQ(tables(gpu), tables(cpu)) << what;
}

// One flipped bit in p, mu and (with master weights) the master of random elements, three
// NaN gradients, and a finite gradient whose square overflows the second moment (its new
// values are not all finite: counted with the NaN ones).
inline void damage(std::mt19937_64& rng, HostLeaf& h) {
  if (h.n == 0) return;
  h.p[(rng() % h.n) * h.psize()] ^= 0x04;
  reinterpret_cast<uint8_t*>(h.mu.data())[(rng() % h.n) * 4 + 3] ^= 0x80;
  if (h.master) h.w[rng() % h.n] ^= 0x0100;
  for (int k = 0; k < 3; ++k) h.set(h.g, rng() % h.n, NAN);
  h.set(h.g, rng() % h.n, 1e30f);
}

// A GPU update of `gpu` against the CPU reference's of the same input, `cpu`: the reports
// exactly; the state exactly, or with damaged input every NaN pattern made one (NaN
// gradients make NaN state, whose bit patterns differ between CPU and GPU arithmetic; such a
// step never commits) and the new digests only of chunks without a NaN gradient.
inline void expect_matches_cpu(const HostLeaf& gpu, const HostLeaf& cpu, bool damaged,
                               const std::string& what) {
  ASSERT_EQ(gpu.faults, cpu.faults) << what;
  ASSERT_EQ(gpu.bad, cpu.bad) << what;
  ASSERT_EQ(gpu.totals, cpu.totals) << what;
  ASSERT_EQ(cpu.totals, cpu.totals_of_maps()) << what;
  if (damaged) {
    expect_same_but_nan_patterns(gpu, cpu, what);
  } else {
    expect_same_bits(gpu, cpu, what);
  }
}

const float kStep[3] = {3e-4f, 0.271f, 0.002997f};

// The cases of the bit-for-bit tests of one kind of leaf: ragged sizes and chunk sizes (one
// random), damaged state and non-finite gradients or not. check(input, cpu, damaged, what)
// gets the leaf before the update and the CPU reference's update of it.
template <typename Check>
void for_each_update_case(std::mt19937_64& rng, bool bf16, bool master, Check check) {
  std::vector<int64_t> sizes = {0, 1, 2, 3, 5, 15, 16, 17, 1000, 16383, 16384, 16385, 100003};
  if (!::pimhbm::testing::small_sizes()) sizes.push_back(3000017);
  for (int64_t n : sizes) {
    for (int64_t chunk : {int64_t{16}, int64_t{1024}, int64_t{16384},
                          16 * (1 + static_cast<int64_t>(rng() % 3000))}) {
      for (bool damaged : {false, true}) {
        HostLeaf cpu(rng, n, chunk, bf16, master);
        if (damaged) damage(rng, cpu);
        const HostLeaf input = cpu;
        adamw_cpu(cpu.view(), kHyper, kStep);
        check(input, cpu, damaged, "n " + std::to_string(n) + " chunk " + std::to_string(chunk));
      }
    }
  }
}

// The cases of the device copy's tests: chunk sizes for every register layout of the one-read
// pass (1, 2, 4 groups per thread; 8192 elements do not fit and fall back), ragged tensor
// sizes, one random size of each, and one damaged state chunk (the copy must keep its old
// content there). check(input, cpu, cpu_copy, what): the CPU reference's update of the input
// and of its device copy (a HostCopy's pattern before).
template <typename Check>
void for_each_copy_case(std::mt19937_64& rng, bool bf16, bool master, Check check) {
  const int64_t random_n = 1 + static_cast<int64_t>(rng() % 200000);
  const int64_t random_chunk = 16 * (1 + static_cast<int64_t>(rng() % 512));
  for (int64_t n : {int64_t{1}, int64_t{5}, int64_t{4097}, int64_t{100003}, random_n}) {
    for (int64_t chunk : {int64_t{16}, int64_t{1024}, int64_t{2048}, int64_t{2064}, int64_t{4096},
                          int64_t{8192}, random_chunk}) {
      HostLeaf cpu(rng, n, chunk, bf16, master);
      cpu.mu[rng() % n] += 1.0f;
      const HostLeaf input = cpu;
      HostCopy cpu_copy(cpu);
      adamw_cpu(cpu_copy.attach(cpu.view()), kHyper, kStep);
      check(input, cpu, cpu_copy, "n " + std::to_string(n) + " chunk " + std::to_string(chunk));
    }
  }
}

// The device copy's update on the GPU against the CPU reference's.
inline void expect_copy_matches_cpu(const HostLeaf& gpu, const HostCopy& gpu_copy,
                                    const HostLeaf& cpu, const HostCopy& cpu_copy,
                                    const std::string& what) {
  ASSERT_EQ(gpu.faults, cpu.faults) << what;
  ASSERT_EQ(gpu.totals, cpu.totals) << what;
  ASSERT_EQ(gpu.p_out, cpu.p_out) << what;
  expect_same_copy(gpu_copy, cpu_copy, what);
}

// The leaves of one call of the tree tests: kinds mixed (fp32, bf16, bf16 + master), more
// leaves than one launch's table holds, empty and ragged leaves, damaged ones.
inline std::vector<HostLeaf> tree_leaves(std::mt19937_64& rng, int64_t chunk) {
  const int count = 70 + static_cast<int>(rng() % 20);
  std::vector<HostLeaf> leaves;
  for (int i = 0; i < count; ++i) {
    const int kind = static_cast<int>(rng() % 3);
    const int64_t n = i % 17 == 0 ? 0 : 1 + static_cast<int64_t>(rng() % 9000);
    leaves.emplace_back(rng, n, chunk, kind != 0, kind == 2);
    if (n != 0 && rng() % 4 == 0) damage(rng, leaves.back());
  }
  return leaves;
}

// Every leaf of `gpu` updated in one call, launch(leaves on the device, count, shared totals,
// step): each must equal its own CPU run of `cpu` (with the device copy when `with_copy`), and
// the call's totals the sum of theirs.
template <typename Launch>
void expect_tree_matches_cpu(std::vector<HostLeaf>& cpu, bool with_copy, Launch launch,
                             const std::string& what) {
  std::vector<HostLeaf> gpu = cpu;
  std::vector<std::unique_ptr<DeviceLeaf>> dev;
  std::vector<AdamWLeaf> leaves;
  DeviceBuffer<uint64_t> totals(2);  // the call's, shared by every leaf
  PIMHBM_ASSERT_CUDA(totals.upload(std::vector<uint64_t>{0, 0}));
  for (HostLeaf& h : gpu) {
    dev.push_back(std::make_unique<DeviceLeaf>(h, with_copy));
    PIMHBM_ASSERT_CUDA(dev.back()->upload());
    leaves.push_back(dev.back()->L);
    leaves.back().totals = totals.get();
  }
  DeviceBuffer<float> dstep(3);
  PIMHBM_ASSERT_CUDA(dstep.upload(std::vector<float>(kStep, kStep + 3)));
  PIMHBM_ASSERT_CUDA(launch(leaves.data(), leaves.size(), dstep.get()));
  PIMHBM_ASSERT_CUDA(cudaDeviceSynchronize());
  std::vector<uint64_t> want_totals{0, 0};
  for (size_t i = 0; i < cpu.size(); ++i) {
    HostCopy out(cpu[i]), want(cpu[i]);
    PIMHBM_ASSERT_CUDA(dev[i]->finish(with_copy ? &out : nullptr));
    adamw_cpu(with_copy ? want.attach(cpu[i].view()) : cpu[i].view(), kHyper, kStep);
    const std::string leaf = what + ", leaf " + std::to_string(i) + " of " +
                             std::to_string(cpu.size()) + ", n " + std::to_string(cpu[i].n);
    ASSERT_EQ(gpu[i].faults, cpu[i].faults) << leaf;
    ASSERT_EQ(gpu[i].bad, cpu[i].bad) << leaf;
    want_totals[0] += cpu[i].totals[0], want_totals[1] += cpu[i].totals[1];
    expect_same_but_nan_patterns(gpu[i], cpu[i], leaf);
    if (!with_copy) continue;
    ASSERT_EQ(canonical(out.mu), canonical(want.mu)) << leaf;
    ASSERT_EQ(canonical(out.nu), canonical(want.nu)) << leaf;
    ASSERT_EQ(out.w, want.w) << leaf;
    for (int64_t c = 0; c < cpu[i].chunks(); ++c) {  // NaN patterns differ: their digests too
      if (cpu[i].bad[c] != 0) continue;
      for (int k : {0, 1}) {
        ASSERT_EQ(out.dmu[2 * c + k], want.dmu[2 * c + k]) << leaf << " chunk " << c;
        ASSERT_EQ(out.dp[2 * c + k], want.dp[2 * c + k]) << leaf << " chunk " << c;
      }
    }
  }
  cudaError_t err;
  EXPECT_EQ(totals.download(&err), want_totals) << what;
  PIMHBM_ASSERT_CUDA(err);
  EXPECT_GT(want_totals[0], 0u);  // some leaves were damaged
}

}  // namespace pimhbm::update::testing
