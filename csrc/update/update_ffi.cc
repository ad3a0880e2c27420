// The handlers of pimhbm_adamw / pimhbm_restore for both platforms, and their CPU launches.
// pimhbm_adamw's buffers are checked against the one description of a leaf, adamw_layout.h.
#include "update/update_ffi.h"

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "pimhbm/ffi_util.h"
#include "update/adamw_layout.h"

namespace pimhbm::update {

using ffi_util::check_buffer;
using ffi_util::check_count;
using ffi_util::dtype_name;
using ffi_util::invalid;

ffi::Error launch(ffi_util::OnCpu, const AdamWCall& c) {
  c.totals[0] = c.totals[1] = 0;
  for (const AdamWLeaf& leaf : c.leaves) adamw_cpu(leaf, c.hyper, c.step);
  return ffi::Error::Success();
}

ffi::Error launch(ffi_util::OnCpu, const RestoreCall& c) {
  restore_cpu(c.commit, c.pairs);
  return ffi::Error::Success();
}

namespace {

constexpr const char* kAdamW = "pimhbm.adamw";
constexpr const char* kRestore = "pimhbm.restore";

// The buffers of one leaf by row of kLeafBuffers: the one the update uses (for a row with a
// result, the result: the update writes through it), and for the rows aliased with a result
// the operand XLA passed in (to notice a result XLA did not alias).
struct LeafBuffers {
  std::vector<ffi::AnyBuffer> used;
  std::vector<std::pair<ffi::AnyBuffer, ffi::AnyBuffer>> aliased;  // (operand, result)

  const ffi::AnyBuffer& at(Role role, Tensor tensor, bool table = false) const {
    return used[row_of(role, tensor, table)];
  }
  template <typename T = void>
  T* data(Role role, Tensor tensor, bool table = false) const {
    return static_cast<T*>(at(role, tensor, table).untyped_data());
  }
};

// The buffers of leaf `leaf` of the call.
ffi::ErrorOr<LeafBuffers> leaf_buffers(const ffi::RemainingArgs& args,
                                       const ffi::RemainingRets& rets, size_t leaf) {
  LeafBuffers b;
  for (int row = 0; row < kLeafRows; ++row) {
    const LeafBuffer& r = kLeafBuffers[row];
    std::optional<ffi::AnyBuffer> operand, result;
    if (has_operand(r)) {
      auto a = args.get<ffi::AnyBuffer>(leaf * kLeafOperands + operand_of(row));
      if (!a) return invalid(kAdamW, std::string(r.name) + " is not a buffer");
      operand = *a;
    }
    if (has_result(r)) {
      auto a = rets.get<ffi::AnyBuffer>(leaf * kLeafResults + result_of(row));
      if (!a) return invalid(kAdamW, std::string(r.name) + " is not a buffer");
      result = **a;
    }
    b.used.push_back(result ? *result : *operand);
    if (operand && result) b.aliased.push_back({*operand, *result});
  }
  return b;
}

// What the rows' rules depend on: the leaf's size, its chunks, its parameters' dtype, and
// whether it has master weights and the device copy.
struct LeafShape {
  int64_t n, nchunks;
  ffi::DataType param;
  bool master, copy;
};

ffi::ErrorOr<LeafShape> leaf_shape(const LeafBuffers& b, int64_t chunk_elems) {
  const ffi::AnyBuffer& p = b.at(Role::kRead, Tensor::kP);
  const ffi::DataType pt = p.element_type();
  if (pt != ffi::DataType::F32 && pt != ffi::DataType::BF16) {
    return invalid(kAdamW, "parameters must be float32 or bfloat16, got " + dtype_name(pt));
  }
  const int64_t n = static_cast<int64_t>(p.element_count());
  const bool master = b.at(Role::kRead, Tensor::kMaster).element_count() != 0 && n != 0;
  if (master && pt != ffi::DataType::BF16) {
    return invalid(kAdamW, "master weights are for bfloat16 parameters; these are float32");
  }
  const bool copy = b.at(Role::kCopy, Tensor::kP).element_count() != 0 && n != 0;
  return LeafShape{n, n == 0 ? 0 : (n + chunk_elems - 1) / chunk_elems, pt, master, copy};
}

// Every buffer of the leaf against its row's rules.
ffi::Error check_leaf(const LeafBuffers& b, const LeafShape& s) {
  for (int row = 0; row < kLeafRows; ++row) {
    const LeafBuffer& r = kLeafBuffers[row];
    const bool absent =
        (r.tensor == Tensor::kMaster && !s.master) || (r.role == Role::kCopy && !s.copy);
    const int64_t count = absent ? 0 : r.count == Count::kChunks ? s.nchunks : s.n;
    if (r.dtype == Dtype::kDigests) {
      PIMHBM_FFI_RETURN_IF_ERROR(ffi_util::check_digest_table(kAdamW, r.name, b.used[row], count));
      continue;
    }
    const ffi::DataType want = r.dtype == Dtype::kParam ? s.param
                               : r.dtype == Dtype::kU16 ? ffi::DataType::U16
                               : r.dtype == Dtype::kF32 ? ffi::DataType::F32
                                                        : ffi::DataType::S32;
    PIMHBM_FFI_RETURN_IF_ERROR(check_buffer(kAdamW, r.name, b.used[row], want, count));
  }
  return ffi::Error::Success();
}

// The kernels' view of a checked leaf.
AdamWLeaf leaf_of(const LeafBuffers& b, const LeafShape& s, int64_t chunk_elems) {
  using R = Role;
  using T = Tensor;
  AdamWLeaf L;
  L.n = s.n;
  L.chunk_elems = chunk_elems;
  L.param_bf16 = s.param == ffi::DataType::BF16;
  L.has_master = s.master;
  L.has_copy = s.copy;
  // A side's tensors and digest tables, into the leaf's fields of that side.
  const auto side = [&b](Role r, auto& p, auto& master, auto& mu, auto& nu, auto& d_p,
                         auto& d_master, auto& d_mu, auto& d_nu) {
    p = b.data(r, T::kP);
    master = b.data<uint16_t>(r, T::kMaster);
    mu = b.data<float>(r, T::kMu);
    nu = b.data<float>(r, T::kNu);
    d_p = b.data<uint32_t>(r, T::kP, true);
    d_master = b.data<uint32_t>(r, T::kMaster, true);
    d_mu = b.data<uint32_t>(r, T::kMu, true);
    d_nu = b.data<uint32_t>(r, T::kNu, true);
  };
  side(R::kRead, L.p, L.master, L.mu, L.nu, L.d_p, L.d_master, L.d_mu, L.d_nu);
  side(R::kWrite, L.p_out, L.master_out, L.mu_out, L.nu_out, L.dn_p, L.dn_master, L.dn_mu, L.dn_nu);
  side(R::kCopy, L.p_copy, L.master_copy, L.mu_copy, L.nu_copy, L.dc_p, L.dc_master, L.dc_mu,
       L.dc_nu);
  L.g = b.data(R::kRead, T::kGradient);
  L.faults = b.data<int32_t>(R::kReport, T::kFaults);
  L.grad_nonfinite = b.data<int32_t>(R::kReport, T::kGradNonfinite);
  return L;
}

// Leaf `i` of the call, checked, its results XLA did not alias listed in *copies.
ffi::ErrorOr<AdamWLeaf> checked_leaf(const ffi::RemainingArgs& args, const ffi::RemainingRets& rets,
                                     size_t i, int64_t chunk_elems,
                                     std::vector<ffi_util::Unaliased>* copies) {
  PIMHBM_FFI_ASSIGN_OR_RETURN(const LeafBuffers b, leaf_buffers(args, rets, i));
  PIMHBM_FFI_ASSIGN_OR_RETURN(const LeafShape s, leaf_shape(b, chunk_elems));
  PIMHBM_FFI_RETURN_IF_ERROR(check_leaf(b, s));
  const AdamWLeaf L = leaf_of(b, s, chunk_elems);
  // The write side must not be the read side: the read side is what a skipped step keeps.
  if (s.n != 0 && (L.p_out == L.p || L.mu_out == L.mu || L.nu_out == L.nu ||
                   (s.master && L.master_out == L.master))) {
    return invalid(kAdamW, "the write side of the state is the read side (the same buffer)");
  }
  for (const auto& [operand, result] : b.aliased) {
    ffi_util::note_unaliased(kAdamW, copies, operand, result);
  }
  return L;
}

// The step scalars, then kLeafOperands per leaf -> kLeafResults per leaf, then the totals.
template <typename Platform>
ffi::Error adamw_handler(Platform on, ffi::Buffer<ffi::F32, 1> step, ffi::RemainingArgs args,
                         ffi::RemainingRets rets, int64_t chunk_elems, float b1, float b2,
                         float omb1, float omb2, float eps, float eps_root, float wd) {
  PIMHBM_FFI_RETURN_IF_ERROR(ffi_util::check_chunk_size(kAdamW, "chunk_elems", chunk_elems));
  PIMHBM_FFI_RETURN_IF_ERROR(check_count(kAdamW, "step scalars", step, 3));
  if (args.size() % kLeafOperands != 0 ||
      rets.size() != args.size() / kLeafOperands * kLeafResults + 1) {
    return invalid(kAdamW, "expected " + std::to_string(kLeafOperands) + " arguments and " +
                               std::to_string(kLeafResults) +
                               " results per leaf after the step scalars, and the totals as the "
                               "last result; got " +
                               std::to_string(args.size()) + " arguments and " +
                               std::to_string(rets.size()) + " results");
  }
  auto totals = rets.get<ffi::AnyBuffer>(rets.size() - 1);
  if (!totals) return invalid(kAdamW, "the totals (last result) are not a buffer");
  PIMHBM_FFI_RETURN_IF_ERROR(check_buffer(kAdamW, "totals", **totals, ffi::DataType::U32, 4));
  AdamWCall call{{},
                 AdamWHyper{b1, b2, omb1, omb2, eps, eps_root, wd},
                 step.typed_data(),
                 static_cast<uint64_t*>((*totals)->untyped_data()),
                 {}};
  const size_t count = args.size() / kLeafOperands;
  for (size_t i = 0; i < count; ++i) {
    ffi::ErrorOr<AdamWLeaf> leaf = checked_leaf(args, rets, i, chunk_elems, &call.copies);
    if (leaf.has_error()) {
      if (count == 1) return leaf.error();
      return ffi_util::in_context(kAdamW, "leaf " + std::to_string(i) + ": ", leaf.error());
    }
    call.leaves.push_back(*leaf);
    call.leaves.back().totals = call.totals;
  }
  PIMHBM_FFI_RETURN_IF_ERROR(ffi_util::copy_unaliased(on, call.copies));
  return launch(on, call);
}

// Pair i of pimhbm_restore: the source and the destination (as passed in, and as the result).
ffi::Error restore_pair(const ffi::RemainingArgs& args, const ffi::RemainingRets& rets, size_t i,
                        RestoreCall* call) {
  const size_t k = rets.size();
  auto src = args.get<ffi::AnyBuffer>(i);
  auto dst_in = args.get<ffi::AnyBuffer>(k + i);
  auto dst = rets.get<ffi::AnyBuffer>(i);
  if (!src || !dst_in || !dst) {
    return invalid(kRestore, "buffer " + std::to_string(i) + " is not a buffer");
  }
  if (src->size_bytes() != (*dst)->size_bytes() || src->element_type() != (*dst)->element_type()) {
    return invalid(kRestore,
                   "pair " + std::to_string(i) + ": source " + dtype_name(src->element_type()) +
                       ffi_util::shape_str(src->dimensions()) + " does not match destination " +
                       dtype_name((*dst)->element_type()) +
                       ffi_util::shape_str((*dst)->dimensions()));
  }
  call->pairs.push_back(
      {src->untyped_data(), (*dst)->untyped_data(), static_cast<int64_t>(src->size_bytes())});
  ffi_util::note_unaliased(kRestore, &call->copies, *dst_in, **dst);
  return ffi::Error::Success();
}

// commit flag, sources..., destinations... -> destinations (aliased): the sources copied over
// the destinations unless the step commits.
template <typename Platform>
ffi::Error restore_handler(Platform on, ffi::Buffer<ffi::S32> commit, ffi::RemainingArgs args,
                           ffi::RemainingRets rets) {
  PIMHBM_FFI_RETURN_IF_ERROR(check_count(kRestore, "commit flag", commit, 1));
  const size_t k = rets.size();
  if (args.size() != 2 * k) {
    return invalid(kRestore, "expected " + std::to_string(k) + " sources and " + std::to_string(k) +
                                 " destinations, got " + std::to_string(args.size()) + " buffers");
  }
  RestoreCall call{commit.typed_data(), {}, {}};
  for (size_t i = 0; i < k; ++i) PIMHBM_FFI_RETURN_IF_ERROR(restore_pair(args, rets, i, &call));
  PIMHBM_FFI_RETURN_IF_ERROR(ffi_util::copy_unaliased(on, call.copies));
  return launch(on, call);
}

}  // namespace
}  // namespace pimhbm::update

#define PIMHBM_ADAMW_BINDING(bind)                         \
  bind.Arg<::xla::ffi::Buffer<::xla::ffi::F32, 1>>()       \
      .RemainingArgs() /* kLeafOperands per leaf */        \
      .RemainingRets() /* kLeafResults per leaf, totals */ \
      .Attr<int64_t>("chunk_elems") PIMHBM_ADAMW_HYPER_ATTRS
PIMHBM_FFI_HANDLERS(PimhbmAdamW, pimhbm::update::adamw_handler, PIMHBM_ADAMW_BINDING,
                    PIMHBM_FFI_CAPTURABLE);

#define PIMHBM_RESTORE_BINDING(bind) \
  bind.Arg<::xla::ffi::Buffer<::xla::ffi::S32>>().RemainingArgs().RemainingRets()
PIMHBM_FFI_HANDLERS(PimhbmRestore, pimhbm::update::restore_handler, PIMHBM_RESTORE_BINDING,
                    PIMHBM_FFI_CAPTURABLE);
