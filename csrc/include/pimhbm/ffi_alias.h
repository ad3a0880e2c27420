// In-place operations and XLA's aliasing. The ops that update a tensor in place ask XLA to
// give a result the operand's buffer (input_output_aliases) and write through the result only.
// XLA does not always honour that: on the GPU an in-graph fault hook got a fresh result buffer,
// so uninitialised memory stood where the gradient should have been. Where a result's buffer
// is not its operand's, the handler first copies the operand into it (on the op's stream), so
// that the op means the same whether XLA aliased or not; where it is, nothing is copied.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "pimhbm/ffi_error.h"
#include "pimhbm/ffi_platform.h"
#include "xla/ffi/api/ffi.h"

namespace pimhbm::ffi_util {

namespace ffi = xla::ffi;

// The results this process's in-place ops found unaliased (each one a copy that XLA's aliasing
// would have saved; zero is the expected figure), by op: how many, the bytes copied, and how
// many of the copies were recorded into a CUDA graph (an XLA command buffer): the handler then
// runs once, when the graph is recorded, and the copy repeats on every replay without being
// counted again. pimhbm._core.unaliased_copies() (all ops) and unaliased_copies_by_op().
struct UnaliasedTally {
  uint64_t results = 0;
  uint64_t bytes = 0;
  uint64_t in_command_buffer = 0;
};

inline std::mutex unaliased_mutex;
inline std::map<std::string, UnaliasedTally> unaliased_by_op;

inline std::map<std::string, UnaliasedTally> unaliased_tally() {
  std::lock_guard<std::mutex> lock(unaliased_mutex);
  return unaliased_by_op;
}

inline uint64_t unaliased_total() {
  uint64_t n = 0;
  for (const auto& entry : unaliased_tally()) n += entry.second.results;
  return n;
}

struct Unaliased {
  const char* op;  // the op's name, "pimhbm.adamw" (a string literal)
  const void* from;
  void* to;
  size_t bytes;
};

// Adds (operand, result) when they are different buffers. Rare (zero is expected), so the
// tally's lock is taken only then.
inline void note_unaliased(const char* op, std::vector<Unaliased>* out,
                           const ffi::AnyBuffer& operand, const ffi::AnyBuffer& result) {
  if (operand.untyped_data() != result.untyped_data() && result.size_bytes() > 0) {
    const size_t bytes = std::min(operand.size_bytes(), result.size_bytes());
    out->push_back({op, operand.untyped_data(), result.untyped_data(), bytes});
    std::lock_guard<std::mutex> lock(unaliased_mutex);
    UnaliasedTally& t = unaliased_by_op[op];
    t.results += 1;
    t.bytes += bytes;
  }
}

// The (operand, result) pairs of an op that are different buffers.
inline std::vector<Unaliased> unaliased(
    const char* op,
    std::initializer_list<std::pair<const ffi::AnyBuffer&, const ffi::AnyBuffer&>> pairs) {
  std::vector<Unaliased> out;
  for (const auto& [operand, result] : pairs) note_unaliased(op, &out, operand, result);
  return out;
}

// The copies, before the op's kernels: on the host ...
inline ffi::Error copy_unaliased(OnCpu, const std::vector<Unaliased>& copies) {
  for (const Unaliased& c : copies) std::memcpy(c.to, c.from, c.bytes);
  return ffi::Error::Success();
}

#if defined(PIMHBM_WITH_CUDA)
// ... or on the op's stream, device to device. Recorded into a command buffer, the copies run
// on every replay of it: the tally says so.
inline ffi::Error copy_unaliased(const OnCuda& on, const std::vector<Unaliased>& copies) {
  if (copies.empty()) return ffi::Error::Success();
  const char* op = copies.front().op;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  PIMHBM_FFI_RETURN_IF_ERROR(cuda_status(op, cudaStreamIsCapturing(on.stream, &capture)));
  if (capture == cudaStreamCaptureStatusActive) {
    std::lock_guard<std::mutex> lock(unaliased_mutex);
    for (const Unaliased& c : copies) unaliased_by_op[c.op].in_command_buffer += 1;
  }
  for (const Unaliased& c : copies) {
    PIMHBM_FFI_RETURN_IF_ERROR(cuda_status(
        op, cudaMemcpyAsync(c.to, c.from, c.bytes, cudaMemcpyDeviceToDevice, on.stream)));
  }
  return ffi::Error::Success();
}
#endif

// (buffers...) -> the same buffers, aliased, for an op that only orders work: `wait(on)` first
// (XLA's stream waits for work of another stream), then a result XLA gave a buffer of its own
// gets its operand's bytes -- so what reads a result runs after the wait either way.
template <typename Platform, typename Wait>
ffi::Error pass_through(const char* op, Platform on, const ffi::RemainingArgs& args,
                        const ffi::RemainingRets& rets, Wait wait) {
  if (args.size() != rets.size()) {
    return invalid(op, std::to_string(args.size()) + " buffers but " + std::to_string(rets.size()) +
                           " results");
  }
  std::vector<Unaliased> copies;
  for (size_t i = 0; i < args.size(); ++i) {
    auto in = args.get<ffi::AnyBuffer>(i);
    auto out = rets.get<ffi::AnyBuffer>(i);
    if (!in || !out) {
      return invalid(op, "argument or result " + std::to_string(i) + " is not a buffer");
    }
    if ((*in).size_bytes() != (*out)->size_bytes()) {
      return invalid(
          op, "result " + std::to_string(i) + " is not the size of argument " + std::to_string(i));
    }
    note_unaliased(op, &copies, *in, **out);
  }
  PIMHBM_FFI_RETURN_IF_ERROR(wait(on));
  return copy_unaliased(on, copies);
}

}  // namespace pimhbm::ffi_util
