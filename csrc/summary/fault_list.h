// The fault lists a step leaves for the host: of per-chunk int32 maps (one a leaf, read as one
// vector in leaf order), the first `capacity` non-zero entries in order, how many entries are
// non-zero, and the sum of the values. One call a list, whatever the number of leaves: no
// concatenation of the maps, no running sums over them, no reductions of XLA's around it.
//
// Results:
//   index[j]   the position (in the concatenation) of the j-th non-zero entry, -1 past the last
//   value[j]   the map's value there, 0 past the last
//   totals     two 64-bit counters as (low, high) uint32 words: [0] the non-zero entries,
//              [1] the sum of the values as int64 (the maps hold counts and bit sets below
//              bit 31; a value with bit 31 set would count as negative, the same on both
//              platforms)
// Positions are int32: at most 2^31 - 1 entries in all (the FFI handler refuses more).
//
// The GPU does it in two launches: each range of up to kRangeEntries entries of one leaf is
// counted by a block (its count, sum and where it lies, into a scratch table); then one block
// scans the table and reads again only the ranges that hold the listed entries -- a few
// microseconds where nothing is damaged, whatever the maps' size.
#pragma once

#include <cstddef>
#include <cstdint>

#if defined(PIMHBM_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace pimhbm::summary {

inline constexpr int64_t kRangeEntries = 8192;  // entries a block counts
inline constexpr int kListTotals = 2;           // non-zero entries, sum of values

struct MapView {
  const int32_t* map = nullptr;
  int64_t n = 0;
};

// A range of one leaf's map as the counting launch leaves it for the listing one.
struct Range {
  const int32_t* at = nullptr;  // its first entry
  int64_t start = 0;            // that entry's position in the concatenation
  int64_t sum = 0;              // of its values
  int32_t n = 0;                // entries
  int32_t nonzero = 0;          // non-zero entries
};

struct ListOut {
  int32_t* index = nullptr;
  int32_t* value = nullptr;
  int64_t capacity = 0;
  uint64_t* totals = nullptr;  // kListTotals counters
};

// Ranges of a map of n entries, and of all maps: the scratch table's rows.
inline int64_t ranges_of(int64_t n) { return (n + kRangeEntries - 1) / kRangeEntries; }
int64_t range_count(const MapView* maps, size_t count);

// CPU reference.
void fault_list_cpu(const MapView* maps, size_t count, const ListOut& out);

#if defined(PIMHBM_WITH_CUDA)
// The same results, bit for bit; `scratch`: range_count(maps, count) rows of device memory.
cudaError_t fault_list_cuda(const MapView* maps, size_t count, Range* scratch, const ListOut& out,
                            cudaStream_t stream);
#endif

}  // namespace pimhbm::summary
