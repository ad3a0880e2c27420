// The CUDA repair, the device copy's restore and fault injection against the CPU reference.
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "cuda_test_util.h"
#include "faults/inject.h"
#include "parity/parity.h"
#include "repair/repair.h"
#include "scan/scan.h"
#include "test_util.h"

namespace pimhbm {
namespace {

using testing::DeviceBuffer;
using testing::random_bytes;
using testing::rng_for_test;

template <typename T>
std::vector<T> down(const DeviceBuffer<T>& b) {
  cudaError_t err;
  auto v = b.download(&err);
  EXPECT_EQ(err, cudaSuccess);
  return v;
}

TEST(RepairCuda, MatchesCpu) {
  PIMHBM_SKIP_WITHOUT_GPU();
  PIMHBM_SEED_TRACE();
  auto rng = rng_for_test();
  for (int64_t len : {int64_t{100}, int64_t{4096}, int64_t{100003}}) {
    for (int64_t chunk : {int64_t{16}, int64_t{256}, int64_t{4096}}) {
      auto good = random_bytes(rng, len);
      const auto table = testing::digest_table(good, chunk);
      const int64_t n = num_chunks(len, chunk);
      auto src = good, dst = good;
      std::vector<int32_t> chunks;
      for (int k = 0; k < 20; ++k) {
        const int64_t at = rng() % len;
        dst[at] ^= 1 + rng() % 255;
        if (k % 5 == 0) src[at] ^= 0x40;  // some backups damaged too
        chunks.push_back(static_cast<int32_t>(at / chunk));
      }
      chunks.push_back(-1);
      chunks.push_back(static_cast<int32_t>(n + 3));
      // CPU
      auto cpu_dst = dst;
      auto cpu_table = table;
      std::vector<int32_t> cpu_status(chunks.size());
      repair::repair_cpu(chunks.data(), static_cast<int64_t>(chunks.size()),
                         {src.data(), len, chunk, table.data()},
                         {cpu_dst.data(), len, chunk, cpu_table.data()}, cpu_status.data());
      // GPU
      DeviceBuffer<uint8_t> d_src(len), d_dst(len);
      DeviceBuffer<uint32_t> d_st(table.size()), d_dt(table.size());
      DeviceBuffer<int32_t> d_chunks(chunks.size()), d_status(chunks.size());
      PIMHBM_ASSERT_CUDA(d_src.upload(src));
      PIMHBM_ASSERT_CUDA(d_dst.upload(dst));
      PIMHBM_ASSERT_CUDA(d_st.upload(table));
      PIMHBM_ASSERT_CUDA(d_dt.upload(table));
      PIMHBM_ASSERT_CUDA(d_chunks.upload(chunks));
      PIMHBM_ASSERT_CUDA(d_status.poison(0x5A));  // not a status: an unwritten one shows
      PIMHBM_ASSERT_CUDA(repair::repair_cuda(d_chunks.get(), static_cast<int64_t>(chunks.size()),
                                             {d_src.get(), len, chunk, d_st.get()},
                                             {d_dst.get(), len, chunk, d_dt.get()}, d_status.get(),
                                             nullptr));
      PIMHBM_ASSERT_CUDA(cudaDeviceSynchronize());
      EXPECT_EQ(down(d_status), cpu_status) << len << " " << chunk;
      EXPECT_EQ(down(d_dst), cpu_dst) << len << " " << chunk;
      EXPECT_EQ(down(d_dt), cpu_table) << len << " " << chunk;
    }
  }
}

// Parity rows on the GPU against the CPU: ragged tensors and groups, 16-byte aligned data (a
// thread per column) and views 4 and 8 bytes into a buffer (a word a thread).
TEST(ParityCuda, RowsMatchCpu) {
  PIMHBM_SKIP_WITHOUT_GPU();
  PIMHBM_SEED_TRACE();
  auto rng = rng_for_test();
  for (int64_t len : {int64_t{1}, int64_t{100}, int64_t{4096}, int64_t{100003}}) {
    for (int64_t chunk : {int64_t{16}, int64_t{1024}, int64_t{2048}}) {
      for (int64_t offset : {int64_t{0}, int64_t{4}, int64_t{8}}) {
        const int64_t group = 1 + static_cast<int64_t>(rng() % 9);
        const auto bytes = random_bytes(rng, len + offset);
        const int64_t words = parity::num_groups(len, chunk, group) * chunk / 4;
        std::vector<uint32_t> want(words);
        parity::parity_cpu(bytes.data() + offset, len, chunk, group, want.data());
        DeviceBuffer<uint8_t> d_bytes(bytes.size());
        DeviceBuffer<uint32_t> d_rows(words);
        PIMHBM_ASSERT_CUDA(d_bytes.upload(bytes));
        PIMHBM_ASSERT_CUDA(d_rows.poison(0x5A));
        PIMHBM_ASSERT_CUDA(
            parity::parity_cuda(d_bytes.get() + offset, len, chunk, group, d_rows.get(), nullptr));
        PIMHBM_ASSERT_CUDA(cudaDeviceSynchronize());
        EXPECT_EQ(down(d_rows), want) << len << " " << chunk << " " << group << " " << offset;
      }
    }
  }
}

// Rebuilds from parity on the GPU against the CPU: a burst over neighbouring chunks (each in a
// group of its own), two chunks of one group (a conflict), a chunk whose group holds a second
// damaged chunk that is not listed, the short last chunk, entries not listed and out of range.
TEST(ParityCuda, RebuildMatchesCpu) {
  PIMHBM_SKIP_WITHOUT_GPU();
  PIMHBM_SEED_TRACE();
  auto rng = rng_for_test();
  for (int64_t group : {int64_t{1}, int64_t{3}, int64_t{16}}) {
    for (int64_t len : {int64_t{100003}, int64_t{4096 * 64 + 7}}) {
      const int64_t chunk = 64, n = num_chunks(len, chunk);
      auto bytes = random_bytes(rng, len);
      const auto table = testing::digest_table(bytes, chunk);
      std::vector<uint32_t> rows(parity::num_groups(len, chunk, group) * chunk / 4);
      parity::parity_cpu(bytes.data(), len, chunk, group, rows.data());
      const int64_t burst = static_cast<int64_t>(rng() % (len - 200));
      for (int64_t b = burst; b < burst + 150; ++b) bytes[b] ^= 1 + rng() % 255;
      std::vector<int32_t> list;
      for (int64_t c = burst / chunk; c <= (burst + 149) / chunk; ++c) list.push_back(int32_t(c));
      const int64_t a = static_cast<int64_t>(rng() % n);  // a and another chunk of its group
      const parity::GroupSpan s = parity::group_span(n, group, parity::group_of(n, group, a));
      const int64_t other = s.chunk(0) != a ? s.chunk(0) : s.chunk(s.count - 1);
      bytes[a * chunk] ^= 0x11;
      bytes[other * chunk + 1] ^= 0x22;
      list.push_back(int32_t(a));
      if (other != a && rng() % 2 == 0) list.push_back(int32_t(other));  // else not listed
      bytes[len - 1] ^= 0x80;
      list.insert(list.end(), {int32_t(n - 1), -1, int32_t(n + 3)});
      const int64_t k = static_cast<int64_t>(list.size());
      auto cpu = bytes;
      std::vector<int32_t> cpu_status(k);
      parity::rebuild_cpu({cpu.data(), len, chunk, group, table.data()}, rows.data(), list.data(),
                          k, cpu_status.data());
      DeviceBuffer<uint8_t> d_bytes(len);
      DeviceBuffer<uint32_t> d_table(table.size()), d_rows(rows.size());
      DeviceBuffer<int32_t> d_list(k), d_status(k);
      PIMHBM_ASSERT_CUDA(d_bytes.upload(bytes));
      PIMHBM_ASSERT_CUDA(d_table.upload(table));
      PIMHBM_ASSERT_CUDA(d_rows.upload(rows));
      PIMHBM_ASSERT_CUDA(d_list.upload(list));
      PIMHBM_ASSERT_CUDA(d_status.poison(0x5A));
      PIMHBM_ASSERT_CUDA(parity::rebuild_cuda({d_bytes.get(), len, chunk, group, d_table.get()},
                                              d_rows.get(), d_list.get(), k, d_status.get(),
                                              nullptr));
      PIMHBM_ASSERT_CUDA(cudaDeviceSynchronize());
      EXPECT_EQ(down(d_status), cpu_status) << len << " " << group;
      EXPECT_EQ(down(d_bytes), cpu) << len << " " << group;
    }
  }
}

// Packed rows (chunks received from a replica, entry k at row k, a ragged last chunk, some rows
// damaged in transit): the kernel against the CPU reference.
TEST(RepairCuda, PackedMatchesCpu) {
  PIMHBM_SKIP_WITHOUT_GPU();
  PIMHBM_SEED_TRACE();
  auto rng = rng_for_test();
  for (int64_t len : {int64_t{100}, int64_t{4099}, int64_t{100003}}) {
    for (int64_t chunk : {int64_t{16}, int64_t{256}}) {
      auto good = random_bytes(rng, len);
      const auto table = testing::digest_table(good, chunk);
      const int64_t n = num_chunks(len, chunk);
      auto dst = good;
      std::vector<int32_t> chunks;
      for (int k = 0; k < 16; ++k) {
        const int64_t at = rng() % len;
        dst[at] ^= 1 + rng() % 255;
        chunks.push_back(static_cast<int32_t>(at / chunk));
      }
      chunks.push_back(static_cast<int32_t>(n - 1));
      chunks.push_back(-1);
      chunks.push_back(static_cast<int32_t>(n + 1));
      const size_t k = chunks.size();
      std::vector<uint8_t> rows = random_bytes(rng, static_cast<int64_t>(k) * chunk);
      std::vector<uint32_t> rtab(2 * k, 0);
      for (size_t e = 0; e < k; ++e) {
        const int64_t c = chunks[e];
        if (c < 0 || c >= n) continue;
        std::memcpy(rows.data() + e * chunk, good.data() + c * chunk, chunk_length(len, chunk, c));
        rtab[2 * e] = table[2 * c];
        rtab[2 * e + 1] = table[2 * c + 1];
        if (e % 5 == 3) rows[e * chunk] ^= 0x20;  // damaged in transit
      }
      repair::Sources packed{};
      packed.count = 1;
      packed.self = -1;
      packed.packed = true;
      auto cpu_dst = dst;
      auto cpu_table = table;
      std::vector<int32_t> cpu_status(k);
      packed.tensor[0] = {rows.data(), static_cast<int64_t>(rows.size()), chunk, rtab.data()};
      repair::repair_from_cpu(chunks.data(), static_cast<int64_t>(k), packed,
                              {cpu_dst.data(), len, chunk, cpu_table.data()}, cpu_status.data());
      DeviceBuffer<uint8_t> d_rows(rows.size()), d_dst(len);
      DeviceBuffer<uint32_t> d_rt(rtab.size()), d_dt(table.size());
      DeviceBuffer<int32_t> d_chunks(k), d_status(k);
      PIMHBM_ASSERT_CUDA(d_rows.upload(rows));
      PIMHBM_ASSERT_CUDA(d_dst.upload(dst));
      PIMHBM_ASSERT_CUDA(d_rt.upload(rtab));
      PIMHBM_ASSERT_CUDA(d_dt.upload(table));
      PIMHBM_ASSERT_CUDA(d_chunks.upload(chunks));
      PIMHBM_ASSERT_CUDA(d_status.poison(0x5A));
      packed.tensor[0] = {d_rows.get(), static_cast<int64_t>(rows.size()), chunk, d_rt.get()};
      PIMHBM_ASSERT_CUDA(repair::repair_from_cuda(d_chunks.get(), static_cast<int64_t>(k), packed,
                                                  {d_dst.get(), len, chunk, d_dt.get()},
                                                  d_status.get(), nullptr));
      PIMHBM_ASSERT_CUDA(cudaDeviceSynchronize());
      EXPECT_EQ(down(d_status), cpu_status) << len << " " << chunk;
      EXPECT_EQ(down(d_dst), cpu_dst) << len << " " << chunk;
      EXPECT_EQ(down(d_dt), cpu_table) << len << " " << chunk;
    }
  }
}

// Every chunk listed, over ragged lengths: the short last chunk (and its short last unit)
// goes through the block digest on both sides of the copy.
TEST(RepairCuda, RaggedLastChunk) {
  PIMHBM_SKIP_WITHOUT_GPU();
  PIMHBM_SEED_TRACE();
  auto rng = rng_for_test();
  for (int trial = 0; trial < 40; ++trial) {
    const int64_t chunk = 16 * (1 + static_cast<int64_t>(rng() % 256));
    const int64_t len = 1 + static_cast<int64_t>(rng() % (8 * chunk));
    const int64_t n = num_chunks(len, chunk);
    auto good = random_bytes(rng, len);
    const auto table = testing::digest_table(good, chunk);
    auto src = good, dst = good;
    dst[len - 1] ^= 1 + rng() % 255;  // the last byte always damaged
    for (int k = 0; k < 3; ++k) dst[rng() % len] ^= 0x10;
    if (trial % 4 == 0) src[rng() % len] ^= 0x01;  // sometimes the backup too
    std::vector<int32_t> chunks(n);
    for (int64_t c = 0; c < n; ++c) chunks[c] = static_cast<int32_t>(n - 1 - c);
    auto cpu_dst = dst;
    auto cpu_table = table;
    std::vector<int32_t> cpu_status(n);
    repair::repair_cpu(chunks.data(), n, {src.data(), len, chunk, table.data()},
                       {cpu_dst.data(), len, chunk, cpu_table.data()}, cpu_status.data());
    DeviceBuffer<uint8_t> d_src(len), d_dst(len);
    DeviceBuffer<uint32_t> d_st(table.size()), d_dt(table.size());
    DeviceBuffer<int32_t> d_chunks(n), d_status(n);
    PIMHBM_ASSERT_CUDA(d_src.upload(src));
    PIMHBM_ASSERT_CUDA(d_dst.upload(dst));
    PIMHBM_ASSERT_CUDA(d_st.upload(table));
    PIMHBM_ASSERT_CUDA(d_dt.upload(table));
    PIMHBM_ASSERT_CUDA(d_chunks.upload(chunks));
    PIMHBM_ASSERT_CUDA(d_status.poison(0x5A));
    PIMHBM_ASSERT_CUDA(repair::repair_cuda(d_chunks.get(), n, {d_src.get(), len, chunk, d_st.get()},
                                           {d_dst.get(), len, chunk, d_dt.get()}, d_status.get(),
                                           nullptr));
    PIMHBM_ASSERT_CUDA(cudaDeviceSynchronize());
    EXPECT_EQ(down(d_status), cpu_status) << "len " << len << " chunk " << chunk;
    EXPECT_EQ(down(d_dst), cpu_dst) << "len " << len << " chunk " << chunk;
    EXPECT_EQ(down(d_dt), cpu_table) << "len " << len << " chunk " << chunk;
  }
}

TEST(RestoreCleanCuda, MatchesCpu) {
  PIMHBM_SKIP_WITHOUT_GPU();
  PIMHBM_SEED_TRACE();
  auto rng = rng_for_test();
  const int64_t len = 50001, chunk = 512, n = num_chunks(len, chunk);
  auto src = random_bytes(rng, len), dst = random_bytes(rng, len);
  auto st = testing::digest_table(src, chunk), dt = testing::digest_table(dst, chunk);
  std::vector<int32_t> faults(n);
  for (auto& f : faults) f = rng() % 4 == 0 ? 8 : 0;
  for (int32_t commit : {1, 0}) {
    auto cpu = dst;
    auto cpu_t = dt;
    repair::restore_clean_cpu(&commit, faults.data(), {src.data(), len, chunk, st.data()},
                              {cpu.data(), len, chunk, cpu_t.data()});
    DeviceBuffer<uint8_t> d_src(len), d_dst(len);
    DeviceBuffer<uint32_t> d_st(st.size()), d_dt(dt.size());
    DeviceBuffer<int32_t> d_faults(n), d_commit(1);
    PIMHBM_ASSERT_CUDA(d_src.upload(src));
    PIMHBM_ASSERT_CUDA(d_dst.upload(dst));
    PIMHBM_ASSERT_CUDA(d_st.upload(st));
    PIMHBM_ASSERT_CUDA(d_dt.upload(dt));
    PIMHBM_ASSERT_CUDA(d_faults.upload(faults));
    PIMHBM_ASSERT_CUDA(d_commit.upload(std::vector<int32_t>{commit}));
    PIMHBM_ASSERT_CUDA(repair::restore_clean_cuda(d_commit.get(), d_faults.get(),
                                                  {d_src.get(), len, chunk, d_st.get()},
                                                  {d_dst.get(), len, chunk, d_dt.get()}, nullptr));
    PIMHBM_ASSERT_CUDA(cudaDeviceSynchronize());
    EXPECT_EQ(down(d_dst), cpu) << commit;
    EXPECT_EQ(down(d_dt), cpu_t) << commit;
  }
}

TEST(InjectCuda, MatchesCpu) {
  PIMHBM_SKIP_WITHOUT_GPU();
  PIMHBM_SEED_TRACE();
  auto rng = rng_for_test();
  const int64_t len = 70000;
  const auto x = random_bytes(rng, len);
  for (int32_t kind : {0, 1, 2, 3, 4}) {
    for (faults::Format format : {faults::kRawBytes, faults::kFloat32, faults::kBFloat16}) {
      const uint64_t off = kind == 3 ? rng() % 20000 : rng() % (len + 100);
      const std::vector<int32_t> spec = {kind,
                                         static_cast<int32_t>(off),
                                         0,
                                         static_cast<int32_t>(rng() % 3000),
                                         static_cast<int32_t>(rng() % 8),
                                         static_cast<int32_t>(rng() % 1000),
                                         static_cast<int32_t>(rng() % 3),
                                         0};
      auto cpu = x;
      faults::inject_cpu(cpu.data(), len, format, spec.data());
      DeviceBuffer<uint8_t> d(len);
      DeviceBuffer<int32_t> d_spec(8);
      PIMHBM_ASSERT_CUDA(d.upload(x));
      PIMHBM_ASSERT_CUDA(d_spec.upload(spec));
      PIMHBM_ASSERT_CUDA(faults::inject_cuda(d.get(), len, format, d_spec.get(), nullptr));
      PIMHBM_ASSERT_CUDA(cudaDeviceSynchronize());
      EXPECT_EQ(down(d), cpu) << "kind " << kind << " format " << format;
    }
  }
}

}  // namespace
}  // namespace pimhbm
