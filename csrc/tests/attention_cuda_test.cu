// The attention kernels against the CPU reference, to bf16 tolerance, on ragged sequence
// lengths (no multiple of the 64-row tile), both head dims, grouped heads, causal and full;
// outputs poisoned first, so a value never written fails; two runs bitwise equal. Run under
// compute-sanitizer with PIMHBM_TEST_SMALL=1.
#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "attention/attention.h"
#include "attention_test_util.h"
#include "cuda_test_util.h"

namespace pimhbm::attention {
namespace {

using testing::DeviceBuffer;
using testing::random_bf16;
using testing::relative_error;

struct Outputs {
  std::vector<uint16_t> o, dq, dk, dv;
  std::vector<float> lse;
};

void run_gpu(const Shape& s, const std::vector<uint16_t>& q, const std::vector<uint16_t>& k,
             const std::vector<uint16_t>& v, const std::vector<uint16_t>& d_o, Outputs* out) {
  DeviceBuffer<uint16_t> dq_(s.q_elems()), dk_(s.kv_elems()), dv_(s.kv_elems()), q_(s.q_elems()),
      k_(s.kv_elems()), v_(s.kv_elems()), o_(s.q_elems()), do_(s.q_elems());
  DeviceBuffer<float> lse_(s.rows()), delta_(s.rows());
  PIMHBM_ASSERT_CUDA(q_.upload(q));
  PIMHBM_ASSERT_CUDA(k_.upload(k));
  PIMHBM_ASSERT_CUDA(v_.upload(v));
  PIMHBM_ASSERT_CUDA(do_.upload(d_o));
  for (auto* b : {&o_, &dq_, &dk_, &dv_}) PIMHBM_ASSERT_CUDA(b->poison());
  PIMHBM_ASSERT_CUDA(lse_.poison());
  PIMHBM_ASSERT_CUDA(
      forward_cuda(Forward{s, q_.get(), k_.get(), v_.get(), o_.get(), lse_.get()}, 0));
  PIMHBM_ASSERT_CUDA(
      backward_cuda(Backward{s, q_.get(), k_.get(), v_.get(), o_.get(), do_.get(), lse_.get(),
                             delta_.get(), dq_.get(), dk_.get(), dv_.get()},
                    0));
  PIMHBM_ASSERT_CUDA(cudaDeviceSynchronize());
  PIMHBM_ASSERT_DOWNLOAD(out->o, o_);
  PIMHBM_ASSERT_DOWNLOAD(out->dq, dq_);
  PIMHBM_ASSERT_DOWNLOAD(out->dk, dk_);
  PIMHBM_ASSERT_DOWNLOAD(out->dv, dv_);
  PIMHBM_ASSERT_DOWNLOAD(out->lse, lse_);
}

class AttentionCuda : public ::testing::TestWithParam<Shape> {};

TEST_P(AttentionCuda, MatchesCpuAndRepeats) {
  PIMHBM_SKIP_WITHOUT_GPU();
  const Shape s = GetParam();
  std::mt19937 gen(std::random_device{}());
  const auto q = random_bf16(s.q_elems(), gen), k = random_bf16(s.kv_elems(), gen),
             v = random_bf16(s.kv_elems(), gen), d_o = random_bf16(s.q_elems(), gen);
  Outputs want{std::vector<uint16_t>(s.q_elems()), std::vector<uint16_t>(s.q_elems()),
               std::vector<uint16_t>(s.kv_elems()), std::vector<uint16_t>(s.kv_elems()),
               std::vector<float>(s.rows())};
  std::vector<float> delta(s.rows());
  forward_cpu(Forward{s, q.data(), k.data(), v.data(), want.o.data(), want.lse.data()});
  backward_cpu(Backward{s, q.data(), k.data(), v.data(), want.o.data(), d_o.data(), want.lse.data(),
                        delta.data(), want.dq.data(), want.dk.data(), want.dv.data()});
  Outputs got, again;
  ASSERT_NO_FATAL_FAILURE(run_gpu(s, q, k, v, d_o, &got));
  constexpr double kTol = 2e-2;
  EXPECT_LE(relative_error(got.o, want.o), kTol);
  EXPECT_LE(relative_error(got.lse, want.lse), 1e-3);
  EXPECT_LE(relative_error(got.dq, want.dq), kTol);
  EXPECT_LE(relative_error(got.dk, want.dk), kTol);
  EXPECT_LE(relative_error(got.dv, want.dv), kTol);
  ASSERT_NO_FATAL_FAILURE(run_gpu(s, q, k, v, d_o, &again));
  EXPECT_EQ(got.o, again.o);
  EXPECT_EQ(got.dq, again.dq);
  EXPECT_EQ(got.dk, again.dk);
  EXPECT_EQ(got.dv, again.dv);
}

std::vector<Shape> shapes() {
  const bool small = testing::small_sizes();
  // batch, seq, heads, kv_heads, head_dim, causal
  return {{1, 1, 2, 1, 64, true},    {2, 63, 4, 2, 64, true},
          {1, 65, 4, 1, 128, true},  {2, small ? 70 : 333, 8, 2, 128, true},
          {1, 100, 2, 2, 64, false}, {1, small ? 129 : 257, 4, 2, 128, false},
          {2, 70, 4, 2, 16, true},   {1, small ? 97 : 300, 2, 1, 32, false}};
}

INSTANTIATE_TEST_SUITE_P(Shapes, AttentionCuda, ::testing::ValuesIn(shapes()));

}  // namespace
}  // namespace pimhbm::attention
