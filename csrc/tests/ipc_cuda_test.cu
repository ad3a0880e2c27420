// The CUDA IPC pull between two processes: this test exports a tensor (inside a larger
// allocation, so the offset matters) and its digest table -- from cudaMalloc'd memory and from
// a cuMemCreate allocation shared as a file descriptor (handed over a Unix socket to the
// process the export names) -- then starts a second copy of this
// binary that maps them, pulls damaged chunks into its own tensor and checks them bit for bit.
#include <cuda.h>
#include <gtest/gtest.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "cuda_test_util.h"
#include "peer/ipc.h"
#include "pimhbm/cuda_driver.h"
#include "repair/repair.h"
#include "scan/scan.h"
#include "test_util.h"

extern char** environ;

namespace pimhbm {
namespace {

constexpr int64_t kLen = 100003, kChunk = 4096;  // a ragged last chunk

std::vector<uint8_t> data_of(uint64_t seed) {
  std::mt19937_64 rng(seed);
  return testing::random_bytes(rng, kLen);
}

std::vector<uint32_t> table_of(const std::vector<uint8_t>& x) {
  return testing::digest_table(x.data(), kLen, kChunk);
}

std::string hex(const std::string& s) {
  static const char* d = "0123456789abcdef";
  std::string out;
  for (unsigned char c : s) out += {d[c >> 4], d[c & 15]};
  return out;
}

std::string unhex(const std::string& h) {
  std::string out;
  for (size_t i = 0; i + 1 < h.size(); i += 2) {
    out += static_cast<char>(std::stoi(h.substr(i, 2), nullptr, 16));
  }
  return out;
}

// The exporting side. The source's chunk kBadSource is damaged after its digest was taken.
constexpr int kBadSource = 7;

// Driver functions through the runtime (the binary does not link libcuda: on machines
// without a driver it must still start, to list and skip its tests).
#define PIMHBM_DRIVER(name) cuda_driver_fn<decltype(&name)>(#name)

// Where the exporting side keeps its data: `bytes` of device memory from cudaMalloc (a CUDA IPC
// handle) or from cuMemCreate with a shareable file descriptor, as XLA's allocator makes it.
class Region {
 public:
  Region(size_t bytes, bool vmm) : vmm_(vmm) {
    if (!vmm) {
      ok_ = cudaMalloc(&ptr_, bytes) == cudaSuccess;
      return;
    }
    const auto granularity_of = PIMHBM_DRIVER(cuMemGetAllocationGranularity);
    const auto create = PIMHBM_DRIVER(cuMemCreate);
    const auto reserve = PIMHBM_DRIVER(cuMemAddressReserve);
    const auto map = PIMHBM_DRIVER(cuMemMap);
    const auto set_access = PIMHBM_DRIVER(cuMemSetAccess);
    const auto release = PIMHBM_DRIVER(cuMemRelease);
    if (!granularity_of || !create || !reserve || !map || !set_access || !release) return;
    CUmemAllocationProp prop{};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location = {CU_MEM_LOCATION_TYPE_DEVICE, 0};
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    size_t granularity = 0;
    if (granularity_of(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM) != CUDA_SUCCESS) {
      return;
    }
    size_ = (bytes + granularity - 1) / granularity * granularity;
    CUmemGenericAllocationHandle h{};
    CUdeviceptr va = 0;
    CUmemAccessDesc access{{CU_MEM_LOCATION_TYPE_DEVICE, 0}, CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
    if (create(&h, size_, &prop, 0) != CUDA_SUCCESS) return;
    if (reserve(&va, size_, 0, 0, 0) == CUDA_SUCCESS) {
      ptr_ = reinterpret_cast<void*>(va);
      ok_ = map(va, size_, 0, h, 0) == CUDA_SUCCESS &&
            set_access(va, size_, &access, 1) == CUDA_SUCCESS;
      mapped_ = ok_;
    }
    release(h);  // the mapping holds the allocation
  }
  ~Region() {
    if (!vmm_) {
      cudaFree(ptr_);
      return;
    }
    const auto unmap = PIMHBM_DRIVER(cuMemUnmap);
    const auto address_free = PIMHBM_DRIVER(cuMemAddressFree);
    const auto va = reinterpret_cast<CUdeviceptr>(ptr_);
    if (mapped_) unmap(va, size_);
    if (ptr_ != nullptr) address_free(va, size_);
  }
  bool ok() const { return ok_; }
  uint8_t* get() const { return static_cast<uint8_t*>(ptr_); }

 private:
  bool vmm_, ok_ = false, mapped_ = false;
  void* ptr_ = nullptr;
  size_t size_ = 0;
};

class IpcPull : public ::testing::TestWithParam<bool> {};

TEST_P(IpcPull, AnotherProcessPullsChunksFromThisOne) {
  PIMHBM_SKIP_WITHOUT_GPU();
  PIMHBM_SEED_TRACE();
  // Whatever way the test ends, the descriptor this process exported is closed and forgotten.
  struct CloseAll {
    ~CloseAll() { peer::ipc::close_all(); }
  } close_all;
  const uint64_t seed = testing::rng_for_test()();
  auto good = data_of(seed);
  const auto table = table_of(good);
  auto src = good;
  src[kBadSource * kChunk + 5] ^= 0x10;
  // Both inside one larger allocation, as XLA places buffers: the exports carry each one's
  // offset from the allocation's base, and the puller maps that allocation once.
  constexpr int64_t kTableAt = 4096 + (kLen + 255) / 256 * 256;
  Region mem(kTableAt + table.size() * 4 + 4096, GetParam());
  ASSERT_TRUE(mem.ok()) << "allocating the exported region";
  ASSERT_EQ(cudaMemcpy(mem.get() + 4096, src.data(), kLen, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(
      cudaMemcpy(mem.get() + kTableAt, table.data(), table.size() * 4, cudaMemcpyHostToDevice),
      cudaSuccess);
  const std::string e_data =
      peer::ipc::export_pointer(reinterpret_cast<uint64_t>(mem.get() + 4096), 0);
  const std::string e_table =
      peer::ipc::export_pointer(reinterpret_cast<uint64_t>(mem.get() + kTableAt), 0);
  ASSERT_EQ(e_data.size(), peer::ipc::kExportBytes);
  peer::ipc::Export a, b;
  std::memcpy(&a, e_data.data(), sizeof(a));
  std::memcpy(&b, e_table.data(), sizeof(b));
  EXPECT_EQ(a.kind, GetParam() ? peer::ipc::kFileDescriptor : peer::ipc::kLegacyHandle);
  EXPECT_EQ(a.offset, 4096u);
  EXPECT_EQ(b.offset, static_cast<uint64_t>(kTableAt));
  EXPECT_TRUE(a.kind == b.kind && a.pid == b.pid && a.size == b.size &&
              std::memcmp(a.handle, b.handle, sizeof(a.handle)) == 0)
      << "one allocation, one export of it";

  std::ostringstream env;
  env << "PIMHBM_IPC_CHILD=" << hex(e_data) << "," << hex(e_table) << "," << seed;
  std::vector<std::string> envs{env.str()};
  for (char** e = environ; *e; ++e) envs.emplace_back(*e);
  std::vector<char*> envp;
  for (auto& e : envs) envp.push_back(e.data());
  envp.push_back(nullptr);
  std::string exe = "/proc/self/exe", filter = "--gtest_filter=IpcPullChild.*";
  char* argv[] = {exe.data(), filter.data(), nullptr};
  pid_t pid;
  ASSERT_EQ(posix_spawn(&pid, exe.c_str(), nullptr, nullptr, argv, envp.data()), 0);
  int status = 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (waitpid(pid, &status, WNOHANG) == 0) {
    if (std::chrono::steady_clock::now() > deadline) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      FAIL() << "the pulling process did not finish in 120 s";
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
      << "the pulling process failed (its output is above)";
}

INSTANTIATE_TEST_SUITE_P(Memory, IpcPull, ::testing::Values(false, true), [](const auto& info) {
  return info.param ? "CuMemCreate" : "CudaMalloc";
});

// The pulling side: runs only when started by the test above.
TEST(IpcPullChild, PullsDamagedChunksAndChecksThem) {
  const char* arg = std::getenv("PIMHBM_IPC_CHILD");
  if (arg == nullptr) GTEST_SKIP() << "started by IpcPull.AnotherProcessPullsChunksFromThisOne";
  std::string s(arg);
  const auto c1 = s.find(','), c2 = s.find(',', c1 + 1);
  const std::string e_data = unhex(s.substr(0, c1)), e_table = unhex(s.substr(c1 + 1, c2 - c1 - 1));
  const uint64_t seed = std::stoull(s.substr(c2 + 1));
  const auto good = data_of(seed);
  const auto table = table_of(good);
  const int64_t n = num_chunks(kLen, kChunk);
  auto dst = good;
  const std::vector<int32_t> chunks{
      0, 3, kBadSource, static_cast<int32_t>(n - 1), -1, static_cast<int32_t>(n + 2)};
  for (int32_t c : chunks) {
    if (c >= 0 && c < n) dst[c * kChunk] ^= 0x01;  // damage where a pull is asked
  }
  testing::DeviceBuffer<uint8_t> d_dst(kLen);
  testing::DeviceBuffer<uint32_t> d_table(table.size());
  ASSERT_EQ(d_dst.upload(dst), cudaSuccess);
  ASSERT_EQ(d_table.upload(table), cudaSuccess);
  const auto status = peer::ipc::pull(0, chunks, reinterpret_cast<uint64_t>(d_dst.get()),
                                      reinterpret_cast<uint64_t>(d_table.get()), kLen, kChunk,
                                      e_data, e_table, 10000);
  EXPECT_EQ(status,
            (std::vector<int32_t>{repair::kRepaired, repair::kRepaired, repair::kSourceDamaged,
                                  repair::kRepaired, repair::kNotListed, repair::kOutOfRange}));
  cudaError_t err;
  auto got = d_dst.download(&err);
  ASSERT_EQ(err, cudaSuccess);
  for (int64_t c = 0; c < n; ++c) {  // repaired chunks are the source's; the rest untouched
    const int64_t a = c * kChunk, b = std::min(kLen, a + kChunk);
    const auto& want = c == kBadSource ? dst : (c == 0 || c == 3 || c == n - 1 ? good : dst);
    EXPECT_TRUE(std::equal(got.begin() + a, got.begin() + b, want.begin() + a)) << "chunk " << c;
  }
  peer::ipc::close_all();
}

}  // namespace
}  // namespace pimhbm
