// Which chunks each parity group of a tensor holds.
//
// Chunks are taken in blocks of group * group. A block's chunks are dealt round-robin to its
// groups: `group` of them in a whole block, ceil(n / group) in a short last block of n chunks,
// each holding at most `group` chunks. Neighbouring chunks therefore sit in different groups: a
// burst of damage over consecutive chunks (a failed DRAM row covers a few of them) is one damaged
// chunk in each of several groups, and every one of them is rebuilt in place, where groups of
// consecutive chunks would hold two damaged chunks in one group and rebuild neither.
//
// The deal is counted from the block's end, so the tensor's last chunk (the one that may be
// short) is the last chunk of the last group. A tensor has ceil(chunks / group) groups, and a run
// of whole blocks holds a contiguous run of whole groups: a shard of whole blocks computes its own
// groups' rows with its own chunk indices.
#pragma once

#include <cstdint>

#include "pimhbm/digest.h"  // PIMHBM_HD

namespace pimhbm::parity {

// group * group and every chunk index fit 32 bits, so that the GPU's arithmetic here is 32-bit
// (a 64-bit division is a long subroutine there); the FFI handlers refuse larger values.
inline constexpr int64_t kMaxGroup = int64_t{1} << 15;
inline constexpr int64_t kMaxChunks = (int64_t{1} << 31) - 1;

struct GroupSpan {  // the chunks first, first + stride, ..., count of them
  uint32_t first;
  uint32_t stride;
  uint32_t count;

  PIMHBM_HD int64_t chunk(uint32_t m) const { return first + m * stride; }  // the m-th
};

struct GroupBlock {  // the block that holds a chunk or a group
  uint32_t first_chunk;
  uint32_t chunks;       // in this block (short for the last one)
  uint32_t first_group;  // the block's first group in the tensor
  uint32_t groups;       // in this block
};

PIMHBM_HD int64_t groups_of_chunks(int64_t chunks, int64_t group) {
  return (chunks + group - 1) / group;
}

PIMHBM_HD GroupBlock group_block(uint32_t chunks, uint32_t group, uint32_t block) {
  const uint32_t per_block = group * group;
  const uint32_t first = block * per_block;
  const uint32_t n = chunks - first < per_block ? chunks - first : per_block;
  return {first, n, block * group, (n + group - 1) / group};
}

// The group of chunk c (0 <= c < chunks <= kMaxChunks, 1 <= group <= kMaxGroup).
PIMHBM_HD int64_t group_of(int64_t chunks, int64_t group, int64_t c) {
  const auto g = static_cast<uint32_t>(group), k = static_cast<uint32_t>(c);
  const GroupBlock b = group_block(static_cast<uint32_t>(chunks), g, k / (g * g));
  return b.first_group + b.groups - 1 - (b.chunks - 1 - (k - b.first_chunk)) % b.groups;
}

// The chunks of group g (0 <= g < groups_of_chunks(chunks, group)), in increasing order.
PIMHBM_HD GroupSpan group_span(int64_t chunks, int64_t group, int64_t g) {
  const auto per = static_cast<uint32_t>(group), k = static_cast<uint32_t>(g);
  const GroupBlock b = group_block(static_cast<uint32_t>(chunks), per, k / per);
  if (b.groups == per && b.chunks == per * per) {  // a whole block: no division by b.groups
    return {b.first_chunk + (k - b.first_group), per, per};
  }
  const uint32_t last = b.chunks - b.groups + (k - b.first_group);  // in the block
  return {b.first_chunk + last % b.groups, b.groups, last / b.groups + 1};
}

}  // namespace pimhbm::parity
