#include "backup/shm_region.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <map>
#include <stdexcept>

#include "backup/snapshot.h"

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

[[noreturn]] void fail(const std::string& what, const std::string& name, int fd = -1) {
  const int err = errno;
  if (fd >= 0) close(fd);
  throw std::runtime_error(what + " /" + name + ": " + std::strerror(err));
}

// Live regions by id. The ids are never reused, so an op holding a stale id finds nothing.
std::mutex registry_mutex;
std::map<int64_t, std::weak_ptr<ShmRegion>>& registry() {
  static auto* m = new std::map<int64_t, std::weak_ptr<ShmRegion>>();  // used at exit
  return *m;
}
int64_t next_id = 1;

// The lock that makes one process (one handle) at a time the region's user.
void lock_or_fail(int fd, const std::string& name) {
  if (flock(fd, LOCK_EX | LOCK_NB) == 0) return;
  if (errno == EWOULDBLOCK) {
    close(fd);
    throw std::runtime_error("shared memory /" + name +
                             " is in use by another process (or another handle of this one): "
                             "one run at a time; close the other first");
  }
  fail("cannot lock shared memory", name, fd);
}

// Refuses a region this user does not own alone: another user could read the state or write
// what this run would resume from.
void check_owner(int fd, const std::string& name, struct stat* st) {
  if (fstat(fd, st) != 0) fail("cannot stat shared memory", name, fd);
  const unsigned mode = st->st_mode & 0777;
  if (st->st_uid != geteuid() || mode != 0600) {
    close(fd);
    throw std::runtime_error(
        "shared memory /" + name + " is owned by uid " + std::to_string(st->st_uid) +
        " with mode 0" + std::to_string(mode >> 6) + std::to_string((mode >> 3) & 7) +
        std::to_string(mode & 7) + "; a backup must be this user's (uid " +
        std::to_string(geteuid()) + ") with mode 0600: not used (remove it, or choose another "
        "name)");
  }
}

// The mapping, through a descriptor of its own: a mapping keeps its open file description
// alive, and with it any lock taken on that description, so the lock lives on a separate one
// (`lock_fd`), which release() can close. The two must be the same file.
uint8_t* map_or_fail(int lock_fd, int64_t nbytes, const std::string& name) {
  const int fd = shm_open(shm_path(name).c_str(), O_RDWR, 0600);
  if (fd < 0) fail("cannot reopen shared memory", name, lock_fd);
  struct stat a, b;
  if (fstat(fd, &a) != 0 || fstat(lock_fd, &b) != 0 || a.st_ino != b.st_ino ||
      a.st_dev != b.st_dev) {
    close(fd);
    close(lock_fd);
    throw std::runtime_error("shared memory /" + name + " was replaced while it was opened");
  }
  void* p = mmap(nullptr, static_cast<size_t>(nbytes), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) fail("cannot map shared memory", name, lock_fd);
  return static_cast<uint8_t*>(p);
}

}  // namespace

ShmRegion::ShmRegion(std::string name, uint8_t* data, int64_t nbytes, int fd)
    : name_(std::move(name)), data_(data), nbytes_(nbytes), fd_(fd) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  id_ = next_id++;
}

std::shared_ptr<ShmRegion> ShmRegion::create(const std::string& name, int64_t nbytes) {
  if (nbytes <= 0) throw std::invalid_argument("region size must be positive");
  const int fd = shm_open(shm_path(name).c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0 && errno == EEXIST) {
    throw std::runtime_error("shared memory /" + name +
                             " exists already: resume from it, or remove it first "
                             "(pimhbm.backup.HostBackup.unlink)");
  }
  if (fd < 0) fail("cannot create shared memory", name);
  lock_or_fail(fd, name);
  // The mode regardless of the umask; then the size (nothing else has this name open).
  if (fchmod(fd, 0600) != 0) fail("cannot set the mode of shared memory", name, fd);
  if (ftruncate(fd, nbytes) != 0) fail("cannot size shared memory", name, fd);
  uint8_t* p = map_or_fail(fd, nbytes, name);
  std::shared_ptr<ShmRegion> region(new ShmRegion(name, p, nbytes, fd));
  std::lock_guard<std::mutex> lock(registry_mutex);
  registry()[region->id()] = region;
  return region;
}

std::shared_ptr<ShmRegion> ShmRegion::open(const std::string& name) {
  const int fd = shm_open(shm_path(name).c_str(), O_RDWR, 0600);
  if (fd < 0) fail("no shared memory", name);
  struct stat st;
  check_owner(fd, name, &st);
  lock_or_fail(fd, name);
  if (fstat(fd, &st) != 0 || st.st_size <= 0) fail("cannot size shared memory", name, fd);
  // No MAP_POPULATE: a resume reads the snapshot once from the pageable pages; pin() faults
  // the rest in later, in the background.
  uint8_t* p = map_or_fail(fd, st.st_size, name);
  std::shared_ptr<ShmRegion> region(new ShmRegion(name, p, st.st_size, fd));
  std::lock_guard<std::mutex> lock(registry_mutex);
  registry()[region->id()] = region;
  return region;
}

bool ShmRegion::unlink(const std::string& name) { return shm_unlink(shm_path(name).c_str()) == 0; }

std::shared_ptr<ShmRegion> ShmRegion::find(int64_t id) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  auto it = registry().find(id);
  return it == registry().end() ? nullptr : it->second.lock();
}

void ShmRegion::release() {
  const int fd = fd_.exchange(-1);
  if (fd >= 0) close(fd);  // closing the last descriptor gives the lock up
}

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
  {
    std::lock_guard<std::mutex> lock(registry_mutex);
    registry().erase(id_);
  }
  // No copy may still be writing into the mapping when it goes.
  try {
    snapshot_wait();
  } catch (const std::exception&) {
    // a failed copy is reported by the snapshot's own wait; the mapping goes regardless
  }
#if defined(PIMHBM_WITH_CUDA)
  // A destructor cannot report it; the mapping goes either way.
  if (pinned_) (void)cudaHostUnregister(data_);
#endif
  munmap(data_, static_cast<size_t>(nbytes_));
  release();
}

}  // namespace pimhbm::backup
