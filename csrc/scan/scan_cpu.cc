// CPU reference of the scan: the plainest correct loops. The CUDA kernels must match these
// bit for bit; they are also what the CPU backend of the FFI ops runs.
#include <cmath>
#include <cstring>

#include "scan/scan.h"

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "digests read little-endian words");

namespace pimhbm::scan {

uint64_t chunk_digest(const uint8_t* p, int64_t len, int64_t chunk) {
  uint64_t acc = 0;
  const int64_t full = len / 4;
  for (int64_t w = 0; w < full; ++w) {
    uint32_t word;
    std::memcpy(&word, p + 4 * w, 4);
    acc += word_term(word, word_mul(static_cast<uint32_t>(w)));
  }
  if (const int64_t rest = len - 4 * full; rest > 0) {  // last word, zero-padded
    uint32_t word = 0;
    std::memcpy(&word, p + 4 * full, static_cast<size_t>(rest));
    acc += word_term(word, word_mul(static_cast<uint32_t>(full)));
  }
  return finalize(acc, static_cast<uint64_t>(len), static_cast<uint64_t>(chunk));
}

namespace {

template <typename T>
T load(const uint8_t* p, int64_t i) {
  T v;
  std::memcpy(&v, p + i * static_cast<int64_t>(sizeof(T)), sizeof(T));
  return v;
}

// Records one element: `finite` and, when finite, its magnitude.
inline void record(ChunkHealth& h, bool finite, float magnitude) {
  h.nonfinite += finite ? 0 : 1;
  h.max_abs = finite && magnitude > h.max_abs ? magnitude : h.max_abs;
}

}  // namespace

ChunkHealth chunk_health(const uint8_t* p, int64_t len, Elem elem) {
  ChunkHealth h;
  switch (elem) {
    case Elem::kRaw:
      break;
    case Elem::kF64:
      for (int64_t i = 0; i < len / 8; ++i) {
        double v = load<double>(p, i);
        record(h, std::isfinite(v), static_cast<float>(std::fabs(v)));
      }
      break;
    case Elem::kF32:
      for (int64_t i = 0; i < len / 4; ++i) {
        float v = load<float>(p, i);
        record(h, std::isfinite(v), std::fabs(v));
      }
      break;
    case Elem::kF16:
      for (int64_t i = 0; i < len / 2; ++i) {
        uint32_t a = load<uint16_t>(p, i) & 0x7FFFu;
        record(h, a < 0x7C00u, a < 0x7C00u ? f16_abs_to_float(a) : 0.0f);
      }
      break;
    case Elem::kBF16:
      for (int64_t i = 0; i < len / 2; ++i) {
        uint32_t a = load<uint16_t>(p, i) & 0x7FFFu;
        record(h, a < 0x7F80u, bits_to_float(a << 16));
      }
      break;
    case Elem::kF8E4M3FN:
      for (int64_t i = 0; i < len; ++i) {
        uint32_t a = p[i] & 0x7Fu;
        record(h, a != 0x7Fu, f8e4m3fn_abs_to_float(a));
      }
      break;
    case Elem::kF8E5M2:
      for (int64_t i = 0; i < len; ++i) {
        uint32_t a = p[i] & 0x7Fu;
        record(h, a < 0x7Cu, a < 0x7Cu ? f8e5m2_abs_to_float(a) : 0.0f);
      }
      break;
  }
  return h;
}

void scan_cpu(const void* data, int64_t nbytes, Elem elem, int64_t chunk_bytes, uint32_t* digests,
              int32_t* nonfinite, float* max_abs, int64_t chunk_base) {
  const auto* bytes = static_cast<const uint8_t*>(data);
  int64_t n = num_chunks(nbytes, chunk_bytes);
  for (int64_t c = 0; c < n; ++c) {
    const uint8_t* p = bytes + c * chunk_bytes;
    int64_t len = chunk_length(nbytes, chunk_bytes, c);
    uint64_t d = chunk_digest(p, len, chunk_base + c);
    digests[2 * c] = digest_lo(d);
    digests[2 * c + 1] = digest_hi(d);
    ChunkHealth h = chunk_health(p, len, elem);
    nonfinite[c] = h.nonfinite;
    max_abs[c] = h.max_abs;
  }
}

void verify_cpu(const void* data, int64_t nbytes, int64_t chunk_bytes, const uint32_t* expected,
                uint8_t* mismatch, int64_t chunk_base) {
  const auto* bytes = static_cast<const uint8_t*>(data);
  int64_t n = num_chunks(nbytes, chunk_bytes);
  for (int64_t c = 0; c < n; ++c) {
    uint64_t d =
        chunk_digest(bytes + c * chunk_bytes, chunk_length(nbytes, chunk_bytes, c), chunk_base + c);
    mismatch[c] = d != digest_join(expected[2 * c], expected[2 * c + 1]) ? 1 : 0;
  }
}

}  // namespace pimhbm::scan
