// Host backups in POSIX shared memory: a named region that outlives the training process, so
// that a process killed mid-run can be restarted from its last snapshot without a disk read.
// The region is owned here (C++); Python and JAX see it through zero-copy views.
//
// Nothing in the region is trusted by this class: it only makes sure that the region is this
// user's alone (created exclusively with mode 0600; on open, the owner and mode are checked)
// and that one process at a time uses it (an exclusive lock held from create or open until
// release). The contents are checked by the reader (python/pimhbm/backup.py).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

namespace pimhbm::backup {

class ShmRegion {
 public:
  // Creates the region /name of `nbytes` bytes; fails if the name exists. `name` must be a
  // plain file name.
  static std::shared_ptr<ShmRegion> create(const std::string& name, int64_t nbytes);
  // Maps the existing region /name; fails with a message that says why when there is none,
  // when another user owns it, when others may read or write it, or when another process (or
  // another handle of this one) holds it.
  static std::shared_ptr<ShmRegion> open(const std::string& name);
  // Removes the name (the memory goes once every mapping is gone). False if it did not exist.
  static bool unlink(const std::string& name);
  // The live region with this id, or null once it is gone: how an op finds its region without
  // trusting an address it was given.
  static std::shared_ptr<ShmRegion> find(int64_t id);

  ~ShmRegion();
  ShmRegion(const ShmRegion&) = delete;
  ShmRegion& operator=(const ShmRegion&) = delete;

  uint8_t* data() const { return data_; }
  int64_t nbytes() const { return nbytes_; }
  const std::string& name() const { return name_; }
  int64_t id() const { return id_; }

  // Gives the lock up (another process may open the region now); the mapping stays until this
  // object goes. Idempotent.
  void release();
  bool held() const { return fd_.load() >= 0; }

  // Page-locks the mapping for fast device-to-host copies (cudaHostRegister) when built with
  // CUDA and a device is present. Returns whether it did. Thread-safe (a resuming process pins
  // in the background while it restores from the region).
  bool pin();
  bool pinned() const { return pinned_.load(); }

 private:
  ShmRegion(std::string name, uint8_t* data, int64_t nbytes, int fd);
  std::string name_;
  uint8_t* data_;
  int64_t nbytes_;
  int64_t id_;
  std::atomic<int> fd_;  // open while the lock is held
  std::mutex pin_mutex_;
  std::atomic<bool> pinned_{false};
};

}  // namespace pimhbm::backup
