// The checks before the in-place update, on the CPU (precheck.h): plain loops, the reference
// the CUDA kernel is checked against.
#include "update/precheck.h"

#include "scan/scan.h"

namespace pimhbm::update {

void precheck_cpu(const PrecheckLeaf* leaves, size_t count, uint64_t* totals) {
  totals[0] = totals[1] = 0;
  for (size_t i = 0; i < count; ++i) {
    const PrecheckLeaf& L = leaves[i];
    const int64_t size = L.bf16 ? 2 : 4;
    const auto* p = static_cast<const uint8_t*>(L.p);
    for (int64_t c = 0; c < precheck_chunks(L); ++c) {
      const int64_t first = c * L.chunk_elems;
      const int64_t elems = L.n - first < L.chunk_elems ? L.n - first : L.chunk_elems;
      const uint64_t d = scan::chunk_digest(p + first * size, elems * size, precheck_base(L) + c);
      L.damaged[c] = d != digest_join(L.d_p[2 * c], L.d_p[2 * c + 1]) ? 1 : 0;
      int32_t bad = 0;
      for (int64_t e = first; e < first + (L.g != nullptr ? elems : 0); ++e) {
        const uint32_t bits = L.bf16 ? static_cast<const uint16_t*>(L.g)[e]
                                     : static_cast<const uint32_t*>(L.g)[e];
        bad += square_nonfinite(bits, L.bf16) ? 1 : 0;
      }
      L.nonfinite[c] = bad;
      totals[0] += static_cast<uint64_t>(L.damaged[c]);
      totals[1] += static_cast<uint64_t>(bad);
    }
  }
}

}  // namespace pimhbm::update
