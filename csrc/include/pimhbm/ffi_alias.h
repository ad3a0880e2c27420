// In-place operations and XLA's aliasing. The ops that update a tensor in place ask XLA to
// give a result the operand's buffer (input_output_aliases) and write through the result only.
// XLA does not always honour that: on the GPU an in-graph fault hook got a fresh result buffer,
// so uninitialised memory stood where the gradient should have been. Where a result's buffer
// is not its operand's, the handler first copies the operand into it (on the op's stream), so
// that the op means the same whether XLA aliased or not; where it is, nothing is copied.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace pimhbm::ffi_util {

namespace ffi = xla::ffi;

// How many results this process's in-place ops found unaliased (each one a copy that XLA's
// aliasing would have saved): zero is the expected figure; pimhbm._core.unaliased_copies().
inline std::atomic<uint64_t> unaliased_count{0};

struct Unaliased {
  const void* from;
  void* to;
  size_t bytes;
};

// Adds (operand, result) when they are different buffers.
inline void note_unaliased(std::vector<Unaliased>* out, const ffi::AnyBuffer& operand,
                           const ffi::AnyBuffer& result) {
  if (operand.untyped_data() != result.untyped_data() && result.size_bytes() > 0) {
    out->push_back({operand.untyped_data(), result.untyped_data(),
                    std::min(operand.size_bytes(), result.size_bytes())});
    unaliased_count.fetch_add(1, std::memory_order_relaxed);
  }
}

// The (operand, result) pairs of an op that are different buffers.
inline std::vector<Unaliased> unaliased(
    std::initializer_list<std::pair<const ffi::AnyBuffer&, const ffi::AnyBuffer&>> pairs) {
  std::vector<Unaliased> out;
  for (const auto& [operand, result] : pairs) note_unaliased(&out, operand, result);
  return out;
}

inline void copy_unaliased_cpu(const std::vector<Unaliased>& copies) {
  for (const Unaliased& c : copies) std::memcpy(c.to, c.from, c.bytes);
}

}  // namespace pimhbm::ffi_util
