#include "telemetry/telemetry.h"

#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <functional>
#include <map>

#include "telemetry/nvml_abi.h"

namespace pimhbm::telemetry {

namespace {

double now_seconds() {
  using clock = std::chrono::steady_clock;
  return std::chrono::duration<double>(clock::now().time_since_epoch()).count();
}

std::string event_kind(unsigned long long type) {
  if (type & nvml::kEventDoubleBitEcc) return "double_bit_ecc";
  if (type & nvml::kEventSingleBitEcc) return "single_bit_ecc";
  if (type & nvml::kEventXidCritical) return "xid";
  return "other";
}

}  // namespace

const std::vector<std::string>& field_names() {
  static const std::vector<std::string> names = {
      "ecc_mode_current",
      "ecc_mode_pending",
      "ecc_volatile_corrected",
      "ecc_volatile_uncorrected",
      "ecc_aggregate_corrected",
      "ecc_aggregate_uncorrected",
      "dram_volatile_corrected",
      "dram_volatile_uncorrected",
      "dram_aggregate_corrected",
      "dram_aggregate_uncorrected",
      "sram_volatile_corrected",
      "sram_volatile_uncorrected",
      "sram_aggregate_corrected",
      "sram_aggregate_uncorrected",
      "remapped_rows_correctable",
      "remapped_rows_uncorrectable",
      "remap_pending",
      "remap_failure",
      "retired_pages_single_bit",
      "retired_pages_double_bit",
      "retired_pages_pending",
      "recovery_action",
  };
  return names;
}

bool watched(const std::string& field) {
  // Everything but the ECC mode: a count that goes up, a flag that is raised, a recovery
  // action that appears. (Aggregate counts move with the volatile ones; both are watched so
  // that a driver reporting only one of them is still heard.)
  return field.rfind("ecc_mode", 0) != 0;
}

// NVML's functions, looked up by name; null where this NVML does not have one.
struct Telemetry::Api {
  nvml::InitFn init = nullptr;
  nvml::ShutdownFn shutdown = nullptr;
  nvml::ErrorStringFn error_string = nullptr;
  nvml::GetCountFn get_count = nullptr;
  nvml::GetHandleByIndexFn get_handle = nullptr;
  nvml::GetStringFn get_name = nullptr;
  nvml::GetStringFn get_uuid = nullptr;
  nvml::GetEccModeFn get_ecc_mode = nullptr;
  nvml::GetTotalEccErrorsFn get_total_ecc = nullptr;
  nvml::GetMemoryErrorCounterFn get_memory_errors = nullptr;
  nvml::GetRemappedRowsFn get_remapped_rows = nullptr;
  nvml::GetRetiredPagesFn get_retired_pages = nullptr;
  nvml::GetRetiredPagesPendingFn get_retired_pending = nullptr;
  nvml::GetFieldValuesFn get_field_values = nullptr;
  nvml::EventSetCreateFn event_set_create = nullptr;
  nvml::GetSupportedEventTypesFn get_supported_events = nullptr;
  nvml::RegisterEventsFn register_events = nullptr;
  nvml::EventSetWaitFn event_set_wait = nullptr;
  nvml::EventSetFreeFn event_set_free = nullptr;
};

Telemetry::Telemetry(const std::string& library) : api_(std::make_unique<Api>()) {
  t0_ = now_seconds();
  library_ = library;
  if (library_.empty()) {
    const char* env = std::getenv("PIMHBM_NVML_LIBRARY");
    library_ = env && *env ? env : "libnvidia-ml.so.1";
  }
  handle_ = dlopen(library_.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle_ == nullptr) {
    const char* err = dlerror();
    reason_ = "NVML not loaded (" + std::string(err ? err : library_) +
              "): no NVIDIA driver on this machine, or it is not on the library path";
    return;
  }
  const auto sym = [this](auto& fn, const char* name) {
    fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(handle_, name));
  };
  Api& a = *api_;
  sym(a.init, "nvmlInit_v2");
  sym(a.shutdown, "nvmlShutdown");
  sym(a.error_string, "nvmlErrorString");
  sym(a.get_count, "nvmlDeviceGetCount_v2");
  sym(a.get_handle, "nvmlDeviceGetHandleByIndex_v2");
  sym(a.get_name, "nvmlDeviceGetName");
  sym(a.get_uuid, "nvmlDeviceGetUUID");
  sym(a.get_ecc_mode, "nvmlDeviceGetEccMode");
  sym(a.get_total_ecc, "nvmlDeviceGetTotalEccErrors");
  sym(a.get_memory_errors, "nvmlDeviceGetMemoryErrorCounter");
  sym(a.get_remapped_rows, "nvmlDeviceGetRemappedRows");
  sym(a.get_retired_pages, "nvmlDeviceGetRetiredPages");
  sym(a.get_retired_pending, "nvmlDeviceGetRetiredPagesPendingStatus");
  sym(a.get_field_values, "nvmlDeviceGetFieldValues");
  sym(a.event_set_create, "nvmlEventSetCreate");
  sym(a.get_supported_events, "nvmlDeviceGetSupportedEventTypes");
  sym(a.register_events, "nvmlDeviceRegisterEvents");
  sym(a.event_set_wait, "nvmlEventSetWait_v2");
  sym(a.event_set_free, "nvmlEventSetFree");
  if (!a.init || !a.shutdown || !a.get_count || !a.get_handle) {
    reason_ = library_ +
              " lacks nvmlInit_v2 / nvmlDeviceGetCount_v2 / "
              "nvmlDeviceGetHandleByIndex_v2: not a usable NVML";
    dlclose(handle_);
    handle_ = nullptr;
    return;
  }
  if (int rc = a.init(); rc != nvml::kSuccess) {
    reason_ = "nvmlInit failed: " + error_string(rc);
    dlclose(handle_);
    handle_ = nullptr;
    return;
  }
  unsigned count = 0;
  if (int rc = a.get_count(&count); rc != nvml::kSuccess) {
    reason_ = "nvmlDeviceGetCount failed: " + error_string(rc);
    a.shutdown();
    dlclose(handle_);
    handle_ = nullptr;
    return;
  }
  for (unsigned i = 0; i < count; ++i) {
    nvml::Device d = nullptr;
    if (a.get_handle(i, &d) != nvml::kSuccess) d = nullptr;  // read() reports it
    devices_.push_back(d);
  }
  available_ = true;
}

Telemetry::~Telemetry() {
  stop();
  if (handle_ != nullptr) {
    api_->shutdown();
    dlclose(handle_);
  }
}

std::string Telemetry::error_string(int rc) const {
  std::string s = api_->error_string ? api_->error_string(rc) : "";
  return (s.empty() ? "NVML error" : s) + " (" + std::to_string(rc) + ")";
}

namespace {

// The fields of one device as read so far, by name: a value, or why there is none.
struct Fields {
  std::map<std::string, Reading> got;
  std::function<std::string(int)> error_string;  // NVML's message for a return code

  void set(const std::string& name, int rc, uint64_t v) {
    got[name] = rc == nvml::kSuccess ? Reading{true, v, ""} : Reading{false, 0, error_string(rc)};
  }
  void missing(const std::string& name, const char* fn) {
    got[name] = {false, 0, std::string("not in this NVML (") + fn + ")"};
  }
};

// The readers of the fields, each from the NVML functions it needs (`Api`: Telemetry::Api).
template <typename Api>
void read_ecc_mode(const Api& a, nvml::Device d, Fields& f) {
  if (!a.get_ecc_mode) {
    f.missing("ecc_mode_current", "nvmlDeviceGetEccMode");
    f.missing("ecc_mode_pending", "nvmlDeviceGetEccMode");
    return;
  }
  int cur = 0, pend = 0;
  const int rc = a.get_ecc_mode(d, &cur, &pend);
  f.set("ecc_mode_current", rc, cur == nvml::kEnabled);
  f.set("ecc_mode_pending", rc, pend == nvml::kEnabled);
}

// The ECC error counts (volatile and aggregate, corrected and uncorrected), in total and by
// location (DRAM, SRAM).
template <typename Api>
void read_ecc_counts(const Api& a, nvml::Device d, Fields& f) {
  const char* counter_names[2] = {"volatile", "aggregate"};
  const char* type_names[2] = {"corrected", "uncorrected"};
  for (int counter : {nvml::kVolatile, nvml::kAggregate}) {
    for (int type : {nvml::kCorrected, nvml::kUncorrected}) {
      const std::string suffix = std::string(counter_names[counter]) + "_" + type_names[type];
      unsigned long long v = 0;
      if (a.get_total_ecc) {
        const int rc = a.get_total_ecc(d, type, counter, &v);  // before v is read
        f.set("ecc_" + suffix, rc, v);
      } else {
        f.missing("ecc_" + suffix, "nvmlDeviceGetTotalEccErrors");
      }
      for (auto [where, loc] :
           {std::pair{"dram_", nvml::kLocationDram}, std::pair{"sram_", nvml::kLocationSram}}) {
        v = 0;
        if (a.get_memory_errors) {
          const int rc = a.get_memory_errors(d, type, counter, loc, &v);
          f.set(where + suffix, rc, v);
        } else {
          f.missing(where + suffix, "nvmlDeviceGetMemoryErrorCounter");
        }
      }
    }
  }
}

template <typename Api>
void read_remapped_rows(const Api& a, nvml::Device d, Fields& f) {
  if (!a.get_remapped_rows) {
    for (const char* n : {"remapped_rows_correctable", "remapped_rows_uncorrectable",
                          "remap_pending", "remap_failure"}) {
      f.missing(n, "nvmlDeviceGetRemappedRows");
    }
    return;
  }
  unsigned corr = 0, unc = 0, pending = 0, failure = 0;
  const int rc = a.get_remapped_rows(d, &corr, &unc, &pending, &failure);
  f.set("remapped_rows_correctable", rc, corr);
  f.set("remapped_rows_uncorrectable", rc, unc);
  f.set("remap_pending", rc, pending != 0);
  f.set("remap_failure", rc, failure != 0);
}

template <typename Api>
void read_retired_pages(const Api& a, nvml::Device d, Fields& f) {
  for (auto [name, cause] : {std::pair{"retired_pages_single_bit", nvml::kRetiredMultipleSingleBit},
                             std::pair{"retired_pages_double_bit", nvml::kRetiredDoubleBit}}) {
    if (!a.get_retired_pages) {
      f.missing(name, "nvmlDeviceGetRetiredPages");
      continue;
    }
    unsigned count = 0;  // a count of 0 asks for the number only
    int rc = a.get_retired_pages(d, cause, &count, nullptr);
    if (rc == 7 /* NVML_ERROR_INSUFFICIENT_SIZE: there are pages, count says how many */) {
      rc = nvml::kSuccess;
    }
    f.set(name, rc, count);
  }
  if (a.get_retired_pending) {
    int pending = 0;
    const int rc = a.get_retired_pending(d, &pending);
    f.set("retired_pages_pending", rc, pending == nvml::kEnabled);
  } else {
    f.missing("retired_pages_pending", "nvmlDeviceGetRetiredPagesPendingStatus");
  }
}

template <typename Api>
void read_recovery_action(const Api& a, nvml::Device d, Fields& f) {
  if (!a.get_field_values) {
    f.missing("recovery_action", "nvmlDeviceGetFieldValues");
    return;
  }
  nvml::FieldValue fv{};
  fv.field_id = nvml::kFieldGpuRecoveryAction;
  const int rc = a.get_field_values(d, 1, &fv);
  f.set("recovery_action", rc == nvml::kSuccess ? fv.nvml_return : rc, fv.value.ui);
}

}  // namespace

DeviceHealth Telemetry::read_device(int i) const {
  DeviceHealth h;
  h.index = i;
  const Api& a = *api_;
  Fields f{{}, [this](int rc) { return error_string(rc); }};
  auto* d = static_cast<nvml::Device>(devices_[i]);
  if (d == nullptr) {
    for (const auto& n : field_names()) f.got[n] = {false, 0, "no handle for this device"};
  } else {
    char buf[96] = {0};
    if (a.get_name && a.get_name(d, buf, sizeof(buf)) == nvml::kSuccess) h.name = buf;
    buf[0] = 0;
    if (a.get_uuid && a.get_uuid(d, buf, sizeof(buf)) == nvml::kSuccess) h.uuid = buf;
    read_ecc_mode(a, d, f);
    read_ecc_counts(a, d, f);
    read_remapped_rows(a, d, f);
    read_retired_pages(a, d, f);
    read_recovery_action(a, d, f);
  }
  for (const auto& n : field_names()) h.fields.emplace_back(n, f.got[n]);
  return h;
}

std::vector<DeviceHealth> Telemetry::read() const {
  std::vector<DeviceHealth> out;
  if (!available_) return out;
  for (int i = 0; i < device_count(); ++i) out.push_back(read_device(i));
  return out;
}

void Telemetry::push(Event e) {
  e.seconds = now_seconds() - t0_;
  std::lock_guard<std::mutex> lock(mutex_);
  queue_.push_back(std::move(e));
}

std::vector<Event> Telemetry::drain() {
  std::vector<Event> out;
  std::lock_guard<std::mutex> lock(mutex_);
  out.swap(queue_);
  return out;
}

std::string Telemetry::events_status() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return events_status_;
}

void Telemetry::start(double poll_seconds) {
  if (!available_ || running_.load()) return;
  if (!(poll_seconds > 0)) poll_seconds = 1.0;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_requested_ = false;
  }
  running_ = true;
  thread_ = std::thread([this, poll_seconds] { loop(poll_seconds); });
  // Registering for events takes milliseconds: wait for it (at most 2 s), so that the status
  // a caller reads right after start() says whether events are watched, not "not started".
  std::unique_lock<std::mutex> lock(mutex_);
  wake_.wait_for(lock, std::chrono::seconds(2), [this] { return events_status_ != "not started"; });
}

void Telemetry::stop() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_requested_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
  running_ = false;
}

void* Telemetry::watch_events(std::string* status) const {
  const Api& a = *api_;
  // Registered for what each device supports of SBE, DBE and Xid.
  nvml::EventSet set = nullptr;
  if (!a.event_set_create || !a.register_events || !a.event_set_wait || !a.event_set_free) {
    *status = "this NVML has no event API";
    return nullptr;
  }
  if (int rc = a.event_set_create(&set); rc != nvml::kSuccess) {
    *status = "nvmlEventSetCreate: " + error_string(rc);
    return nullptr;
  }
  int registered = 0;
  std::string why;
  for (void* p : devices_) {
    auto* d = static_cast<nvml::Device>(p);
    if (d == nullptr) continue;
    unsigned long long supported = ~0ull;
    if (a.get_supported_events) {
      if (int rc = a.get_supported_events(d, &supported); rc != nvml::kSuccess) supported = 0;
    }
    const unsigned long long want =
        supported & (nvml::kEventSingleBitEcc | nvml::kEventDoubleBitEcc | nvml::kEventXidCritical);
    if (want == 0) continue;
    if (int rc = a.register_events(d, want, set); rc == nvml::kSuccess) {
      ++registered;
    } else {
      why = error_string(rc);
    }
  }
  if (registered == 0) {
    *status = "no device accepted ECC/Xid events" + (why.empty() ? "" : ": " + why);
    a.event_set_free(set);
    return nullptr;
  }
  return set;
}

void Telemetry::wait_for_event(void*& event_set, unsigned wait_ms) {
  const Api& a = *api_;
  auto set = static_cast<nvml::EventSet>(event_set);
  nvml::EventData data{};
  const int rc = a.event_set_wait(set, &data, wait_ms);
  if (rc == nvml::kSuccess) {
    int idx = -1;
    for (size_t i = 0; i < devices_.size(); ++i) {
      if (devices_[i] == static_cast<void*>(data.device)) idx = static_cast<int>(i);
    }
    Event e;
    e.device = idx;
    e.kind = event_kind(data.event_type);
    e.xid = e.kind == "xid" ? data.event_data : 0;
    e.detail = e.kind == "xid" ? "Xid " + std::to_string(data.event_data)
                               : e.kind + " ECC event reported by the driver";
    push(std::move(e));
  } else if (rc != nvml::kErrorTimeout) {
    Event e;
    e.kind = "error";
    e.detail = "nvmlEventSetWait: " + error_string(rc) + "; events no longer watched";
    if (rc == nvml::kErrorGpuIsLost) e.kind = "gpu_lost";
    push(std::move(e));
    a.event_set_free(set);
    event_set = nullptr;
    std::lock_guard<std::mutex> lock(mutex_);
    events_status_ = "stopped after an error: " + error_string(rc);
  }
}

void Telemetry::push_counter_events(const std::vector<DeviceHealth>& last,
                                    const std::vector<DeviceHealth>& cur) {
  for (size_t i = 0; i < cur.size() && i < last.size(); ++i) {
    for (size_t f = 0; f < cur[i].fields.size(); ++f) {
      const auto& [name, now] = cur[i].fields[f];
      const Reading& before = last[i].fields[f].second;
      if (!watched(name) || !now.ok || !before.ok || now.value <= before.value) continue;
      Event e;
      e.device = static_cast<int>(i);
      e.kind = "counter";
      e.detail = name + " " + std::to_string(before.value) + " -> " + std::to_string(now.value);
      push(std::move(e));
    }
  }
}

void Telemetry::loop(double poll_seconds) {
  std::string status;
  void* set = watch_events(&status);  // nvml::EventSet, or null: no events watched
  {
    std::lock_guard<std::mutex> lock(mutex_);
    events_status_ = status;
  }
  wake_.notify_all();
  // The first reading is the baseline; later readings are compared with the one before.
  std::vector<DeviceHealth> last = read();
  const auto wait_ms = static_cast<unsigned>(std::max(1.0, std::min(poll_seconds, 0.25) * 1e3));
  double next_poll = now_seconds() + poll_seconds;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mutex_);
      if (stop_requested_) break;
      if (set == nullptr) {  // nothing to wait on: sleep until the next poll, or until stop()
        wake_.wait_for(lock,
                       std::chrono::duration<double>(std::max(0.0, next_poll - now_seconds())),
                       [this] { return stop_requested_; });
        if (stop_requested_) break;
      }
    }
    if (set != nullptr) wait_for_event(set, wait_ms);
    if (now_seconds() >= next_poll) {
      next_poll = now_seconds() + poll_seconds;
      std::vector<DeviceHealth> cur = read();
      push_counter_events(last, cur);
      last = std::move(cur);
    }
  }
  if (set != nullptr) api_->event_set_free(static_cast<nvml::EventSet>(set));
}

}  // namespace pimhbm::telemetry
