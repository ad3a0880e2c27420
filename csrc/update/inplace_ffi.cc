// The handlers of pimhbm_adamw_inplace / pimhbm_adamw_redo for both platforms, and their CPU
// launches.
#include "update/inplace_ffi.h"

#include <cstdint>
#include <string>
#include <vector>

#include "parity/groups.h"
#include "pimhbm/ffi_util.h"

namespace pimhbm::update {

using ffi_util::check_buffer;
using ffi_util::check_digest_table;
using ffi_util::invalid;

ffi::Error launch(ffi_util::OnCpu, const InPlaceCall& c) {
  if (c.is_redo) {
    redo_cpu(c.leaves.data(), c.leaves.size(), c.hyper, c.step, c.redo, c.totals);
  } else {
    inplace_cpu(c.leaves.data(), c.leaves.size(), c.hyper, c.step, c.go, c.stash, c.totals);
  }
  return ffi::Error::Success();
}

namespace {

constexpr const char* kInPlace = "pimhbm.adamw_inplace";
constexpr const char* kRedo = "pimhbm.adamw_redo";

struct Options {
  const char* op;
  int64_t chunk_elems, group;
  bool redo;
};

// The parity rows of a tensor of n elements of `size` bytes: uint32 (groups, chunk bytes / 4),
// or none.
ffi::Error check_rows(const Options& o, const char* name, const ffi::AnyBuffer& rows, int64_t n,
                      int size, bool present) {
  const int64_t chunks = n == 0 ? 0 : (n + o.chunk_elems - 1) / o.chunk_elems;
  if (chunks > parity::kMaxChunks) {
    return invalid(o.op, std::string(name) + " has " + std::to_string(chunks) +
                             " chunks, more than " + std::to_string(parity::kMaxChunks));
  }
  const int64_t groups = present && o.group > 0 ? parity::groups_of_chunks(chunks, o.group) : 0;
  const int64_t words = o.chunk_elems * size / 4;
  auto dims = rows.dimensions();
  const bool ok = rows.element_type() == ffi::DataType::U32 &&
                  (groups == 0 ? rows.element_count() == 0
                               : dims.size() == 2 && dims[0] == groups && dims[1] == words);
  if (ok) return ffi::Error::Success();
  return invalid(o.op, std::string("parity rows of ") + name + " must be uint32 of shape (" +
                           std::to_string(groups) + ", " + std::to_string(words) + "), got " +
                           ffi_util::dtype_name(rows.element_type()) + ffi_util::shape_str(dims));
}

// The kernels move a chunk of each array 16 bytes at a time (XLA's buffers are aligned so).
ffi::Error check_aligned(const Options& o, const std::vector<ffi::AnyBuffer>& in,
                         const std::vector<ffi::AnyBuffer>& out) {
  const auto aligned = [](const ffi::AnyBuffer& b) {
    return b.element_count() == 0 || reinterpret_cast<uintptr_t>(b.untyped_data()) % 16 == 0;
  };
  for (int k = 0; k < kInPlaceAliased; ++k) {  // the state, its digests and parity
    if (aligned(out[k])) continue;
    return invalid(o.op, std::string(kInPlaceResults[k]) + " is not 16-byte aligned");
  }
  if (!aligned(in[12])) return invalid(o.op, "the gradient is not 16-byte aligned");
  return ffi::Error::Success();
}

// Leaf i: its buffers checked and its view for the kernels.
ffi::ErrorOr<InPlaceLeaf> leaf_at(const Options& o, const ffi::RemainingArgs& args,
                                  const ffi::RemainingRets& rets, size_t arg0, size_t i,
                                  std::vector<ffi_util::Unaliased>* copies) {
  std::vector<ffi::AnyBuffer> in, out;
  for (int k = 0; k < kInPlaceLeafOperands; ++k) {
    auto a = args.get<ffi::AnyBuffer>(arg0 + i * kInPlaceLeafOperands + k);
    if (!a) return invalid(o.op, std::string(kInPlaceOperands[k]) + " is not a buffer");
    in.push_back(*a);
  }
  for (int k = 0; k < kInPlaceLeafResults; ++k) {
    auto r = rets.get<ffi::AnyBuffer>(i * kInPlaceLeafResults + k);
    if (!r) return invalid(o.op, std::string(kInPlaceResults[k]) + " is not a buffer");
    out.push_back(**r);
  }
  const ffi::DataType pt = out[0].element_type();
  if (pt != ffi::DataType::F32 && pt != ffi::DataType::BF16) {
    return invalid(o.op, "parameters must be float32 or bfloat16, got " + ffi_util::dtype_name(pt));
  }
  const int64_t n = static_cast<int64_t>(out[0].element_count());
  const int64_t chunks = n == 0 ? 0 : (n + o.chunk_elems - 1) / o.chunk_elems;
  const bool master = out[1].element_count() != 0 && n != 0;
  if (master && pt != ffi::DataType::BF16) {
    return invalid(o.op, "master weights are for bfloat16 parameters; these are float32");
  }
  const int psize = pt == ffi::DataType::BF16 ? 2 : 4;
  PIMHBM_FFI_RETURN_IF_ERROR(
      check_buffer(o.op, "master", out[1], ffi::DataType::U16, master ? n : 0));
  PIMHBM_FFI_RETURN_IF_ERROR(check_buffer(o.op, "mu", out[2], ffi::DataType::F32, n));
  PIMHBM_FFI_RETURN_IF_ERROR(check_buffer(o.op, "nu", out[3], ffi::DataType::F32, n));
  const char* tables[] = {"digests of p", "digests of master", "digests of mu", "digests of nu"};
  for (int k = 0; k < 4; ++k) {
    PIMHBM_FFI_RETURN_IF_ERROR(
        check_digest_table(o.op, tables[k], out[4 + k], k == 1 && !master ? 0 : chunks));
  }
  const int sizes[] = {psize, 2, 4, 4};
  const char* names[] = {"p", "master", "mu", "nu"};
  for (int k = 0; k < 4; ++k) {
    PIMHBM_FFI_RETURN_IF_ERROR(check_rows(o, names[k], out[8 + k], n, sizes[k], k != 1 || master));
  }
  PIMHBM_FFI_RETURN_IF_ERROR(check_buffer(o.op, "gradient", in[12], pt, o.redo ? 0 : n));
  PIMHBM_FFI_RETURN_IF_ERROR(check_buffer(o.op, "chunk_base", in[13], ffi::DataType::S32, 1));
  // Empty where no checks ran before the update (pimhbm.inplace.ParameterChecks.IN_UPDATE).
  const bool unchecked = o.redo || in[14].element_count() == 0;
  PIMHBM_FFI_RETURN_IF_ERROR(
      check_buffer(o.op, "checks' map", in[14], ffi::DataType::S32, unchecked ? 0 : chunks));
  PIMHBM_FFI_RETURN_IF_ERROR(check_buffer(o.op, "fault map", out[12], ffi::DataType::S32, chunks));
  PIMHBM_FFI_RETURN_IF_ERROR(check_buffer(o.op, "kept map", out[13], ffi::DataType::S32, chunks));
  PIMHBM_FFI_RETURN_IF_ERROR(check_aligned(o, in, out));
  for (int k = 0; k < kInPlaceAliased; ++k) ffi_util::note_unaliased(o.op, copies, in[k], out[k]);

  InPlaceLeaf L;
  L.n = n;
  L.chunk_elems = o.chunk_elems;
  L.group = o.group;
  L.index = static_cast<int32_t>(i);
  L.param_bf16 = pt == ffi::DataType::BF16;
  L.has_master = master;
  const auto u32 = [&](int k) { return static_cast<uint32_t*>(out[k].untyped_data()); };
  L.p = out[0].untyped_data();
  L.master = static_cast<uint16_t*>(out[1].untyped_data());
  L.mu = static_cast<float*>(out[2].untyped_data());
  L.nu = static_cast<float*>(out[3].untyped_data());
  L.d_p = u32(4), L.d_master = u32(5), L.d_mu = u32(6), L.d_nu = u32(7);
  L.q_p = u32(8), L.q_master = u32(9), L.q_mu = u32(10), L.q_nu = u32(11);
  L.g = o.redo ? nullptr : in[12].untyped_data();
  L.faults = static_cast<int32_t*>(out[12].untyped_data());
  L.kept = static_cast<int32_t*>(out[13].untyped_data());
  L.chunk_base = static_cast<const int32_t*>(in[13].untyped_data());
  L.checked = unchecked ? nullptr : static_cast<const int32_t*>(in[14].untyped_data());
  return L;
}

// Stash rows and their index: uint32 (rows, chunk_elems), int32 (rows, 2).
ffi::ErrorOr<int64_t> check_stash(const Options& o, const ffi::AnyBuffer& rows,
                                  const ffi::AnyBuffer& index) {
  auto rd = rows.dimensions(), id = index.dimensions();
  if (rows.element_type() != ffi::DataType::U32 || rd.size() != 2 || rd[1] != o.chunk_elems ||
      index.element_type() != ffi::DataType::S32 || id.size() != 2 || id[0] != rd[0] ||
      id[1] != kStashIndexColumns) {
    return invalid(o.op, "the stash must be uint32 (rows, " + std::to_string(o.chunk_elems) +
                             ") and int32 (rows, 3); got " +
                             ffi_util::dtype_name(rows.element_type()) + ffi_util::shape_str(rd) +
                             " and " + ffi_util::dtype_name(index.element_type()) +
                             ffi_util::shape_str(id));
  }
  return static_cast<int64_t>(rd[0]);
}

ffi::Error check_options(const Options& o) {
  PIMHBM_FFI_RETURN_IF_ERROR(ffi_util::check_chunk_size(o.op, "chunk_elems", o.chunk_elems));
  if (o.group < 0 || o.group > parity::kMaxGroup) {
    return invalid(o.op, "group must be 0 (no parity) to " + std::to_string(parity::kMaxGroup) +
                             ", got " + std::to_string(o.group));
  }
  if (!inplace_chunk_ok(o.chunk_elems)) {
    return invalid(o.op, "chunk_elems must be 128, 256 or 512 (a warp holds a chunk), got " +
                             std::to_string(o.chunk_elems));
  }
  return ffi::Error::Success();
}

// The leaves after `arg0` leading operands, with `extra` results after theirs.
ffi::Error add_leaves(const Options& o, const ffi::RemainingArgs& args,
                      const ffi::RemainingRets& rets, size_t arg0, size_t extra,
                      InPlaceCall* call) {
  const size_t n = (args.size() - arg0) / kInPlaceLeafOperands;
  if ((args.size() - arg0) % kInPlaceLeafOperands != 0 ||
      rets.size() != n * kInPlaceLeafResults + extra) {
    return invalid(o.op, "expected " + std::to_string(kInPlaceLeafOperands) + " operands and " +
                             std::to_string(kInPlaceLeafResults) + " results a leaf; got " +
                             std::to_string(args.size() - arg0) + " and " +
                             std::to_string(rets.size() - extra));
  }
  for (size_t i = 0; i < n; ++i) {
    ffi::ErrorOr<InPlaceLeaf> leaf = leaf_at(o, args, rets, arg0, i, &call->copies);
    if (leaf.has_error()) {
      return n == 1 ? leaf.error()
                    : ffi_util::in_context(o.op, "leaf " + std::to_string(i) + ": ", leaf.error());
    }
    call->leaves.push_back(*leaf);
  }
  return ffi::Error::Success();
}

ffi::ErrorOr<uint64_t*> totals_of(const Options& o, const ffi::RemainingRets& rets) {
  if (rets.size() == 0) return invalid(o.op, "the totals (last result) are missing");
  auto t = rets.get<ffi::AnyBuffer>(rets.size() - 1);
  if (!t) return invalid(o.op, "the totals (last result) are not a buffer");
  PIMHBM_FFI_RETURN_IF_ERROR(
      check_buffer(o.op, "totals", **t, ffi::DataType::U32, 2 * kInPlaceTotals));
  return static_cast<uint64_t*>((*t)->untyped_data());
}

AdamWHyper hyper_of(float b1, float b2, float omb1, float omb2, float eps, float eps_root,
                    float wd) {
  return AdamWHyper{b1, b2, omb1, omb2, eps, eps_root, wd};
}

// step, go, leaves... -> leaves' results, stash rows, stash index, totals
template <typename Platform>
ffi::Error inplace_handler(Platform on, ffi::Buffer<ffi::F32, 1> step, ffi::Buffer<ffi::S32> go,
                           ffi::RemainingArgs args, ffi::RemainingRets rets, int64_t chunk_elems,
                           int64_t group, float b1, float b2, float omb1, float omb2, float eps,
                           float eps_root, float wd) {
  const Options o{kInPlace, chunk_elems, group, false};
  PIMHBM_FFI_RETURN_IF_ERROR(check_options(o));
  PIMHBM_FFI_RETURN_IF_ERROR(ffi_util::check_count(o.op, "step scalars", step, 3));
  PIMHBM_FFI_RETURN_IF_ERROR(ffi_util::check_count(o.op, "go", go, 1));
  InPlaceCall call{};
  call.hyper = hyper_of(b1, b2, omb1, omb2, eps, eps_root, wd);
  call.step = step.typed_data();
  call.go = go.typed_data();
  PIMHBM_FFI_RETURN_IF_ERROR(add_leaves(o, args, rets, 0, 3, &call));
  auto rows = rets.get<ffi::AnyBuffer>(rets.size() - 3);
  auto index = rets.get<ffi::AnyBuffer>(rets.size() - 2);
  if (!rows || !index) return invalid(o.op, "the stash results are not buffers");
  PIMHBM_FFI_ASSIGN_OR_RETURN(const int64_t capacity, check_stash(o, **rows, **index));
  call.stash = Stash{static_cast<uint32_t*>((*rows)->untyped_data()),
                     static_cast<int32_t*>((*index)->untyped_data()), capacity};
  PIMHBM_FFI_ASSIGN_OR_RETURN(call.totals, totals_of(o, rets));
  PIMHBM_FFI_RETURN_IF_ERROR(ffi_util::copy_unaliased(on, call.copies));
  return launch(on, call);
}

// step, stash rows, stash index, leaves... -> leaves' results, totals
template <typename Platform>
ffi::Error redo_handler(Platform on, ffi::Buffer<ffi::F32, 1> step, ffi::AnyBuffer rows,
                        ffi::AnyBuffer index, ffi::RemainingArgs args, ffi::RemainingRets rets,
                        int64_t chunk_elems, int64_t group, float b1, float b2, float omb1,
                        float omb2, float eps, float eps_root, float wd) {
  const Options o{kRedo, chunk_elems, group, true};
  PIMHBM_FFI_RETURN_IF_ERROR(check_options(o));
  PIMHBM_FFI_RETURN_IF_ERROR(ffi_util::check_count(o.op, "step scalars", step, 3));
  PIMHBM_FFI_ASSIGN_OR_RETURN(const int64_t entries, check_stash(o, rows, index));
  InPlaceCall call{};
  call.hyper = hyper_of(b1, b2, omb1, omb2, eps, eps_root, wd);
  call.step = step.typed_data();
  call.is_redo = true;
  call.redo = StashIn{static_cast<const uint32_t*>(rows.untyped_data()),
                      static_cast<const int32_t*>(index.untyped_data()), entries};
  PIMHBM_FFI_RETURN_IF_ERROR(add_leaves(o, args, rets, 0, 1, &call));
  PIMHBM_FFI_ASSIGN_OR_RETURN(call.totals, totals_of(o, rets));
  PIMHBM_FFI_RETURN_IF_ERROR(ffi_util::copy_unaliased(on, call.copies));
  return launch(on, call);
}

}  // namespace
}  // namespace pimhbm::update

// step, go, leaves... -> leaves' results, stash rows, stash index, totals
#define PIMHBM_INPLACE_BINDING(bind)                 \
  bind.Arg<::xla::ffi::Buffer<::xla::ffi::F32, 1>>() \
      .Arg<::xla::ffi::Buffer<::xla::ffi::S32>>()    \
      .RemainingArgs()                               \
      .RemainingRets()                               \
      .Attr<int64_t>("chunk_elems")                  \
      .Attr<int64_t>("group") PIMHBM_ADAMW_HYPER_ATTRS
PIMHBM_FFI_HANDLERS(PimhbmAdamWInPlace, pimhbm::update::inplace_handler, PIMHBM_INPLACE_BINDING,
                    PIMHBM_FFI_CAPTURABLE);

// step, stash rows, stash index, leaves... -> leaves' results, totals
#define PIMHBM_REDO_BINDING(bind)                    \
  bind.Arg<::xla::ffi::Buffer<::xla::ffi::F32, 1>>() \
      .Arg<::xla::ffi::AnyBuffer>()                  \
      .Arg<::xla::ffi::AnyBuffer>()                  \
      .RemainingArgs()                               \
      .RemainingRets()                               \
      .Attr<int64_t>("chunk_elems")                  \
      .Attr<int64_t>("group") PIMHBM_ADAMW_HYPER_ATTRS
PIMHBM_FFI_HANDLERS(PimhbmAdamWRedo, pimhbm::update::redo_handler, PIMHBM_REDO_BINDING,
                    PIMHBM_FFI_CAPTURABLE);
