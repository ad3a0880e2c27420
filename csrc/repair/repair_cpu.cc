#include <algorithm>
#include <cstring>

#include "pimhbm/digest.h"
#include "repair/repair.h"
#include "scan/scan.h"

namespace pimhbm::repair {
namespace {

int64_t nchunks(int64_t nbytes, int64_t chunk_bytes) { return num_chunks(nbytes, chunk_bytes); }

// Chunk c's bytes at `data` (len of them) against the digest row `row`.
bool verifies(const uint8_t* data, int64_t len, const uint32_t* row, int64_t c) {
  return scan::chunk_digest(data, len, c) == digest_join(row[0], row[1]);
}

}  // namespace

void repair_from_cpu(const int32_t* chunks, int64_t nlisted, const Sources& sources,
                     const MutableChunkedTensor& dst, int32_t* status) {
  const int64_t n = nchunks(dst.nbytes, dst.chunk_bytes);
  for (int64_t k = 0; k < nlisted; ++k) {
    const int64_t c = chunks[k];
    const int s = sources.which ? sources.which[k] : 0;
    if (c < 0 || s == sources.self) {
      status[k] = kNotListed;
      continue;
    }
    if (c >= n || s < 0 || s >= sources.count) {
      status[k] = kOutOfRange;
      continue;
    }
    const ChunkedTensor& src = sources.tensor[s];
    const int64_t at = sources.packed ? k : c;  // where the source holds it
    const uint8_t* from = src.data + at * src.chunk_bytes;
    const uint32_t* row = src.table + 2 * at;
    const int64_t len = chunk_length(dst.nbytes, dst.chunk_bytes, c);
    if (!verifies(from, len, row, c)) {
      status[k] = kSourceDamaged;
      continue;
    }
    uint8_t* to = dst.data + c * dst.chunk_bytes;
    std::memcpy(to, from, len);
    dst.table[2 * c] = row[0];
    dst.table[2 * c + 1] = row[1];
    status[k] = verifies(to, len, dst.table + 2 * c, c) ? kRepaired : kStillDamaged;
  }
}

void repair_cpu(const int32_t* chunks, int64_t nlisted, const ChunkedTensor& src,
                const MutableChunkedTensor& dst, int32_t* status) {
  Sources one{};
  one.tensor[0] = src;
  one.count = 1;
  one.self = -1;
  repair_from_cpu(chunks, nlisted, one, dst, status);
}

void restore_clean_cpu(const int32_t* commit, const int32_t* faults, const ChunkedTensor& src,
                       const MutableChunkedTensor& dst) {
  if (*commit != 0) return;
  const int64_t n = nchunks(dst.nbytes, dst.chunk_bytes);
  for (int64_t c = 0; c < n; ++c) {
    if (faults[c] != 0) continue;
    const int64_t len = chunk_length(dst.nbytes, dst.chunk_bytes, c);
    std::memcpy(dst.data + c * dst.chunk_bytes, src.data + c * src.chunk_bytes, len);
    dst.table[2 * c] = src.table[2 * c];
    dst.table[2 * c + 1] = src.table[2 * c + 1];
  }
}

}  // namespace pimhbm::repair
