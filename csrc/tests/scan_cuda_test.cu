// The CUDA scan and verify kernels against the CPU reference, bit for bit: every dtype, ragged
// sizes from 0 up, many chunk sizes, launch shapes, misaligned views, damaged buffers.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "cuda_test_util.h"
#include "elem_samples.h"
#include "scan/scan.h"
#include "test_util.h"

namespace pimhbm {
namespace {

using testing::DeviceBuffer;
using testing::make_sample;
using testing::rng_for_test;

struct Results {
  std::vector<uint32_t> digests;
  std::vector<int32_t> nonfinite;
  std::vector<uint32_t> max_bits;  // max_abs compared as bit patterns
};

Results cpu_scan(const uint8_t* data, int64_t nbytes, Elem elem, int64_t chunk) {
  const int64_t n = num_chunks(nbytes, chunk);
  Results r{std::vector<uint32_t>(2 * n), std::vector<int32_t>(n), std::vector<uint32_t>(n)};
  std::vector<float> mx(n);
  scan::scan_cpu(data, nbytes, elem, chunk, r.digests.data(), r.nonfinite.data(), mx.data());
  std::memcpy(r.max_bits.data(), mx.data(), n * sizeof(float));
  return r;
}

// Runs the CUDA scan on `nbytes` at device address `data` (any alignment).
void gpu_scan(const void* data, int64_t nbytes, Elem elem, int64_t chunk,
              scan::LaunchShape shape, Results* out) {
  const int64_t n = num_chunks(nbytes, chunk);
  DeviceBuffer<uint32_t> digests(2 * n), max_bits(n);
  DeviceBuffer<int32_t> nonfinite(n);
  PIMHBM_ASSERT_CUDA(digests.poison());
  PIMHBM_ASSERT_CUDA(nonfinite.poison());
  PIMHBM_ASSERT_CUDA(max_bits.poison());
  PIMHBM_ASSERT_CUDA(scan::scan_cuda_shaped(data, nbytes, elem, chunk, digests.get(),
                                            nonfinite.get(),
                                            reinterpret_cast<float*>(max_bits.get()), nullptr,
                                            shape));
  PIMHBM_ASSERT_CUDA(cudaDeviceSynchronize());
  cudaError_t e1, e2, e3;
  out->digests = digests.download(&e1);
  out->nonfinite = nonfinite.download(&e2);
  out->max_bits = max_bits.download(&e3);
  PIMHBM_ASSERT_CUDA(e1);
  PIMHBM_ASSERT_CUDA(e2);
  PIMHBM_ASSERT_CUDA(e3);
}

void expect_same(const Results& want, const Results& got, const std::string& what) {
  ASSERT_EQ(want.digests.size(), got.digests.size()) << what;
  for (size_t c = 0; c < want.nonfinite.size(); ++c) {
    ASSERT_EQ(want.digests[2 * c], got.digests[2 * c]) << what << " chunk " << c;
    ASSERT_EQ(want.digests[2 * c + 1], got.digests[2 * c + 1]) << what << " chunk " << c;
    ASSERT_EQ(want.nonfinite[c], got.nonfinite[c]) << what << " chunk " << c;
    ASSERT_EQ(want.max_bits[c], got.max_bits[c]) << what << " chunk " << c;
  }
}

const Elem kAllElems[] = {Elem::kRaw,  Elem::kF64,      Elem::kF32,    Elem::kF16,
                          Elem::kBF16, Elem::kF8E4M3FN, Elem::kF8E5M2};

std::vector<size_t> element_counts() {
  std::vector<size_t> counts = {0, 1, 2, 3, 5, 7, 8, 15, 16, 17, 31, 33, 63, 100, 127, 1000, 4097};
  if (!testing::small_sizes()) {
    for (size_t c : {65535u, 65537u, 300007u, (1u << 22) + 3u}) counts.push_back(c);
  }
  return counts;
}

TEST(ScanCuda, MatchesCpuForEveryDtypeSizeAndChunk) {
  PIMHBM_SKIP_WITHOUT_GPU();
  PIMHBM_SEED_TRACE();
  auto rng = rng_for_test();
  // No NaN/Inf at all (the streaming pass alone), a few (most chunks clean, some take the
  // exact second pass), many (every chunk takes it).
  for (Elem elem : kAllElems) {
    for (size_t count : element_counts()) {
     for (double bad : {0.0, 1e-4, 0.05}) {
      const Elem gen = elem == Elem::kRaw ? Elem::kF8E4M3FN : elem;  // raw: any bytes
      const auto s = make_sample(rng, gen, count, bad);
      const int64_t nbytes = static_cast<int64_t>(s.bytes.size());
      DeviceBuffer<uint8_t> x(s.bytes.size());
      PIMHBM_ASSERT_CUDA(x.upload(s.bytes));
      for (int64_t chunk : {int64_t{16}, int64_t{48}, int64_t{4096}, int64_t{65536},
                            16 * (1 + static_cast<int64_t>(rng() % 4096))}) {
        if (num_chunks(nbytes, chunk) > (1 << 16)) continue;  // keep the CPU side quick
        Results got;
        gpu_scan(x.get(), nbytes, elem, chunk, {}, &got);
        expect_same(cpu_scan(s.bytes.data(), nbytes, elem, chunk), got,
                    "elem " + std::to_string(static_cast<int>(elem)) + " bytes " +
                        std::to_string(nbytes) + " chunk " + std::to_string(chunk) +
                        " bad fraction " + std::to_string(bad));
      }
     }
    }
  }
}

TEST(ScanCuda, ResultsDoNotDependOnLaunchShape) {
  PIMHBM_SKIP_WITHOUT_GPU();
  PIMHBM_SEED_TRACE();
  auto rng = rng_for_test();
  const size_t count = testing::small_sizes() ? 50001 : 3000017;
  const auto s = make_sample(rng, Elem::kBF16, count, 1e-5);  // some chunks clean, some not
  const int64_t nbytes = static_cast<int64_t>(s.bytes.size()), chunk = 65536;
  DeviceBuffer<uint8_t> x(s.bytes.size());
  PIMHBM_ASSERT_CUDA(x.upload(s.bytes));
  const Results want = cpu_scan(s.bytes.data(), nbytes, Elem::kBF16, chunk);
  for (int threads : {32, 64, 96, 160, 256}) {
    for (int blocks : {1, 3, 0}) {
      Results got;
      gpu_scan(x.get(), nbytes, Elem::kBF16, chunk, {threads, blocks}, &got);
      expect_same(want, got, "threads " + std::to_string(threads) + " blocks " +
                                 std::to_string(blocks));
    }
  }
}

TEST(ScanCuda, MisalignedViewsMatchCpu) {
  PIMHBM_SKIP_WITHOUT_GPU();
  PIMHBM_SEED_TRACE();
  auto rng = rng_for_test();
  for (size_t len : {1u, 15u, 16u, 17u, 1000u, 70001u}) {
    auto bytes = testing::random_bytes(rng, len + 16);
    DeviceBuffer<uint8_t> x(bytes.size());
    PIMHBM_ASSERT_CUDA(x.upload(bytes));
    for (int offset = 0; offset < 16; ++offset) {
      for (int64_t chunk : {16, 1024}) {
        Results got;
        gpu_scan(x.get() + offset, static_cast<int64_t>(len), Elem::kRaw, chunk, {}, &got);
        expect_same(cpu_scan(bytes.data() + offset, static_cast<int64_t>(len), Elem::kRaw, chunk),
                    got, "offset " + std::to_string(offset) + " len " + std::to_string(len));
      }
    }
  }
}

TEST(VerifyCuda, FlagsExactlyWhatTheCpuFlags) {
  PIMHBM_SKIP_WITHOUT_GPU();
  PIMHBM_SEED_TRACE();
  auto rng = rng_for_test();
  for (size_t len : {0u, 7u, 4096u, 100003u, testing::small_sizes() ? 200000u : (1u << 24) + 9u}) {
    auto bytes = testing::random_bytes(rng, len);
    const int64_t chunk = 16 * (1 + static_cast<int64_t>(rng() % 1024));
    const int64_t n = num_chunks(static_cast<int64_t>(len), chunk);
    const Results clean = cpu_scan(bytes.data(), static_cast<int64_t>(len), Elem::kRaw, chunk);
    for (int k = 0; k < 20 && len > 0; ++k) bytes[rng() % len] ^= static_cast<uint8_t>(1u << (rng() % 8));
    std::vector<uint8_t> want(n);
    scan::verify_cpu(bytes.data(), static_cast<int64_t>(len), chunk, clean.digests.data(),
                     want.data());
    DeviceBuffer<uint8_t> x(len), mismatch(n);
    DeviceBuffer<uint32_t> table(2 * n);
    PIMHBM_ASSERT_CUDA(x.upload(bytes));
    PIMHBM_ASSERT_CUDA(table.upload(clean.digests));
    PIMHBM_ASSERT_CUDA(mismatch.poison());
    PIMHBM_ASSERT_CUDA(scan::verify_cuda(x.get(), static_cast<int64_t>(len), chunk, table.get(),
                                         mismatch.get(), nullptr));
    PIMHBM_ASSERT_CUDA(cudaDeviceSynchronize());
    cudaError_t err;
    const auto got = mismatch.download(&err);
    PIMHBM_ASSERT_CUDA(err);
    EXPECT_EQ(got, want) << "len " << len << " chunk " << chunk;
    int flagged = 0;
    for (uint8_t m : got) flagged += m;
    if (len > 0) EXPECT_GT(flagged, 0);
  }
}

// The kernel reads chunk_base from device memory: a shard scanned with its first chunk's index
// has the whole tensor's digests (the CPU reference's), and verifies against them.
TEST(ScanCuda, AShardWithItsChunkBaseHasTheWholeTensorsDigests) {
  PIMHBM_SKIP_WITHOUT_GPU();
  PIMHBM_SEED_TRACE();
  auto rng = rng_for_test();
  const int64_t chunk = 4096, chunks = 41;
  auto bytes = testing::random_bytes(rng, chunk * chunks - 100);
  const int64_t nbytes = static_cast<int64_t>(bytes.size());
  const Results whole = cpu_scan(bytes.data(), nbytes, Elem::kRaw, chunk);
  DeviceBuffer<uint8_t> x(bytes.size());
  PIMHBM_ASSERT_CUDA(x.upload(bytes));
  for (int32_t first : {0, 3, 40}) {
    const int64_t len = nbytes - first * chunk, n = chunks - first;
    DeviceBuffer<int32_t> base(1);
    PIMHBM_ASSERT_CUDA(base.upload({first}));
    DeviceBuffer<uint32_t> digests(2 * n), max_bits(n), expected(2 * n);
    DeviceBuffer<int32_t> nonfinite(n);
    DeviceBuffer<uint8_t> mismatch(n);
    PIMHBM_ASSERT_CUDA(digests.poison());
    PIMHBM_ASSERT_CUDA(mismatch.poison());
    PIMHBM_ASSERT_CUDA(scan::scan_cuda(x.get() + first * chunk, len, Elem::kRaw, chunk,
                                       digests.get(), nonfinite.get(),
                                       reinterpret_cast<float*>(max_bits.get()), nullptr,
                                       base.get()));
    PIMHBM_ASSERT_CUDA(expected.upload(std::vector<uint32_t>(whole.digests.begin() + 2 * first,
                                                             whole.digests.end())));
    PIMHBM_ASSERT_CUDA(scan::verify_cuda(x.get() + first * chunk, len, chunk, expected.get(),
                                         mismatch.get(), nullptr, base.get()));
    PIMHBM_ASSERT_CUDA(cudaDeviceSynchronize());
    cudaError_t e1, e2;
    const auto got = digests.download(&e1);
    const auto flags = mismatch.download(&e2);
    PIMHBM_ASSERT_CUDA(e1);
    PIMHBM_ASSERT_CUDA(e2);
    EXPECT_TRUE(std::equal(got.begin(), got.end(), whole.digests.begin() + 2 * first)) << first;
    EXPECT_EQ(std::count(flags.begin(), flags.end(), 0), n) << first;
  }
}

TEST(ScanCuda, RejectsBadLaunchShapes) {
  PIMHBM_SKIP_WITHOUT_GPU();
  DeviceBuffer<uint8_t> x(64);
  DeviceBuffer<uint32_t> d(2 * 4);
  DeviceBuffer<int32_t> n(4);
  DeviceBuffer<float> m(4);
  EXPECT_EQ(scan::scan_cuda_shaped(x.get(), 64, Elem::kRaw, 16, d.get(), n.get(), m.get(), nullptr,
                                   {33, 0}),
            cudaErrorInvalidConfiguration);
  EXPECT_EQ(scan::scan_cuda_shaped(x.get(), 64, Elem::kRaw, 16, d.get(), n.get(), m.get(), nullptr,
                                   {512, 0}),
            cudaErrorInvalidConfiguration);
}

}  // namespace
}  // namespace pimhbm
