// The handler of pimhbm_inplace_precheck for both platforms, and its CPU launch.
#include "update/precheck_ffi.h"

#include <string>

#include "pimhbm/ffi_util.h"

namespace pimhbm::update {

using ffi_util::check_buffer;
using ffi_util::invalid;

ffi::Error launch(ffi_util::OnCpu, const PrecheckCall& c) {
  precheck_cpu(c.leaves.data(), c.leaves.size(), c.totals);
  return ffi::Error::Success();
}

namespace {

constexpr const char* kOp = "pimhbm.inplace_precheck";

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

// A leaf's operands: p, its digests, the gradient (with gradients only) and chunk_base.
int leaf_operands(bool gradients) { return gradients ? 4 : 3; }

// Leaf i: its buffers checked and its view for the kernels.
ffi::ErrorOr<PrecheckLeaf> leaf_at(const ffi::RemainingArgs& args, const ffi::RemainingRets& rets,
                                   size_t i, int64_t chunk_elems, bool gradients) {
  const char* with[] = {"p", "digests of p", "gradient", "chunk_base"};
  const char* without[] = {"p", "digests of p", "chunk_base"};
  const int count = leaf_operands(gradients);
  std::vector<ffi::AnyBuffer> in;
  for (int k = 0; k < count; ++k) {
    auto a = args.get<ffi::AnyBuffer>(i * count + k);
    if (!a) return invalid(kOp, std::string(gradients ? with[k] : without[k]) + " is not a buffer");
    in.push_back(*a);
  }
  const ffi::DataType pt = in[0].element_type();
  if (pt != ffi::DataType::F32 && pt != ffi::DataType::BF16) {
    return invalid(kOp, "parameters must be float32 or bfloat16, got " + ffi_util::dtype_name(pt));
  }
  const int64_t n = static_cast<int64_t>(in[0].element_count());
  const int64_t chunks = n == 0 ? 0 : (n + chunk_elems - 1) / chunk_elems;
  PIMHBM_FFI_RETURN_IF_ERROR(ffi_util::check_digest_table(kOp, "digests of p", in[1], chunks));
  const ffi::AnyBuffer* g = gradients ? &in[2] : nullptr;
  const ffi::AnyBuffer& base = in[count - 1];
  if (g != nullptr) PIMHBM_FFI_RETURN_IF_ERROR(check_buffer(kOp, "gradient", *g, pt, n));
  PIMHBM_FFI_RETURN_IF_ERROR(check_buffer(kOp, "chunk_base", base, ffi::DataType::S32, 1));
  if (!aligned16(in[0].untyped_data()) || (g != nullptr && !aligned16(g->untyped_data()))) {
    return invalid(kOp, "p and the gradient must start on a 16-byte boundary (XLA's buffers do)");
  }
  int32_t* out[kPrecheckLeafResults];
  const char* results[] = {"damaged map", "nonfinite map"};
  for (int k = 0; k < kPrecheckLeafResults; ++k) {
    auto r = rets.get<ffi::AnyBuffer>(i * kPrecheckLeafResults + k);
    if (!r) return invalid(kOp, std::string(results[k]) + " is not a buffer");
    PIMHBM_FFI_RETURN_IF_ERROR(check_buffer(kOp, results[k], **r, ffi::DataType::S32, chunks));
    out[k] = static_cast<int32_t*>((*r)->untyped_data());
  }
  PrecheckLeaf L;
  L.n = n;
  L.chunk_elems = chunk_elems;
  L.bf16 = pt == ffi::DataType::BF16;
  L.p = in[0].untyped_data();
  L.d_p = static_cast<const uint32_t*>(in[1].untyped_data());
  L.g = g != nullptr ? g->untyped_data() : nullptr;
  L.damaged = out[0];
  L.nonfinite = out[1];
  L.chunk_base = static_cast<const int32_t*>(base.untyped_data());
  return L;
}

// leaves (p, d_p, g, chunk_base)... -> leaves (damaged, nonfinite)..., totals; without
// gradients, leaves (p, d_p, chunk_base)... and every nonfinite map 0.
template <typename Platform>
ffi::Error precheck_handler(Platform on, ffi::RemainingArgs args, ffi::RemainingRets rets,
                            int64_t chunk_elems, bool gradients) {
  PIMHBM_FFI_RETURN_IF_ERROR(ffi_util::check_chunk_size(kOp, "chunk_elems", chunk_elems));
  const size_t per = static_cast<size_t>(leaf_operands(gradients));
  const size_t n = args.size() / per;
  if (args.size() % per != 0 || rets.size() != n * kPrecheckLeafResults + 1) {
    return invalid(kOp, std::string("expected ") +
                            (gradients ? "4 operands (p, its digests, the gradient, chunk_base)"
                                       : "3 operands (p, its digests, chunk_base)") +
                            " and 2 results a leaf, then the totals; got " +
                            std::to_string(args.size()) + " operands and " +
                            std::to_string(rets.size()) + " results");
  }
  auto totals = rets.get<ffi::AnyBuffer>(n * kPrecheckLeafResults);
  if (!totals) return invalid(kOp, "the totals are not a buffer");
  PIMHBM_FFI_RETURN_IF_ERROR(
      check_buffer(kOp, "totals", **totals, ffi::DataType::U32, 2 * kPrecheckTotals));
  PrecheckCall call;
  call.totals = static_cast<uint64_t*>((*totals)->untyped_data());
  for (size_t i = 0; i < n; ++i) {
    ffi::ErrorOr<PrecheckLeaf> leaf = leaf_at(args, rets, i, chunk_elems, gradients);
    if (leaf.has_error()) {
      return n == 1 ? leaf.error()
                    : ffi_util::in_context(kOp, "leaf " + std::to_string(i) + ": ", leaf.error());
    }
    call.leaves.push_back(*leaf);
  }
  return launch(on, call);
}

}  // namespace
}  // namespace pimhbm::update

#define PIMHBM_PRECHECK_BINDING(bind) \
  bind.RemainingArgs().RemainingRets().Attr<int64_t>("chunk_elems").Attr<bool>("gradients")
PIMHBM_FFI_HANDLERS(PimhbmInPlacePrecheck, pimhbm::update::precheck_handler,
                    PIMHBM_PRECHECK_BINDING, PIMHBM_FFI_CAPTURABLE);
