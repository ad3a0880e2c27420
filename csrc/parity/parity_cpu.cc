// CPU reference of the parity rows and of a rebuild from them: byte loops.
#include <algorithm>
#include <cstring>
#include <vector>

#include "parity/groups.h"
#include "parity/parity.h"
#include "pimhbm/digest.h"
#include "repair/repair.h"
#include "scan/scan.h"

namespace pimhbm::parity {
namespace {

int64_t chunks_of(int64_t nbytes, int64_t chunk_bytes) {
  return nbytes == 0 ? 0 : (nbytes + chunk_bytes - 1) / chunk_bytes;
}

// XORs chunk c (zero-padded) into `row` (chunk_bytes bytes).
void xor_chunk(const uint8_t* data, int64_t nbytes, int64_t chunk_bytes, int64_t c, uint8_t* row) {
  const int64_t first = c * chunk_bytes;
  const int64_t len = std::min(chunk_bytes, nbytes - first);
  for (int64_t b = 0; b < len; ++b) row[b] ^= data[first + b];
}

// Another entry names a chunk of the group of entry k (all entries below `chunks`).
bool conflicts(const int32_t* list, int64_t count, int64_t k, int64_t chunks, int64_t group) {
  const int64_t g = group_of(chunks, group, list[k]);
  for (int64_t j = 0; j < count; ++j) {
    if (j != k && list[j] >= 0 && list[j] < chunks && group_of(chunks, group, list[j]) == g) {
      return true;
    }
  }
  return false;
}

}  // namespace

void parity_cpu(const uint8_t* data, int64_t nbytes, int64_t chunk_bytes, int64_t group,
                uint32_t* rows) {
  const int64_t chunks = chunks_of(nbytes, chunk_bytes);
  auto* out = reinterpret_cast<uint8_t*>(rows);
  std::memset(out, 0, static_cast<size_t>(num_groups(nbytes, chunk_bytes, group) * chunk_bytes));
  for (int64_t c = 0; c < chunks; ++c) {
    xor_chunk(data, nbytes, chunk_bytes, c, out + group_of(chunks, group, c) * chunk_bytes);
  }
}

void rebuild_cpu(const Grouped& t, const uint32_t* rows, const int32_t* list, int64_t count,
                 int32_t* status) {
  const int64_t chunks = chunks_of(t.nbytes, t.chunk_bytes);
  std::vector<uint8_t> row(static_cast<size_t>(t.chunk_bytes));
  for (int64_t k = 0; k < count; ++k) {
    const int64_t c = list[k];
    if (c < 0) {
      status[k] = repair::kNotListed;
      continue;
    }
    if (c >= chunks) {
      status[k] = repair::kOutOfRange;
      continue;
    }
    if (conflicts(list, count, k, chunks, t.group)) {
      status[k] = kGroupConflict;
      continue;
    }
    const int64_t g = group_of(chunks, t.group, c);
    std::memcpy(row.data(), reinterpret_cast<const uint8_t*>(rows) + g * t.chunk_bytes,
                row.size());
    const GroupSpan span = group_span(chunks, t.group, g);
    for (uint32_t m = 0; m < span.count; ++m) {
      const int64_t j = span.chunk(m);
      if (j != c) xor_chunk(t.data, t.nbytes, t.chunk_bytes, j, row.data());
    }
    const int64_t first = c * t.chunk_bytes;
    const int64_t len = std::min(t.chunk_bytes, t.nbytes - first);
    std::memcpy(t.data + first, row.data(), static_cast<size_t>(len));
    const uint64_t d = scan::chunk_digest(t.data + first, len, grouped_base(t) + c);
    const bool ok = d == digest_join(t.table[2 * c], t.table[2 * c + 1]);
    status[k] = ok ? repair::kRepaired : repair::kStillDamaged;
  }
}

}  // namespace pimhbm::parity
