// The fault lists on the GPU (fault_list.h): a block counts each range of a leaf's map, then one
// block places the first `capacity` non-zero entries in order, reading again only the ranges
// that hold them. Deterministic: no atomics, every sum in a fixed order.
#include <algorithm>
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include "pimhbm/cuda_check.h"
#include "summary/fault_list.h"

namespace pimhbm::summary {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxLeaves = 256;  // leaves a counting launch describes (8 KiB of parameters)

struct LeafRanges {
  const int32_t* map;
  int64_t n;
  int64_t start;      // its first entry's position in the concatenation
  int64_t first_row;  // its first range's row of the scratch table
};

struct Table {
  LeafRanges leaf[kMaxLeaves];
  int count;
  int64_t first_row;  // the launch's block 0
};
static_assert(sizeof(Table) < 32000, "the leaf table must fit the kernel parameters");

using Reduce64 = cub::BlockReduce<int64_t, kThreads>;
using Scan32 = cub::BlockScan<int32_t, kThreads>;

// Block b counts row T.first_row + b: a range of one leaf, found by a search of the table
// (every thread the same).
__global__ void __launch_bounds__(kThreads)
    count_ranges(const __grid_constant__ Table T, Range* rows) {
  __shared__ typename Reduce64::TempStorage temp;
  const int64_t row = T.first_row + blockIdx.x;
  int lo = 0, hi = T.count - 1;
  while (lo < hi) {  // the last leaf whose first row is <= row
    const int mid = (lo + hi + 1) / 2;
    if (T.leaf[mid].first_row <= row)
      lo = mid;
    else
      hi = mid - 1;
  }
  const LeafRanges& L = T.leaf[lo];
  const int64_t first = (row - L.first_row) * kRangeEntries;
  const int32_t n = static_cast<int32_t>(min(kRangeEntries, L.n - first));
  const int32_t* at = L.map + first;
  int64_t nonzero = 0, sum = 0;
  for (int32_t e = threadIdx.x; e < n; e += kThreads) {
    const int32_t v = at[e];
    nonzero += v != 0 ? 1 : 0;
    sum += v;
  }
  nonzero = Reduce64(temp).Sum(nonzero);
  __syncthreads();
  sum = Reduce64(temp).Sum(sum);
  if (threadIdx.x == 0)
    rows[row] = Range{at, L.start + first, sum, n, static_cast<int32_t>(nonzero)};
}

// The non-zero entries of range R into the list from place `base` on, in order, while the list
// has room: each thread a contiguous stretch of the range.
__device__ void list_range(const Range& R, int64_t base, const ListOut& out,
                           typename Scan32::TempStorage& temp) {
  const int32_t per = (R.n + kThreads - 1) / kThreads;
  const int32_t begin = min(R.n, static_cast<int32_t>(threadIdx.x) * per);
  const int32_t end = min(R.n, begin + per);
  int32_t mine = 0;
  for (int32_t e = begin; e < end; ++e) mine += R.at[e] != 0 ? 1 : 0;
  int32_t before;
  Scan32(temp).ExclusiveSum(mine, before);
  __syncthreads();
  int64_t place = base + before;
  for (int32_t e = begin; e < end && place < out.capacity; ++e) {
    const int32_t v = R.at[e];
    if (v == 0) continue;
    out.index[place] = static_cast<int32_t>(R.start + e);
    out.value[place] = v;
    ++place;
  }
}

// One block: the totals, then the ranges in order, tile by tile, until the list is full; the
// rest of the list -1 and 0.
__global__ void __launch_bounds__(kThreads)
    list_ranges(const Range* rows, int64_t count, ListOut out) {
  __shared__ union {
    typename Reduce64::TempStorage reduce;
    typename Scan32::TempStorage scan;
  } temp;
  __shared__ int32_t queue[kThreads];  // rows of this tile to list, in order
  __shared__ int64_t queue_base[kThreads];
  int64_t nonzero = 0, sum = 0;
  for (int64_t r = threadIdx.x; r < count; r += kThreads)
    nonzero += rows[r].nonzero, sum += rows[r].sum;
  nonzero = Reduce64(temp.reduce).Sum(nonzero);
  __syncthreads();
  sum = Reduce64(temp.reduce).Sum(sum);
  if (threadIdx.x == 0)
    out.totals[0] = static_cast<uint64_t>(nonzero), out.totals[1] = static_cast<uint64_t>(sum);
  __syncthreads();

  int64_t placed = 0;  // non-zero entries in the rows before this tile (the same in every thread)
  for (int64_t tile = 0; tile < count && placed < out.capacity; tile += kThreads) {
    const int64_t r = tile + threadIdx.x;
    const int32_t nz = r < count ? rows[r].nonzero : 0;
    int32_t before, in_tile;
    Scan32(temp.scan).ExclusiveSum(nz, before, in_tile);
    __syncthreads();
    const int32_t listed = nz > 0 && placed + before < out.capacity ? 1 : 0;
    int32_t slot, queued;
    Scan32(temp.scan).ExclusiveSum(listed, slot, queued);
    __syncthreads();
    if (listed) queue[slot] = static_cast<int32_t>(threadIdx.x), queue_base[slot] = placed + before;
    __syncthreads();
    for (int32_t q = 0; q < queued; ++q) {
      list_range(rows[tile + queue[q]], queue_base[q], out, temp.scan);
      __syncthreads();
    }
    placed += in_tile;
  }
  for (int64_t j = min(placed, out.capacity) + threadIdx.x; j < out.capacity; j += kThreads) {
    out.index[j] = -1, out.value[j] = 0;
  }
}

}  // namespace

cudaError_t fault_list_cuda(const MapView* maps, size_t count, Range* scratch, const ListOut& out,
                            cudaStream_t stream) {
  Table T{};
  int64_t row = 0, position = 0;
  auto flush = [&]() -> cudaError_t {
    const int64_t blocks = row - T.first_row;
    if (T.count > 0 && blocks > 0) {
      count_ranges<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(T, scratch);
      PIMHBM_CUDA_RETURN_LAUNCH_ERROR();
    }
    T.count = 0, T.first_row = row;
    return cudaSuccess;
  };
  for (size_t i = 0; i < count; ++i) {
    if (maps[i].n > 0) {
      T.leaf[T.count++] = LeafRanges{maps[i].map, maps[i].n, position, row};
      row += ranges_of(maps[i].n);
      if (T.count == kMaxLeaves) PIMHBM_CUDA_RETURN_IF_ERROR(flush());
    }
    position += maps[i].n;
  }
  PIMHBM_CUDA_RETURN_IF_ERROR(flush());
  list_ranges<<<1, kThreads, 0, stream>>>(scratch, row, out);
  PIMHBM_CUDA_RETURN_LAUNCH_ERROR();
  return cudaSuccess;
}

}  // namespace pimhbm::summary
