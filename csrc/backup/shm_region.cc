#include "backup/shm_region.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <stdexcept>

#if defined(PIMHBM_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace pimhbm::backup {
namespace {

std::string shm_path(const std::string& name) {
  if (name.empty() || name.find('/') != std::string::npos || name.size() > 200) {
    throw std::invalid_argument("shared-memory region name must be a plain file name, got '" +
                                name + "'");
  }
  return "/" + name;
}

[[noreturn]] void fail(const std::string& what, const std::string& name) {
  throw std::runtime_error(what + " /" + name + ": " + std::strerror(errno));
}

}  // namespace

std::shared_ptr<ShmRegion> ShmRegion::create(const std::string& name, int64_t nbytes) {
  if (nbytes <= 0) throw std::invalid_argument("region size must be positive");
  const int fd = shm_open(shm_path(name).c_str(), O_CREAT | O_RDWR, 0600);
  if (fd < 0) fail("cannot create shared memory", name);
  if (ftruncate(fd, nbytes) != 0) {
    close(fd);
    fail("cannot size shared memory", name);
  }
  void* p = mmap(nullptr, static_cast<size_t>(nbytes), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) fail("cannot map shared memory", name);
  return std::shared_ptr<ShmRegion>(new ShmRegion(name, static_cast<uint8_t*>(p), nbytes));
}

std::shared_ptr<ShmRegion> ShmRegion::open(const std::string& name) {
  const int fd = shm_open(shm_path(name).c_str(), O_RDWR, 0600);
  if (fd < 0) fail("no shared memory", name);
  struct stat st;
  if (fstat(fd, &st) != 0 || st.st_size <= 0) {
    close(fd);
    fail("cannot size shared memory", name);
  }
  // No MAP_POPULATE: page-locking (pin_range / pin) faults the pages in, in one pass.
  void* p =
      mmap(nullptr, static_cast<size_t>(st.st_size), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) fail("cannot map shared memory", name);
  return std::shared_ptr<ShmRegion>(new ShmRegion(name, static_cast<uint8_t*>(p), st.st_size));
}

bool ShmRegion::unlink(const std::string& name) { return shm_unlink(shm_path(name).c_str()) == 0; }

namespace {
#if defined(PIMHBM_WITH_CUDA)
bool have_device() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    cudaGetLastError();
    return false;
  }
  return true;
}
#endif
}  // namespace

bool ShmRegion::pin_range(int64_t offset, int64_t nbytes) {
#if defined(PIMHBM_WITH_CUDA)
  std::lock_guard<std::mutex> lock(pin_mutex_);
  if (pinned_) return true;
  // Whole pages: registrations must not overlap.
  const int64_t page = sysconf(_SC_PAGESIZE);
  int64_t begin = std::max<int64_t>(0, offset) / page * page;
  int64_t end = std::min<int64_t>(nbytes_, (offset + nbytes + page - 1) / page * page);
  for (const auto& [b, e] : locked_) {
    if (b <= begin && end <= e) return true;
    if (b < end && begin < e) return false;  // overlaps a locked range only in part
  }
  if (begin >= end || !have_device()) return false;
  if (cudaHostRegister(data_ + begin, static_cast<size_t>(end - begin), cudaHostRegisterPortable) !=
      cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  locked_.emplace_back(begin, end);
  std::sort(locked_.begin(), locked_.end());
  return true;
#else
  (void)offset;
  (void)nbytes;
  return false;
#endif
}

bool ShmRegion::pin() {
#if defined(PIMHBM_WITH_CUDA)
  std::lock_guard<std::mutex> lock(pin_mutex_);
  if (pinned_) return true;
  if (!have_device()) return false;
  // Every gap between the ranges locked so far.
  int64_t at = 0;
  std::vector<std::pair<int64_t, int64_t>> gaps;
  for (const auto& [b, e] : locked_) {
    if (at < b) gaps.emplace_back(at, b);
    at = e;
  }
  if (at < nbytes_) gaps.emplace_back(at, nbytes_);
  for (const auto& [b, e] : gaps) {
    if (cudaHostRegister(data_ + b, static_cast<size_t>(e - b), cudaHostRegisterPortable) !=
        cudaSuccess) {
      cudaGetLastError();
      return false;
    }
    locked_.emplace_back(b, e);
  }
  std::sort(locked_.begin(), locked_.end());
  pinned_ = true;
  return true;
#else
  return false;
#endif
}

ShmRegion::~ShmRegion() {
#if defined(PIMHBM_WITH_CUDA)
  for (const auto& range : locked_) cudaHostUnregister(data_ + range.first);
#endif
  munmap(data_, static_cast<size_t>(nbytes_));
}

}  // namespace pimhbm::backup
