// A stand-in for NVML, for tests on machines without an NVIDIA driver: the few functions
// pimhbm's telemetry calls, answering from values a test scripts through the standin_*
// functions (loaded with dlopen/ctypes from the same path, so both sides share this state).
// Built by the C++ suite (CMake) and by the Python tests (a g++ call), from this one file.
#include <condition_variable>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <string>

namespace {

struct Dev {
  std::map<std::string, unsigned long long> v;  // pimhbm's field names
  unsigned long long supported_events = 0x1 | 0x2 | 0x8;
};

struct Event {
  int device;
  unsigned long long type, data;
};

struct EventData {  // nvmlEventData_t
  void* device;
  unsigned long long event_type, event_data;
  unsigned gpu_instance_id, compute_instance_id;
};

struct FieldValue {  // nvmlFieldValue_t
  unsigned field_id, scope_id;
  long long timestamp, latency_usec;
  int value_type;
  int nvml_return;
  unsigned long long value;
};

std::mutex mu;
std::condition_variable cv;
Dev devs[16];
int ndev = 0;
int inits = 0;
std::deque<Event> events;
std::map<std::string, int> failing;  // function name -> return code
int registered = 0;
int readings = 0;  // readings of every device finished (see nvmlDeviceGetFieldValues)

int fails(const char* fn) {
  auto it = failing.find(fn);
  return it == failing.end() ? 0 : it->second;
}

int index_of(void* d) {
  for (int i = 0; i < ndev; ++i) {
    if (d == &devs[i]) return i;
  }
  return -1;
}

unsigned long long get(int i, const std::string& name) {
  auto it = devs[i].v.find(name);
  return it == devs[i].v.end() ? 0 : it->second;
}

const char* kCounter[2] = {"volatile", "aggregate"};
const char* kType[2] = {"corrected", "uncorrected"};

}  // namespace

extern "C" {

// ---- the script ----------------------------------------------------------------------------
void standin_reset(int devices) {
  std::lock_guard<std::mutex> lock(mu);
  ndev = devices < 0 ? 0 : devices > 16 ? 16 : devices;
  for (auto& d : devs) d = Dev{};
  events.clear();
  failing.clear();
  registered = 0;
  readings = 0;
}
void standin_set(int device, const char* field, unsigned long long value) {
  std::lock_guard<std::mutex> lock(mu);
  devs[device].v[field] = value;
}
void standin_fail(const char* function, int rc) {
  std::lock_guard<std::mutex> lock(mu);
  failing[function] = rc;
}
void standin_supported_events(int device, unsigned long long mask) {
  std::lock_guard<std::mutex> lock(mu);
  devs[device].supported_events = mask;
}
void standin_event(int device, unsigned long long type, unsigned long long data) {
  {
    std::lock_guard<std::mutex> lock(mu);
    events.push_back({device, type, data});
  }
  cv.notify_all();
}
int standin_inits() {
  std::lock_guard<std::mutex> lock(mu);
  return inits;
}
int standin_registered() {
  std::lock_guard<std::mutex> lock(mu);
  return registered;
}
int standin_readings() {
  std::lock_guard<std::mutex> lock(mu);
  return readings;
}

// ---- NVML ----------------------------------------------------------------------------------
int nvmlInit_v2() {
  std::lock_guard<std::mutex> lock(mu);
  if (int rc = fails("nvmlInit_v2")) return rc;
  ++inits;
  return 0;
}
int nvmlShutdown() {
  std::lock_guard<std::mutex> lock(mu);
  --inits;
  return 0;
}
const char* nvmlErrorString(int rc) {
  switch (rc) {
    case 3: return "Not Supported";
    case 10: return "Timeout";
    case 15: return "GPU is lost";
    case 9: return "Driver Not Loaded";
    default: return "Unknown Error";
  }
}
int nvmlDeviceGetCount_v2(unsigned* count) {
  std::lock_guard<std::mutex> lock(mu);
  if (int rc = fails("nvmlDeviceGetCount_v2")) return rc;
  *count = static_cast<unsigned>(ndev);
  return 0;
}
int nvmlDeviceGetHandleByIndex_v2(unsigned i, void** device) {
  std::lock_guard<std::mutex> lock(mu);
  if (static_cast<int>(i) >= ndev) return 2;
  *device = &devs[i];
  return 0;
}
int nvmlDeviceGetName(void* d, char* buf, unsigned len) {
  std::snprintf(buf, len, "Stand-in GPU %d", index_of(d));
  return 0;
}
int nvmlDeviceGetUUID(void* d, char* buf, unsigned len) {
  std::snprintf(buf, len, "GPU-00000000-0000-0000-0000-%012d", index_of(d));
  return 0;
}
int nvmlDeviceGetEccMode(void* d, int* current, int* pending) {
  std::lock_guard<std::mutex> lock(mu);
  if (int rc = fails("nvmlDeviceGetEccMode")) return rc;
  const int i = index_of(d);
  *current = static_cast<int>(get(i, "ecc_mode_current"));
  *pending = static_cast<int>(get(i, "ecc_mode_pending"));
  return 0;
}
int nvmlDeviceGetTotalEccErrors(void* d, int type, int counter, unsigned long long* v) {
  std::lock_guard<std::mutex> lock(mu);
  if (int rc = fails("nvmlDeviceGetTotalEccErrors")) return rc;
  *v = get(index_of(d), std::string("ecc_") + kCounter[counter] + "_" + kType[type]);
  return 0;
}
int nvmlDeviceGetMemoryErrorCounter(void* d, int type, int counter, int location,
                                    unsigned long long* v) {
  std::lock_guard<std::mutex> lock(mu);
  if (int rc = fails("nvmlDeviceGetMemoryErrorCounter")) return rc;
  const char* where = location == 2 ? "dram_" : location == 7 ? "sram_" : nullptr;
  if (where == nullptr) return 3;
  *v = get(index_of(d), std::string(where) + kCounter[counter] + "_" + kType[type]);
  return 0;
}
int nvmlDeviceGetRemappedRows(void* d, unsigned* corr, unsigned* unc, unsigned* pending,
                              unsigned* failure) {
  std::lock_guard<std::mutex> lock(mu);
  if (int rc = fails("nvmlDeviceGetRemappedRows")) return rc;
  const int i = index_of(d);
  *corr = static_cast<unsigned>(get(i, "remapped_rows_correctable"));
  *unc = static_cast<unsigned>(get(i, "remapped_rows_uncorrectable"));
  *pending = static_cast<unsigned>(get(i, "remap_pending"));
  *failure = static_cast<unsigned>(get(i, "remap_failure"));
  return 0;
}
int nvmlDeviceGetRetiredPages(void* d, int cause, unsigned* count, unsigned long long* addresses) {
  std::lock_guard<std::mutex> lock(mu);
  if (int rc = fails("nvmlDeviceGetRetiredPages")) return rc;
  const unsigned n = static_cast<unsigned>(
      get(index_of(d), cause == 0 ? "retired_pages_single_bit" : "retired_pages_double_bit"));
  if (*count < n) {  // as NVML: too small a buffer gets the count and INSUFFICIENT_SIZE
    *count = n;
    return n == 0 ? 0 : 7;
  }
  for (unsigned k = 0; k < n; ++k) addresses[k] = 0x1000ull * (k + 1);
  *count = n;
  return 0;
}
int nvmlDeviceGetRetiredPagesPendingStatus(void* d, int* pending) {
  std::lock_guard<std::mutex> lock(mu);
  if (int rc = fails("nvmlDeviceGetRetiredPagesPendingStatus")) return rc;
  *pending = static_cast<int>(get(index_of(d), "retired_pages_pending"));
  return 0;
}
int nvmlDeviceGetFieldValues(void* d, int n, FieldValue* values) {
  std::lock_guard<std::mutex> lock(mu);
  if (int rc = fails("nvmlDeviceGetFieldValues")) return rc;
  // pimhbm reads the recovery action last, device by device: the last device's ends a reading.
  if (index_of(d) == ndev - 1) ++readings;
  for (int k = 0; k < n; ++k) {
    values[k].value_type = 1;
    values[k].nvml_return = values[k].field_id == 230 ? 0 : 3;
    values[k].value = values[k].field_id == 230 ? get(index_of(d), "recovery_action") : 0;
  }
  return 0;
}
int nvmlEventSetCreate(void** set) {
  std::lock_guard<std::mutex> lock(mu);
  if (int rc = fails("nvmlEventSetCreate")) return rc;
  *set = &events;
  return 0;
}
int nvmlDeviceGetSupportedEventTypes(void* d, unsigned long long* types) {
  std::lock_guard<std::mutex> lock(mu);
  *types = devs[index_of(d)].supported_events;
  return 0;
}
int nvmlDeviceRegisterEvents(void* d, unsigned long long types, void* set) {
  std::lock_guard<std::mutex> lock(mu);
  if (int rc = fails("nvmlDeviceRegisterEvents")) return rc;
  if (set != &events || index_of(d) < 0 || types == 0) return 2;
  ++registered;
  return 0;
}
int nvmlEventSetWait_v2(void* set, EventData* data, unsigned timeout_ms) {
  std::unique_lock<std::mutex> lock(mu);
  if (set != &events) return 2;
  if (int rc = fails("nvmlEventSetWait_v2")) return rc;
  if (!cv.wait_for(lock, std::chrono::milliseconds(timeout_ms), [] { return !events.empty(); })) {
    return 10;  // NVML_ERROR_TIMEOUT
  }
  const Event e = events.front();
  events.pop_front();
  std::memset(data, 0, sizeof(*data));
  data->device = &devs[e.device];
  data->event_type = e.type;
  data->event_data = e.data;
  return 0;
}
int nvmlEventSetFree(void*) { return 0; }

}  // extern "C"
