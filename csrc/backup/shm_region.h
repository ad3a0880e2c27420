// Host backups in POSIX shared memory: a named region that outlives the training process, so
// that a process killed mid-run can be restarted from its last snapshot without a disk read.
// The region is owned here (C++); Python and JAX see it through zero-copy views.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

namespace pimhbm::backup {

class ShmRegion {
 public:
  // Creates (or truncates to `nbytes`) the region /name; `name` must be a plain file name.
  static std::shared_ptr<ShmRegion> create(const std::string& name, int64_t nbytes);
  // Maps an existing region; throws std::runtime_error if there is none.
  static std::shared_ptr<ShmRegion> open(const std::string& name);
  // Removes the name (the memory goes once every mapping is gone). False if it did not exist.
  static bool unlink(const std::string& name);

  ~ShmRegion();
  ShmRegion(const ShmRegion&) = delete;
  ShmRegion& operator=(const ShmRegion&) = delete;

  uint8_t* data() const { return data_; }
  int64_t nbytes() const { return nbytes_; }
  const std::string& name() const { return name_; }

  // Page-locks the mapping for fast device-to-host copies (cudaHostRegister) when built with
  // CUDA and a device is present. Returns whether it did. Thread-safe (a resuming process pins
  // in the background while it restores from the region).
  bool pin();
  bool pinned() const { return pinned_.load(); }

 private:
  ShmRegion(std::string name, uint8_t* data, int64_t nbytes)
      : name_(std::move(name)), data_(data), nbytes_(nbytes) {}
  std::string name_;
  uint8_t* data_;
  int64_t nbytes_;
  std::mutex pin_mutex_;
  std::atomic<bool> pinned_{false};
};

}  // namespace pimhbm::backup
