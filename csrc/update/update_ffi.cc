// The handlers of pimhbm_adamw / pimhbm_restore for both platforms, and their CPU launches.
#include "update/update_ffi.h"

#include <string>
#include <vector>

namespace pimhbm::update {

using ffi_util::check_buffer;
using ffi_util::check_digest_table;
using ffi_util::dtype_name;
using ffi_util::invalid;

namespace {
constexpr const char* kAdamW = "pimhbm.adamw";
constexpr const char* kRestore = "pimhbm.restore";

// Checks every buffer of one leaf; on success fills *leaf (write side from the results).
ffi::Error validate_adamw(const AdamWBuffers& b, const AdamWAttrs& a, AdamWLeaf* leaf) {
  if (a.chunk_elems <= 0 || a.chunk_elems % 16 != 0) {
    return invalid(kAdamW, "chunk_elems must be a positive multiple of 16, got " +
                               std::to_string(a.chunk_elems));
  }
  const ffi::DataType pt = b.p.element_type();
  if (pt != ffi::DataType::F32 && pt != ffi::DataType::BF16) {
    return invalid(kAdamW, "parameters must be float32 or bfloat16, got " + dtype_name(pt));
  }
  const int64_t n = static_cast<int64_t>(b.p.element_count());
  const bool has_master = b.master.element_count() != 0 && n != 0;
  if (has_master && pt != ffi::DataType::BF16) {
    return invalid(kAdamW, "master weights are for bfloat16 parameters; these are float32");
  }
  const int64_t nm = has_master ? n : 0;
  const int64_t nchunks = n == 0 ? 0 : (n + a.chunk_elems - 1) / a.chunk_elems;
  const int64_t nchunks_m = has_master ? nchunks : 0;
  struct Check {
    const char* name;
    const ffi::AnyBuffer& buf;
    ffi::DataType dtype;
    int64_t count;
  };
  const bool has_copy = b.p_c->element_count() != 0 && n != 0;
  const int64_t nc = has_copy ? n : 0, ncm = has_copy ? nm : 0;
  const int64_t nchunks_c = has_copy ? nchunks : 0, nchunks_cm = has_copy ? nchunks_m : 0;
  const Check checks[] = {
      {"gradient", b.g, pt, n},
      // Master weights are stored split (adamw_math.h): this is the 16-bit remainder.
      {"master", b.master, ffi::DataType::U16, nm},
      {"mu", b.mu, ffi::DataType::F32, n},
      {"nu", b.nu, ffi::DataType::F32, n},
      {"step scalars", b.step, ffi::DataType::F32, 3},
      {"new parameters", *b.p_out, pt, n},
      {"new master", *b.master_out, ffi::DataType::U16, nm},
      {"new mu", *b.mu_out, ffi::DataType::F32, n},
      {"new nu", *b.nu_out, ffi::DataType::F32, n},
      {"device copy parameters", *b.p_c, pt, nc},
      {"device copy master", *b.master_c, ffi::DataType::U16, ncm},
      {"device copy mu", *b.mu_c, ffi::DataType::F32, nc},
      {"device copy nu", *b.nu_c, ffi::DataType::F32, nc},
      {"fault map", *b.faults, ffi::DataType::S32, nchunks},
      {"gradient non-finite map", *b.grad_nonfinite, ffi::DataType::S32, nchunks},
  };
  for (const Check& c : checks) {
    PIMHBM_FFI_RETURN_IF_ERROR(check_buffer(kAdamW, c.name, c.buf, c.dtype, c.count));
  }
  const struct {
    const char* name;
    const ffi::AnyBuffer& buf;
    int64_t chunks;
  } tables[] = {{"digests of the parameters", b.d_p, nchunks},
                {"digests of the master weights", b.d_master, nchunks_m},
                {"digests of mu", b.d_mu, nchunks},
                {"digests of nu", b.d_nu, nchunks},
                {"new digests of the parameters", *b.dn_p, nchunks},
                {"new digests of the master weights", *b.dn_master, nchunks_m},
                {"new digests of mu", *b.dn_mu, nchunks},
                {"new digests of nu", *b.dn_nu, nchunks},
                {"device copy digests of the parameters", *b.dc_p, nchunks_c},
                {"device copy digests of the master weights", *b.dc_master, nchunks_cm},
                {"device copy digests of mu", *b.dc_mu, nchunks_c},
                {"device copy digests of nu", *b.dc_nu, nchunks_c}};
  for (const auto& t : tables) {
    PIMHBM_FFI_RETURN_IF_ERROR(check_digest_table(kAdamW, t.name, t.buf, t.chunks));
  }

  AdamWLeaf& L = *leaf;
  L.n = n;
  L.chunk_elems = a.chunk_elems;
  L.param_bf16 = pt == ffi::DataType::BF16;
  L.has_master = has_master;
  L.p = b.p.untyped_data();
  L.master = static_cast<const uint16_t*>(b.master.untyped_data());
  L.mu = static_cast<const float*>(b.mu.untyped_data());
  L.nu = static_cast<const float*>(b.nu.untyped_data());
  L.g = b.g.untyped_data();
  L.d_p = static_cast<const uint32_t*>(b.d_p.untyped_data());
  L.d_master = static_cast<const uint32_t*>(b.d_master.untyped_data());
  L.d_mu = static_cast<const uint32_t*>(b.d_mu.untyped_data());
  L.d_nu = static_cast<const uint32_t*>(b.d_nu.untyped_data());
  L.p_out = b.p_out->untyped_data();
  L.master_out = static_cast<uint16_t*>(b.master_out->untyped_data());
  L.mu_out = static_cast<float*>(b.mu_out->untyped_data());
  L.nu_out = static_cast<float*>(b.nu_out->untyped_data());
  L.dn_p = static_cast<uint32_t*>(b.dn_p->untyped_data());
  L.dn_master = static_cast<uint32_t*>(b.dn_master->untyped_data());
  L.dn_mu = static_cast<uint32_t*>(b.dn_mu->untyped_data());
  L.dn_nu = static_cast<uint32_t*>(b.dn_nu->untyped_data());
  L.has_copy = has_copy;
  L.p_copy = b.p_c->untyped_data();
  L.master_copy = static_cast<uint16_t*>(b.master_c->untyped_data());
  L.mu_copy = static_cast<float*>(b.mu_c->untyped_data());
  L.nu_copy = static_cast<float*>(b.nu_c->untyped_data());
  L.dc_p = static_cast<uint32_t*>(b.dc_p->untyped_data());
  L.dc_master = static_cast<uint32_t*>(b.dc_master->untyped_data());
  L.dc_mu = static_cast<uint32_t*>(b.dc_mu->untyped_data());
  L.dc_nu = static_cast<uint32_t*>(b.dc_nu->untyped_data());
  L.faults = static_cast<int32_t*>(b.faults->untyped_data());
  L.grad_nonfinite = static_cast<int32_t*>(b.grad_nonfinite->untyped_data());
  // The write side must not be the read side: the read side is what a skipped step keeps.
  if (n != 0 && (L.p_out == L.p || L.mu_out == L.mu || L.nu_out == L.nu ||
                 (has_master && L.master_out == L.master))) {
    return invalid(kAdamW, "the write side of the state is the read side (the same buffer)");
  }
  return ffi::Error::Success();
}

// Checks the whole call (the step scalars, every leaf, the totals) and lists the leaves (their
// totals pointing at the call's), the results XLA did not alias with their operands, and the
// totals.
ffi::Error validate_adamw_call(const ffi::AnyBuffer& step, const ffi::RemainingArgs& args,
                               const ffi::RemainingRets& rets, const AdamWAttrs& a,
                               std::vector<AdamWLeaf>* leaves,
                               std::vector<ffi_util::Unaliased>* copies, uint64_t** totals_out) {
  if (args.size() % kArgsPerLeaf != 0 ||
      rets.size() != args.size() / kArgsPerLeaf * kRetsPerLeaf + 1) {
    return invalid(kAdamW, "expected " + std::to_string(kArgsPerLeaf) + " arguments and " +
                               std::to_string(kRetsPerLeaf) +
                               " results per leaf after the step scalars, and the totals "
                               "as the last result; got " +
                               std::to_string(args.size()) + " arguments and " +
                               std::to_string(rets.size()) + " results");
  }
  const size_t count = args.size() / kArgsPerLeaf;
  auto totals = rets.get<ffi::AnyBuffer>(rets.size() - 1);
  if (!totals) return invalid(kAdamW, "the totals (last result) are not a buffer");
  PIMHBM_FFI_RETURN_IF_ERROR(check_buffer(kAdamW, "totals", **totals, ffi::DataType::U32, 4));
  *totals_out = static_cast<uint64_t*>((*totals)->untyped_data());
  leaves->assign(count, AdamWLeaf{});
  copies->clear();
  for (size_t i = 0; i < count; ++i) {
    const std::string where = "leaf " + std::to_string(i) + ": ";
    std::vector<ffi::AnyBuffer> in;
    for (size_t k = 0; k < kArgsPerLeaf; ++k) {
      auto b = args.get<ffi::AnyBuffer>(i * kArgsPerLeaf + k);
      if (!b) return invalid(kAdamW, where + "argument " + std::to_string(k) + " is not a buffer");
      in.push_back(*b);
    }
    std::vector<ffi::Result<ffi::AnyBuffer>> out;
    for (size_t k = 0; k < kRetsPerLeaf; ++k) {
      auto r = rets.get<ffi::AnyBuffer>(i * kRetsPerLeaf + k);
      if (!r) return invalid(kAdamW, where + "result " + std::to_string(k) + " is not a buffer");
      out.push_back(*r);
    }
    // Arguments 9..24 are the write side and the device copy as they were (aliased with results
    // 0..15): the handler writes through the results.
    const AdamWBuffers b{in[0],   in[1],   in[2],   in[3],   in[4],   in[5],   in[6],
                         in[7],   in[8],   step,    out[0],  out[1],  out[2],  out[3],
                         out[4],  out[5],  out[6],  out[7],  out[8],  out[9],  out[10],
                         out[11], out[12], out[13], out[14], out[15], out[16], out[17]};
    if (auto err = validate_adamw(b, a, &(*leaves)[i]); err.failure()) {
      return count == 1 ? err : ffi_util::in_context(kAdamW, where, err);
    }
    (*leaves)[i].totals = *totals_out;
    for (size_t k = 0; k < 16; ++k) ffi_util::note_unaliased(kAdamW, copies, in[9 + k], *out[k]);
  }
  return ffi::Error::Success();
}

// Checks (commit, sources..., destinations...) and lists the copies to make, and the results XLA
// did not alias with their destinations.
ffi::Error validate_restore(const ffi::AnyBuffer& commit, const ffi::RemainingArgs& args,
                            const ffi::RemainingRets& rets, std::vector<CopyPair>* pairs,
                            std::vector<ffi_util::Unaliased>* copies) {
  PIMHBM_FFI_RETURN_IF_ERROR(check_buffer(kRestore, "commit flag", commit, ffi::DataType::S32, 1));
  const size_t k = rets.size();
  if (args.size() != 2 * k) {
    return invalid(kRestore, "expected " + std::to_string(k) + " sources and " + std::to_string(k) +
                                 " destinations, got " + std::to_string(args.size()) + " buffers");
  }
  pairs->clear();
  copies->clear();
  for (size_t i = 0; i < k; ++i) {
    auto src = args.get<ffi::AnyBuffer>(i);
    auto dst_in = args.get<ffi::AnyBuffer>(k + i);
    auto dst = rets.get<ffi::AnyBuffer>(i);
    if (!src || !dst_in || !dst)
      return invalid(kRestore, "buffer " + std::to_string(i) + " is not a buffer");
    if (src->size_bytes() != (*dst)->size_bytes() ||
        src->element_type() != (*dst)->element_type()) {
      return invalid(kRestore,
                     "pair " + std::to_string(i) + ": source " + dtype_name(src->element_type()) +
                         ffi_util::shape_str(src->dimensions()) + " does not match destination " +
                         dtype_name((*dst)->element_type()) +
                         ffi_util::shape_str((*dst)->dimensions()));
    }
    pairs->push_back(
        {src->untyped_data(), (*dst)->untyped_data(), static_cast<int64_t>(src->size_bytes())});
    ffi_util::note_unaliased(kRestore, copies, *dst_in, **dst);
  }
  return ffi::Error::Success();
}

}  // namespace

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

template <typename Platform>
ffi::Error adamw_handler(Platform on, ffi::AnyBuffer step, ffi::RemainingArgs args,
                         ffi::RemainingRets rets, int64_t chunk_elems, float b1, float b2,
                         float omb1, float omb2, float eps, float eps_root, float wd) {
  const AdamWAttrs a{chunk_elems, AdamWHyper{b1, b2, omb1, omb2, eps, eps_root, wd}};
  AdamWCall call{{}, a.hyper, static_cast<const float*>(step.untyped_data()), nullptr, {}};
  PIMHBM_FFI_RETURN_IF_ERROR(
      validate_adamw_call(step, args, rets, a, &call.leaves, &call.copies, &call.totals));
  PIMHBM_FFI_RETURN_IF_ERROR(ffi_util::copy_unaliased(on, call.copies));
  return launch(on, call);
}

template <typename Platform>
ffi::Error restore_handler(Platform on, ffi::AnyBuffer commit, ffi::RemainingArgs args,
                           ffi::RemainingRets rets) {
  RestoreCall call{static_cast<const int32_t*>(commit.untyped_data()), {}, {}};
  PIMHBM_FFI_RETURN_IF_ERROR(validate_restore(commit, args, rets, &call.pairs, &call.copies));
  PIMHBM_FFI_RETURN_IF_ERROR(ffi_util::copy_unaliased(on, call.copies));
  return launch(on, call);
}

}  // namespace
}  // namespace pimhbm::update

// The step scalars, then per leaf kArgsPerLeaf arguments -> per leaf kRetsPerLeaf results, then
// the call's totals.
#define PIMHBM_ADAMW_BINDING(bind)                                      \
  bind.Arg<::xla::ffi::AnyBuffer>() /* lr, 1 - b1^t, 1 - b2^t */        \
      .RemainingArgs()              /* kArgsPerLeaf per leaf */         \
      .RemainingRets()              /* kRetsPerLeaf per leaf, totals */ \
      .Attr<int64_t>("chunk_elems")                                     \
      .Attr<float>("b1")                                                \
      .Attr<float>("b2")                                                \
      .Attr<float>("one_minus_b1")                                      \
      .Attr<float>("one_minus_b2")                                      \
      .Attr<float>("eps")                                               \
      .Attr<float>("eps_root")                                          \
      .Attr<float>("weight_decay")
PIMHBM_FFI_HANDLERS(PimhbmAdamW, pimhbm::update::adamw_handler, PIMHBM_ADAMW_BINDING,
                    PIMHBM_FFI_CAPTURABLE);

// commit flag, sources..., destinations... -> destinations (aliased)
#define PIMHBM_RESTORE_BINDING(bind) \
  bind.Arg<::xla::ffi::AnyBuffer>().RemainingArgs().RemainingRets()
PIMHBM_FFI_HANDLERS(PimhbmRestore, pimhbm::update::restore_handler, PIMHBM_RESTORE_BINDING,
                    PIMHBM_FFI_CAPTURABLE);
