// The wgmma kernels (attention_wgmma.h) against the CPU reference, to bf16 tolerance, and
// against the mma.sync kernels, on ragged sequence lengths (no multiple of the 64- or
// 128-row tiles, and one row), head dims 64 and 128, grouped heads, causal and full, batch 1 to
// 3; outputs poisoned first, so a value never written fails; two runs bitwise equal; the
// forward pass in both schedules. Skipped without an sm_90 GPU; run under compute-sanitizer
// with PIMHBM_TEST_SMALL=1.
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "attention/attention.h"
#include "attention/attention_wgmma.h"
#include "attention_test_util.h"
#include "cuda_test_util.h"

namespace pimhbm::attention {
namespace {

using testing::DeviceBuffer;
using testing::random_bf16;
using testing::relative_error;
using testing::where_wrong;

struct Out {
  std::vector<uint16_t> o;
  std::vector<float> lse;
};

// One forward call on the GPU: the wgmma kernel with a schedule, or the mma.sync one.
enum class Kernel { kMmaSync, kWgmmaSerial, kWgmmaScoresAhead };

void run(Kernel kernel, const Shape& s, const std::vector<uint16_t>& q,
         const std::vector<uint16_t>& k, const std::vector<uint16_t>& v, Out* out) {
  DeviceBuffer<uint16_t> q_(s.q_elems()), k_(s.kv_elems()), v_(s.kv_elems()), o_(s.q_elems());
  DeviceBuffer<float> lse_(s.rows());
  PIMHBM_ASSERT_CUDA(q_.upload(q));
  PIMHBM_ASSERT_CUDA(k_.upload(k));
  PIMHBM_ASSERT_CUDA(v_.upload(v));
  PIMHBM_ASSERT_CUDA(o_.poison());
  PIMHBM_ASSERT_CUDA(lse_.poison());
  const Forward call{s, q_.get(), k_.get(), v_.get(), o_.get(), lse_.get()};
  switch (kernel) {
    case Kernel::kMmaSync:
      PIMHBM_ASSERT_CUDA(forward_cuda(call, 0));
      break;
    case Kernel::kWgmmaSerial:
      PIMHBM_ASSERT_CUDA(forward_wgmma(call, WgmmaSchedule::kSerial, 0));
      break;
    case Kernel::kWgmmaScoresAhead:
      PIMHBM_ASSERT_CUDA(forward_wgmma(call, WgmmaSchedule::kScoresAhead, 0));
      break;
  }
  PIMHBM_ASSERT_CUDA(cudaDeviceSynchronize());
  PIMHBM_ASSERT_DOWNLOAD(out->o, o_);
  PIMHBM_ASSERT_DOWNLOAD(out->lse, lse_);
}

using Case = std::tuple<Shape, Kernel>;

class WgmmaForward : public ::testing::TestWithParam<Case> {};

TEST_P(WgmmaForward, MatchesCpuAndMmaSyncAndRepeats) {
  PIMHBM_SKIP_WITHOUT_SM90();
  const auto& [s, kernel] = GetParam();
  std::mt19937 gen(std::random_device{}());
  const auto q = random_bf16(s.q_elems(), gen), k = random_bf16(s.kv_elems(), gen),
             v = random_bf16(s.kv_elems(), gen);
  Out want{std::vector<uint16_t>(s.q_elems()), std::vector<float>(s.rows())};
  forward_cpu(Forward{s, q.data(), k.data(), v.data(), want.o.data(), want.lse.data()});
  Out got, again, mma_sync;
  ASSERT_NO_FATAL_FAILURE(run(kernel, s, q, k, v, &got));
  const auto o_at = testing::bthd(s.seq, s.heads, s.head_dim);
  const auto lse_at = [seq = s.seq](int64_t i) { return testing::Position{i % seq, 0}; };
  EXPECT_LE(relative_error(got.o, want.o), 2e-2) << where_wrong(got.o, want.o, o_at);
  EXPECT_LE(relative_error(got.lse, want.lse), 1e-3)
      << where_wrong(got.lse, want.lse, lse_at, 1e-3);
  ASSERT_NO_FATAL_FAILURE(run(Kernel::kMmaSync, s, q, k, v, &mma_sync));
  EXPECT_LE(relative_error(got.o, mma_sync.o), 2e-2) << where_wrong(got.o, mma_sync.o, o_at);
  ASSERT_NO_FATAL_FAILURE(run(kernel, s, q, k, v, &again));
  EXPECT_EQ(got.o, again.o);
  EXPECT_EQ(got.lse, again.lse);
}

std::vector<Shape> shapes() {
  const bool small = testing::small_sizes();
  // batch, seq, heads, kv_heads, head_dim, causal
  return {{1, 1, 2, 1, 64, true},    {2, 63, 4, 2, 64, true},
          {1, 129, 4, 1, 128, true}, {3, small ? 200 : 333, 8, 2, 128, true},
          {1, 100, 2, 2, 64, false}, {1, small ? 129 : 257, 4, 2, 128, false},
          {1, 128, 2, 1, 128, true}, {2, small ? 300 : 1000, 4, 1, 128, true},
          {3, 385, 4, 4, 64, true}};
}

std::string name_of(const Shape& s) {
  return "b" + std::to_string(s.batch) + "_t" + std::to_string(s.seq) + "_h" +
         std::to_string(s.heads) + "_" + std::to_string(s.kv_heads) + "_d" +
         std::to_string(s.head_dim) + (s.causal ? "_causal" : "_full");
}

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  const auto& [s, kernel] = info.param;
  return std::string(kernel == Kernel::kWgmmaSerial ? "serial_" : "ahead_") + name_of(s);
}

INSTANTIATE_TEST_SUITE_P(Shapes, WgmmaForward,
                         ::testing::Combine(::testing::ValuesIn(shapes()),
                                            ::testing::Values(Kernel::kWgmmaSerial,
                                                              Kernel::kWgmmaScoresAhead)),
                         case_name);

struct Grads {
  std::vector<uint16_t> dq, dk, dv;
};

// One backward call on the GPU from the reference's forward outputs: the wgmma kernels or the
// mma.sync ones.
void run_backward(bool wgmma, const Shape& s, const std::vector<uint16_t>& q,
                  const std::vector<uint16_t>& k, const std::vector<uint16_t>& v, const Out& fwd,
                  const std::vector<uint16_t>& d_o, Grads* out) {
  DeviceBuffer<uint16_t> q_(s.q_elems()), k_(s.kv_elems()), v_(s.kv_elems()), o_(s.q_elems()),
      do_(s.q_elems()), dq_(s.q_elems()), dk_(s.kv_elems()), dv_(s.kv_elems());
  DeviceBuffer<float> lse_(s.rows()), delta_(s.rows());
  PIMHBM_ASSERT_CUDA(q_.upload(q));
  PIMHBM_ASSERT_CUDA(k_.upload(k));
  PIMHBM_ASSERT_CUDA(v_.upload(v));
  PIMHBM_ASSERT_CUDA(o_.upload(fwd.o));
  PIMHBM_ASSERT_CUDA(lse_.upload(fwd.lse));
  PIMHBM_ASSERT_CUDA(do_.upload(d_o));
  for (auto* b : {&dq_, &dk_, &dv_}) PIMHBM_ASSERT_CUDA(b->poison());
  PIMHBM_ASSERT_CUDA(delta_.poison());
  const Backward call{s,          q_.get(),     k_.get(),  v_.get(),  o_.get(), do_.get(),
                      lse_.get(), delta_.get(), dq_.get(), dk_.get(), dv_.get()};
  PIMHBM_ASSERT_CUDA(wgmma ? backward_wgmma(call, 0) : backward_cuda(call, 0));
  PIMHBM_ASSERT_CUDA(cudaDeviceSynchronize());
  PIMHBM_ASSERT_DOWNLOAD(out->dq, dq_);
  PIMHBM_ASSERT_DOWNLOAD(out->dk, dk_);
  PIMHBM_ASSERT_DOWNLOAD(out->dv, dv_);
}

class WgmmaBackward : public ::testing::TestWithParam<Shape> {};

TEST_P(WgmmaBackward, MatchesCpuAndMmaSyncAndRepeats) {
  PIMHBM_SKIP_WITHOUT_SM90();
  const Shape s = GetParam();
  std::mt19937 gen(std::random_device{}());
  const auto q = random_bf16(s.q_elems(), gen), k = random_bf16(s.kv_elems(), gen),
             v = random_bf16(s.kv_elems(), gen), d_o = random_bf16(s.q_elems(), gen);
  Out fwd{std::vector<uint16_t>(s.q_elems()), std::vector<float>(s.rows())};
  forward_cpu(Forward{s, q.data(), k.data(), v.data(), fwd.o.data(), fwd.lse.data()});
  Grads want{std::vector<uint16_t>(s.q_elems()), std::vector<uint16_t>(s.kv_elems()),
             std::vector<uint16_t>(s.kv_elems())};
  std::vector<float> delta(s.rows());
  backward_cpu(Backward{s, q.data(), k.data(), v.data(), fwd.o.data(), d_o.data(), fwd.lse.data(),
                        delta.data(), want.dq.data(), want.dk.data(), want.dv.data()});
  Grads got, again, mma_sync;
  ASSERT_NO_FATAL_FAILURE(run_backward(true, s, q, k, v, fwd, d_o, &got));
  ASSERT_NO_FATAL_FAILURE(run_backward(false, s, q, k, v, fwd, d_o, &mma_sync));
  for (const auto& [name, g, w, ref] : {std::tuple{"dq", &got.dq, &want.dq, &mma_sync.dq},
                                        std::tuple{"dk", &got.dk, &want.dk, &mma_sync.dk},
                                        std::tuple{"dv", &got.dv, &want.dv, &mma_sync.dv}}) {
    const auto at = testing::bthd(s.seq, name[1] == 'q' ? s.heads : s.kv_heads, s.head_dim);
    EXPECT_LE(relative_error(*g, *w), 2e-2)
        << name << " against the CPU reference: " << where_wrong(*g, *w, at);
    EXPECT_LE(relative_error(*g, *ref), 2e-2)
        << name << " against the mma.sync kernels: " << where_wrong(*g, *ref, at);
  }
  ASSERT_NO_FATAL_FAILURE(run_backward(true, s, q, k, v, fwd, d_o, &again));
  EXPECT_EQ(got.dq, again.dq);
  EXPECT_EQ(got.dk, again.dk);
  EXPECT_EQ(got.dv, again.dv);
}

std::string shape_name(const ::testing::TestParamInfo<Shape>& info) { return name_of(info.param); }

INSTANTIATE_TEST_SUITE_P(Shapes, WgmmaBackward, ::testing::ValuesIn(shapes()), shape_name);

TEST(WgmmaDispatch, TakesAnSm90DeviceAtItsHeadDimsOnly) {
  PIMHBM_SKIP_WITHOUT_SM90();
  for (int64_t d : {16, 32, 64, 128, 256}) {
    bool takes = !wgmma_head_dim(d);  // the opposite of the answer expected
    PIMHBM_ASSERT_CUDA(wgmma_takes(d, &takes));
    EXPECT_EQ(takes, wgmma_head_dim(d)) << "head dim " << d;
  }
}

TEST(WgmmaErrors, RefuseHeadDimsTheyAreNotBuiltFor) {
  // Checked before any device is touched: holds with or without a GPU.
  for (int64_t d : {16, 32, 96, 256}) {
    const Shape s{1, 8, 2, 1, d, true};
    EXPECT_EQ(forward_wgmma(Forward{s, nullptr, nullptr, nullptr, nullptr, nullptr},
                            WgmmaSchedule::kSerial, 0),
              cudaErrorInvalidValue)
        << "head dim " << d;
    EXPECT_EQ(backward_wgmma(Backward{s, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
                                      nullptr, nullptr, nullptr, nullptr},
                             0),
              cudaErrorInvalidValue)
        << "head dim " << d;
  }
}

}  // namespace
}  // namespace pimhbm::attention
