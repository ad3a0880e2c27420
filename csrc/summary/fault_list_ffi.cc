// The handler of pimhbm_fault_list for both platforms, and its CPU launch.
#include "summary/fault_list_ffi.h"

#include <limits>
#include <string>

#include "pimhbm/ffi_util.h"

namespace pimhbm::summary {

using ffi_util::check_buffer;
using ffi_util::invalid;

ffi::Error launch(ffi_util::OnCpu, const FaultListCall& c) {
  fault_list_cpu(c.maps.data(), c.maps.size(), c.out);
  return ffi::Error::Success();
}

namespace {

constexpr const char* kOp = "pimhbm.fault_list";

// maps... -> index, value, totals, scratch
template <typename Platform>
ffi::Error fault_list_handler(Platform on, ffi::RemainingArgs args, ffi::RemainingRets rets) {
  if (rets.size() != kFaultListResults) {
    return invalid(kOp, "expected 4 results (index, value, totals, scratch), got " +
                            std::to_string(rets.size()));
  }
  FaultListCall call;
  int64_t positions = 0;
  for (size_t i = 0; i < args.size(); ++i) {
    auto a = args.get<ffi::AnyBuffer>(i);
    if (!a) return invalid(kOp, "map " + std::to_string(i) + " is not a buffer");
    if (a->element_type() != ffi::DataType::S32) {
      return invalid(kOp, "map " + std::to_string(i) + " must be int32, got " +
                              ffi_util::dtype_name(a->element_type()));
    }
    const int64_t n = static_cast<int64_t>(a->element_count());
    call.maps.push_back(MapView{static_cast<const int32_t*>(a->untyped_data()), n});
    positions += n;
  }
  if (positions > std::numeric_limits<int32_t>::max()) {
    return invalid(kOp, "the maps hold " + std::to_string(positions) +
                            " entries; positions are int32 (at most 2^31 - 1 entries)");
  }
  const char* names[kFaultListResults] = {"index", "value", "totals", "scratch"};
  std::vector<ffi::AnyBuffer> out;
  for (int k = 0; k < kFaultListResults; ++k) {
    auto r = rets.get<ffi::AnyBuffer>(k);
    if (!r) return invalid(kOp, std::string(names[k]) + " is not a buffer");
    out.push_back(**r);
  }
  const int64_t capacity = static_cast<int64_t>(out[0].element_count());
  PIMHBM_FFI_RETURN_IF_ERROR(check_buffer(kOp, "index", out[0], ffi::DataType::S32, capacity));
  PIMHBM_FFI_RETURN_IF_ERROR(check_buffer(kOp, "value", out[1], ffi::DataType::S32, capacity));
  PIMHBM_FFI_RETURN_IF_ERROR(
      check_buffer(kOp, "totals", out[2], ffi::DataType::U32, 2 * kListTotals));
  const int64_t scratch =
      range_count(call.maps.data(), call.maps.size()) * static_cast<int64_t>(sizeof(Range));
  PIMHBM_FFI_RETURN_IF_ERROR(check_buffer(kOp, "scratch", out[3], ffi::DataType::U8, scratch));
  call.out = ListOut{static_cast<int32_t*>(out[0].untyped_data()),
                     static_cast<int32_t*>(out[1].untyped_data()), capacity,
                     static_cast<uint64_t*>(out[2].untyped_data())};
  call.scratch = static_cast<Range*>(out[3].untyped_data());
  return launch(on, call);
}

}  // namespace
}  // namespace pimhbm::summary

#define PIMHBM_FAULT_LIST_BINDING(bind) bind.RemainingArgs().RemainingRets()
PIMHBM_FFI_HANDLERS(PimhbmFaultList, pimhbm::summary::fault_list_handler, PIMHBM_FAULT_LIST_BINDING,
                    PIMHBM_FFI_CAPTURABLE);
