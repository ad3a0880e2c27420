// "pimhbm_snapshot": (buffers...) -> ticket int32[1]; attributes: the region's id and one byte
// offset per buffer. The handler finds the region through ShmRegion's registry (an id is never
// reused, so a program whose region is gone gets an error, never a stale address) and checks,
// without overflow, that every copy lies inside it.
#include "backup/snapshot.h"

#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "backup/shm_region.h"
#include "pimhbm/ffi_alias.h"
#include "pimhbm/ffi_platform.h"
#include "pimhbm/ffi_util.h"
#include "pimhbm/side_stream.h"

#if defined(PIMHBM_WITH_CUDA)
#include "pimhbm/cuda_check.h"
#endif

namespace pimhbm::backup {

namespace ffi = xla::ffi;

namespace {

struct Copy {
  const void* src;
  uint8_t* dst;
  int64_t bytes;
};

constexpr const char* kOp = "pimhbm.snapshot";

// Whether `bytes` at `offset` lie inside `size` bytes, computed without overflow.
bool fits(int64_t offset, int64_t bytes, int64_t size) {
  return offset >= 0 && bytes >= 0 && bytes <= size && offset <= size - bytes;
}

// The copies into the region, each checked to lie inside it.
ffi::Error plan(const ffi::RemainingArgs& args, const ShmRegion& region,
                ffi::Span<const int64_t> offsets, std::vector<Copy>* copies) {
  if (offsets.size() != args.size()) {
    return ffi_util::invalid(kOp, std::to_string(args.size()) + " buffers but " +
                                      std::to_string(offsets.size()) + " offsets");
  }
  copies->clear();
  for (size_t i = 0; i < args.size(); ++i) {
    auto buf = args.get<ffi::AnyBuffer>(i);
    if (!buf) return ffi_util::invalid(kOp, "argument " + std::to_string(i) + " is not a buffer");
    const int64_t bytes = static_cast<int64_t>(buf->size_bytes());
    if (!fits(offsets[i], bytes, region.nbytes())) {
      return ffi_util::invalid(kOp, "buffer " + std::to_string(i) + " (" + std::to_string(bytes) +
                                        " bytes at offset " + std::to_string(offsets[i]) +
                                        ") does not fit in the region of " +
                                        std::to_string(region.nbytes()) + " bytes");
    }
    copies->push_back({buf->untyped_data(), region.data() + offsets[i], bytes});
  }
  return ffi::Error::Success();
}

// The copies on the host, at once; the ticket is only a result for XLA to keep the call.
ffi::Error copy_to_region(ffi_util::OnCpu, const std::vector<Copy>& copies, int32_t* ticket) {
  for (const Copy& c : copies) std::memcpy(c.dst, c.src, static_cast<size_t>(c.bytes));
  *ticket = 0;
  return ffi::Error::Success();
}

#if defined(PIMHBM_WITH_CUDA)
// The copies run on a side stream of each device (pimhbm/side_stream.h).
ffi_util::SideStreams& copiers() {
  static auto* streams = new ffi_util::SideStreams();  // never destroyed: used at exit
  return *streams;
}

cudaError_t issue(cudaStream_t xla_stream, const std::vector<Copy>& copies, int32_t* ticket) {
  PIMHBM_CUDA_RETURN_IF_ERROR(copiers().on_current_device([&](const ffi_util::SideStream& side) {
    PIMHBM_CUDA_RETURN_IF_ERROR(side.follow(xla_stream));
    for (const Copy& cp : copies) {
      PIMHBM_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(cp.dst, cp.src, static_cast<size_t>(cp.bytes),
                                                  cudaMemcpyDeviceToHost, side.stream));
    }
    return side.mark_done();
  }));
  // The ticket is only a result for XLA to keep the call; it holds 0.
  PIMHBM_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(ticket, 0, sizeof(int32_t), xla_stream));
  return cudaSuccess;
}

// On the GPU the copies go to the side stream (issue).
ffi::Error copy_to_region(const ffi_util::OnCuda& on, const std::vector<Copy>& copies,
                          int32_t* ticket) {
  return ffi_util::cuda_status(kOp, issue(on.stream, copies, ticket));
}
#endif

// (buffers...) -> ticket int32[1]: the buffers copied into the region at the offsets.
template <typename Platform>
ffi::Error snapshot_handler(Platform on, ffi::RemainingArgs args,
                            ffi::ResultBuffer<ffi::S32> ticket, int64_t region_id,
                            ffi::Span<const int64_t> offsets) {
  // Held until the copies are issued; a region that goes afterwards waits for them first.
  const std::shared_ptr<ShmRegion> region = ShmRegion::find(region_id);
  if (!region) {
    return ffi_util::invalid(kOp, "the region (id " + std::to_string(region_id) +
                                      ") is gone: the program outlived the backup it was "
                                      "compiled for; make it again for the new region");
  }
  std::vector<Copy> copies;
  PIMHBM_FFI_RETURN_IF_ERROR(plan(args, *region, offsets, &copies));
  PIMHBM_FFI_RETURN_IF_ERROR(ffi_util::check_count(kOp, "ticket", *ticket, 1));
  return copy_to_region(on, copies, ticket->typed_data());
}

#if defined(PIMHBM_WITH_CUDA)
// XLA's stream waits for this device's last snapshot copies (none issued: nothing to wait for).
cudaError_t fence(cudaStream_t xla_stream) {
  return copiers().if_on_current_device(
      [&](const ffi_util::SideStream& side) { return side.join(xla_stream); });
}

ffi::Error fence_on(const ffi_util::OnCuda& on) {
  return ffi_util::cuda_status("pimhbm.snapshot_fence", fence(on.stream));
}
#endif

// On the host the copies were done inside the snapshot op: nothing is in flight.
ffi::Error fence_on(ffi_util::OnCpu) { return ffi::Error::Success(); }

// (buffers...) -> the same buffers (aliased): what reads them after this op runs only once the
// snapshot copies issued before it are done. A state updated in place puts it before its first
// write, so that a copy never reads a half-written state.
template <typename Platform>
ffi::Error fence_handler(Platform on, ffi::RemainingArgs args, ffi::RemainingRets rets) {
  // A result XLA gave a buffer of its own (it does, on the GPU, for a gradient no other op
  // wrote in place) gets the operand's bytes: the op then passes its buffers through either way.
  return ffi_util::pass_through("pimhbm.snapshot_fence", on, args, rets,
                                [](const Platform& p) { return fence_on(p); });
}

}  // namespace

void snapshot_wait() {
#if defined(PIMHBM_WITH_CUDA)
  const cudaError_t err = copiers().each(
      [](const ffi_util::SideStream& side) { return cudaEventSynchronize(side.done); });
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("snapshot copy failed: ") + cudaGetErrorString(err));
  }
#endif
}

bool snapshot_pending() {
#if defined(PIMHBM_WITH_CUDA)
  // Stops at the first device whose copies are still running (cudaErrorNotReady).
  const cudaError_t err =
      copiers().each([](const ffi_util::SideStream& side) { return cudaEventQuery(side.done); });
  if (err == cudaErrorNotReady) return true;
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("snapshot copy failed: ") + cudaGetErrorString(err));
  }
#endif
  return false;
}

}  // namespace pimhbm::backup

#define PIMHBM_SNAPSHOT_BINDING(bind)             \
  bind.RemainingArgs()                            \
      .Ret<::xla::ffi::Buffer<::xla::ffi::S32>>() \
      .Attr<int64_t>("region")                    \
      .Attr<::xla::ffi::Span<const int64_t>>("offsets")
// Not capturable into a command buffer: the copies run on a side stream, ordered by events.
PIMHBM_FFI_HANDLERS(PimhbmSnapshot, pimhbm::backup::snapshot_handler, PIMHBM_SNAPSHOT_BINDING,
                    PIMHBM_FFI_NOT_CAPTURABLE);

#define PIMHBM_SNAPSHOT_FENCE_BINDING(bind) bind.RemainingArgs().RemainingRets()
// Not capturable: it waits on an event of the snapshot's side stream.
PIMHBM_FFI_HANDLERS(PimhbmSnapshotFence, pimhbm::backup::fence_handler,
                    PIMHBM_SNAPSHOT_FENCE_BINDING, PIMHBM_FFI_NOT_CAPTURABLE);
