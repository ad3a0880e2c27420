#include "backup/shm_region.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

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
  // No MAP_POPULATE: a resume reads the snapshot once from the pageable pages; pin() faults
  // the rest in later, in the background.
  void* p =
      mmap(nullptr, static_cast<size_t>(st.st_size), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) fail("cannot map shared memory", name);
  return std::shared_ptr<ShmRegion>(new ShmRegion(name, static_cast<uint8_t*>(p), st.st_size));
}

bool ShmRegion::unlink(const std::string& name) { return shm_unlink(shm_path(name).c_str()) == 0; }

bool ShmRegion::pin() {
#if defined(PIMHBM_WITH_CUDA)
  std::lock_guard<std::mutex> lock(pin_mutex_);
  if (pinned_) return true;
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    cudaGetLastError();
    return false;
  }
  if (cudaHostRegister(data_, static_cast<size_t>(nbytes_), cudaHostRegisterPortable) !=
      cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  pinned_ = true;
  return true;
#else
  return false;
#endif
}

ShmRegion::~ShmRegion() {
#if defined(PIMHBM_WITH_CUDA)
  // A destructor cannot report it; the mapping goes either way.
  if (pinned_) (void)cudaHostUnregister(data_);
#endif
  munmap(data_, static_cast<size_t>(nbytes_));
}

}  // namespace pimhbm::backup
