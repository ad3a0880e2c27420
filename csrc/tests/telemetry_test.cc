// Telemetry against the stand-in NVML (nvml_standin.cc): scripted values come back field by
// field, events and counter increases reach the queue, and a missing or broken NVML is
// reported as unavailable with the reason.
#include <dlfcn.h>
#include <gtest/gtest.h>

#include <chrono>
#include <map>
#include <thread>

#include "telemetry/telemetry.h"
#include "test_util.h"

namespace pimhbm {
namespace {

using telemetry::Event;
using telemetry::Telemetry;
using testing::rng_for_test;

// The stand-in's script, through the same library Telemetry opens (one copy of its state).
struct Standin {
  void* h = dlopen(PIMHBM_NVML_STANDIN, RTLD_NOW | RTLD_LOCAL);
  template <typename F>
  F fn(const char* name) {
    return reinterpret_cast<F>(dlsym(h, name));
  }
  void reset(int n) { fn<void (*)(int)>("standin_reset")(n); }
  void set(int d, const char* f, unsigned long long v) {
    fn<void (*)(int, const char*, unsigned long long)>("standin_set")(d, f, v);
  }
  void fail(const char* f, int rc) { fn<void (*)(const char*, int)>("standin_fail")(f, rc); }
  void event(int d, unsigned long long type, unsigned long long data) {
    fn<void (*)(int, unsigned long long, unsigned long long)>("standin_event")(d, type, data);
  }
  void supported(int d, unsigned long long mask) {
    fn<void (*)(int, unsigned long long)>("standin_supported_events")(d, mask);
  }
  int inits() { return fn<int (*)()>("standin_inits")(); }
  int readings() { return fn<int (*)()>("standin_readings")(); }
  // Waits (up to 5 s) until a reading of every device ends after this call: then the polling
  // thread's first (the counters' baseline, maybe under way now) is over, and a counter changed
  // after it is a change, not part of the baseline.
  bool wait_for_a_reading() {
    const int before = readings();
    for (int i = 0; i < 2500 && readings() == before; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    return readings() > before;
  }
  ~Standin() { dlclose(h); }
};

std::map<std::string, telemetry::Reading> fields_of(const telemetry::DeviceHealth& h) {
  return {h.fields.begin(), h.fields.end()};
}

// Drains until `n` events arrived or 5 s passed.
std::vector<Event> wait_for_events(Telemetry& t, size_t n) {
  std::vector<Event> got;
  const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (got.size() < n && std::chrono::steady_clock::now() < end) {
    for (auto& e : t.drain()) got.push_back(e);
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return got;
}

TEST(Telemetry, MissingLibraryIsReportedUnavailable) {
  Telemetry t("/nonexistent/libnvidia-ml.so.1");
  EXPECT_FALSE(t.available());
  EXPECT_NE(t.reason().find("NVML not loaded"), std::string::npos) << t.reason();
  EXPECT_TRUE(t.read().empty());
  t.start(0.01);
  EXPECT_FALSE(t.running());
  EXPECT_TRUE(t.drain().empty());
}

TEST(Telemetry, LibraryWithoutNvmlIsReportedUnusable) {
  Telemetry t("libm.so.6");
  EXPECT_FALSE(t.available());
  EXPECT_NE(t.reason().find("not a usable NVML"), std::string::npos) << t.reason();
}

TEST(Telemetry, FailedInitIsReportedWithNvmlsMessage) {
  Standin s;
  ASSERT_NE(s.h, nullptr) << dlerror();
  s.reset(2);
  s.fail("nvmlInit_v2", 9);
  Telemetry t(PIMHBM_NVML_STANDIN);
  EXPECT_FALSE(t.available());
  EXPECT_NE(t.reason().find("nvmlInit failed: Driver Not Loaded (9)"), std::string::npos)
      << t.reason();
}

TEST(Telemetry, ReadsEveryScriptedField) {
  PIMHBM_SEED_TRACE();
  auto rng = rng_for_test();
  Standin s;
  s.reset(3);
  std::map<std::string, unsigned long long> want[3];
  for (int d = 0; d < 3; ++d) {
    for (const auto& name : telemetry::field_names()) {
      const bool flag = name.find("pending") != std::string::npos || name == "remap_failure" ||
                        name.rfind("ecc_mode", 0) == 0;
      const unsigned long long v =
          flag ? rng() % 2 : name == "recovery_action" ? rng() % 5 : rng() % 100000;
      s.set(d, name.c_str(), v);
      want[d][name] = v;
    }
  }
  {
    Telemetry t(PIMHBM_NVML_STANDIN);
    ASSERT_TRUE(t.available()) << t.reason();
    EXPECT_EQ(s.inits(), 1);
    const auto health = t.read();
    ASSERT_EQ(health.size(), 3u);
    for (int d = 0; d < 3; ++d) {
      EXPECT_EQ(health[d].index, d);
      EXPECT_EQ(health[d].name, "Stand-in GPU " + std::to_string(d));
      EXPECT_EQ(health[d].uuid.rfind("GPU-", 0), 0u);
      const auto got = fields_of(health[d]);
      ASSERT_EQ(got.size(), telemetry::field_names().size());
      for (const auto& [name, v] : want[d]) {
        ASSERT_TRUE(got.at(name).ok) << name << ": " << got.at(name).why;
        EXPECT_EQ(got.at(name).value, v) << "device " << d << " " << name;
      }
    }
  }
  EXPECT_EQ(s.inits(), 0) << "nvmlShutdown once per nvmlInit";
}

TEST(Telemetry, AnUnsupportedQueryMarksOnlyItsFields) {
  Standin s;
  s.reset(1);
  s.set(0, "dram_volatile_corrected", 5);
  s.fail("nvmlDeviceGetRemappedRows", 3);
  Telemetry t(PIMHBM_NVML_STANDIN);
  const auto got = fields_of(t.read().at(0));
  for (const char* n : {"remapped_rows_correctable", "remapped_rows_uncorrectable",
                        "remap_pending", "remap_failure"}) {
    EXPECT_FALSE(got.at(n).ok) << n;
    EXPECT_EQ(got.at(n).why, "Not Supported (3)") << n;
  }
  EXPECT_TRUE(got.at("dram_volatile_corrected").ok);
  EXPECT_EQ(got.at("dram_volatile_corrected").value, 5u);
}

TEST(Telemetry, DriverEventsReachTheQueue) {
  Standin s;
  s.reset(3);
  s.supported(2, 0);  // device 2 takes no events: the others still do
  Telemetry t(PIMHBM_NVML_STANDIN);
  t.start(60.0);  // no counter polls in this test
  ASSERT_TRUE(t.running());
  // Wait until the thread registered (events_status turns "" when it did).
  for (int i = 0; i < 500 && t.events_status() == "not started"; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  EXPECT_EQ(t.events_status(), "");
  s.event(1, 0x2, 0);   // double-bit ECC
  s.event(0, 0x8, 79);  // Xid 79
  s.event(1, 0x1, 0);   // single-bit ECC
  const auto got = wait_for_events(t, 3);
  ASSERT_EQ(got.size(), 3u);
  EXPECT_EQ(got[0].device, 1);
  EXPECT_EQ(got[0].kind, "double_bit_ecc");
  EXPECT_EQ(got[1].device, 0);
  EXPECT_EQ(got[1].kind, "xid");
  EXPECT_EQ(got[1].xid, 79u);
  EXPECT_EQ(got[1].detail, "Xid 79");
  EXPECT_EQ(got[2].kind, "single_bit_ecc");
  EXPECT_TRUE(t.drain().empty()) << "drain takes each event once";
  t.stop();
  EXPECT_FALSE(t.running());
}

TEST(Telemetry, ACounterThatGoesUpIsAnEvent) {
  Standin s;
  s.reset(2);
  s.set(1, "dram_volatile_corrected", 3);
  s.set(0, "remapped_rows_correctable", 7);
  Telemetry t(PIMHBM_NVML_STANDIN);
  t.start(0.02);
  ASSERT_TRUE(s.wait_for_a_reading());
  s.set(1, "dram_volatile_corrected", 4);
  s.set(0, "remapped_rows_correctable", 6);  // went down (a reset): not an event
  s.set(0, "remap_pending", 1);
  auto got = wait_for_events(t, 2);
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  for (auto& e : t.drain()) got.push_back(e);
  ASSERT_EQ(got.size(), 2u);
  std::map<int, std::string> by_device;
  for (const auto& e : got) {
    EXPECT_EQ(e.kind, "counter");
    by_device[e.device] = e.detail;
  }
  EXPECT_EQ(by_device[1], "dram_volatile_corrected 3 -> 4");
  EXPECT_EQ(by_device[0], "remap_pending 0 -> 1");
}

TEST(Telemetry, NoEventApiStillPollsCounters) {
  Standin s;
  s.reset(1);
  s.fail("nvmlDeviceRegisterEvents", 3);
  Telemetry t(PIMHBM_NVML_STANDIN);
  t.start(0.02);
  for (int i = 0; i < 500 && t.events_status() == "not started"; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  EXPECT_NE(t.events_status().find("no device accepted"), std::string::npos) << t.events_status();
  ASSERT_TRUE(s.wait_for_a_reading());
  s.set(0, "ecc_volatile_uncorrected", 1);
  const auto got = wait_for_events(t, 1);
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].detail, "ecc_volatile_uncorrected 0 -> 1");
}

TEST(Telemetry, ALostGpuEndsTheEventWatchWithAnEvent) {
  Standin s;
  s.reset(1);
  Telemetry t(PIMHBM_NVML_STANDIN);
  s.fail("nvmlEventSetWait_v2", 15);
  t.start(60.0);
  const auto got = wait_for_events(t, 1);
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].kind, "gpu_lost");
  EXPECT_NE(got[0].detail.find("GPU is lost"), std::string::npos) << got[0].detail;
  EXPECT_NE(t.events_status().find("stopped after an error"), std::string::npos);
}

}  // namespace
}  // namespace pimhbm
