// Hardware telemetry: the GPU's own fault signals, read through NVML opened at run time.
//
// Telemetry(library) dlopens NVML ("libnvidia-ml.so.1" unless another path is given, or the
// environment names one in PIMHBM_NVML_LIBRARY) -- no link-time dependency. Without it (no
// driver, a CPU machine) available() is false and reason() says why; every read then reports
// the same reason and start() does nothing.
//
// read(): per device, each field a value or why there is none (not supported by this GPU or
// driver, not in this NVML, an error): ECC mode; corrected/uncorrected error counts, volatile
// and aggregate, in total and for DRAM and SRAM; remapped rows (correctable, uncorrectable,
// pending, failure); retired pages (single-bit, double-bit, pending); the GPU recovery action.
//
// start(): a background thread that waits for NVML events (single- and double-bit ECC, Xid
// critical errors) and, every poll interval, reads the counters again; an event, or a counter
// that went up since the last reading, becomes an Event in a queue. drain() takes the queue:
// a mutex and a swap, never an NVML call, so the training loop can call it every step.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace pimhbm::telemetry {

struct Reading {
  bool ok = false;
  uint64_t value = 0;
  std::string why;  // when !ok
};

struct DeviceHealth {
  int index = 0;
  std::string name, uuid;
  std::vector<std::pair<std::string, Reading>> fields;  // in a fixed order (field_names())
};

struct Event {
  int device = -1;     // NVML index
  std::string kind;    // "single_bit_ecc", "double_bit_ecc", "xid", "counter", "error"
  uint64_t xid = 0;    // for "xid"
  std::string detail;  // human-readable
  double seconds = 0;  // since the monitor started
};

// Names of the fields read(), in order. The counters whose increase is an event are those
// for which watched(name) is true.
const std::vector<std::string>& field_names();
bool watched(const std::string& field);

class Telemetry {
 public:
  explicit Telemetry(const std::string& library = "");
  ~Telemetry();
  Telemetry(const Telemetry&) = delete;
  Telemetry& operator=(const Telemetry&) = delete;

  bool available() const { return available_; }
  const std::string& reason() const { return reason_; }
  const std::string& library() const { return library_; }
  int device_count() const { return static_cast<int>(devices_.size()); }

  std::vector<DeviceHealth> read() const;

  // Starts the background thread (idempotent). Events: "" when they are watched, else why not.
  void start(double poll_seconds);
  void stop();
  bool running() const { return running_.load(); }
  std::string events_status() const;
  std::vector<Event> drain();

 private:
  struct Api;
  DeviceHealth read_device(int i) const;
  // The background thread: events registered (watch_events: an nvml::EventSet, or null with
  // *status saying why), waited for (wait_for_event: frees the set after an error), and the
  // counters read every poll_seconds (push_counter_events: what went up since the last).
  void loop(double poll_seconds);
  void* watch_events(std::string* status) const;
  void wait_for_event(void*& event_set, unsigned wait_ms);
  void push_counter_events(const std::vector<DeviceHealth>& last,
                           const std::vector<DeviceHealth>& cur);
  void push(Event e);
  std::string error_string(int rc) const;

  std::string library_, reason_;
  bool available_ = false;
  void* handle_ = nullptr;
  std::unique_ptr<Api> api_;
  std::vector<void*> devices_;  // nvml::Device

  std::thread thread_;
  std::atomic<bool> running_{false};
  mutable std::mutex mutex_;
  std::condition_variable wake_;
  bool stop_requested_ = false;
  std::vector<Event> queue_;
  std::string events_status_ = "not started";
  double t0_ = 0;
};

}  // namespace pimhbm::telemetry
