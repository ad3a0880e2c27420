// Test helpers: fresh random inputs every run, with the seed printed so a failure can be
// replayed (PIMHBM_SEED=<seed>).
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "pimhbm/digest.h"
#include "scan/scan.h"

namespace pimhbm::testing {

inline uint64_t test_seed() {
  static const uint64_t seed = []() -> uint64_t {
    if (const char* s = std::getenv("PIMHBM_SEED")) return std::stoull(s);
    std::random_device rd;
    return (static_cast<uint64_t>(rd()) << 32) ^ rd();
  }();
  return seed;
}

// A generator seeded from the run's seed and the test's name.
inline std::mt19937_64 rng_for_test() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  std::string name = std::string(info->test_suite_name()) + "." + info->name();
  uint64_t h = test_seed();
  for (char c : name) h = (h ^ static_cast<uint8_t>(c)) * 0x100000001B3ull;
  ::testing::Test::RecordProperty("seed", std::to_string(test_seed()));
  return std::mt19937_64(h);
}

#define PIMHBM_SEED_TRACE() \
  SCOPED_TRACE("PIMHBM_SEED=" + std::to_string(::pimhbm::testing::test_seed()))

inline std::vector<uint8_t> random_bytes(std::mt19937_64& rng, size_t n) {
  std::vector<uint8_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<uint8_t>(rng());
  return v;
}

// The digest table (uint32 (chunks, 2)) of `nbytes` bytes at `data` in chunks of `chunk_bytes`,
// by the CPU reference.
inline std::vector<uint32_t> digest_table(const void* data, int64_t nbytes, int64_t chunk_bytes) {
  const int64_t n = num_chunks(nbytes, chunk_bytes);
  std::vector<uint32_t> t(2 * n);
  std::vector<int32_t> nf(n);
  std::vector<float> mx(n);
  scan::scan_cpu(data, nbytes, Elem::kRaw, chunk_bytes, t.data(), nf.data(), mx.data());
  return t;
}
inline std::vector<uint32_t> digest_table(const std::vector<uint8_t>& x, int64_t chunk_bytes) {
  return digest_table(x.data(), static_cast<int64_t>(x.size()), chunk_bytes);
}

}  // namespace pimhbm::testing
