// The fault lists on the CPU (fault_list.h): one plain pass, the reference the CUDA kernels are
// checked against.
#include "summary/fault_list.h"

namespace pimhbm::summary {

int64_t range_count(const MapView* maps, size_t count) {
  int64_t ranges = 0;
  for (size_t i = 0; i < count; ++i) ranges += ranges_of(maps[i].n);
  return ranges;
}

void fault_list_cpu(const MapView* maps, size_t count, const ListOut& out) {
  int64_t listed = 0, nonzero = 0, sum = 0, position = 0;
  for (size_t i = 0; i < count; ++i) {
    for (int64_t e = 0; e < maps[i].n; ++e, ++position) {
      const int32_t v = maps[i].map[e];
      if (v == 0) continue;
      ++nonzero;
      sum += v;
      if (listed < out.capacity) {
        out.index[listed] = static_cast<int32_t>(position);
        out.value[listed] = v;
        ++listed;
      }
    }
  }
  for (int64_t j = listed; j < out.capacity; ++j) out.index[j] = -1, out.value[j] = 0;
  out.totals[0] = static_cast<uint64_t>(nonzero);
  out.totals[1] = static_cast<uint64_t>(sum);
}

}  // namespace pimhbm::summary
