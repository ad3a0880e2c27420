// CPU handlers of pimhbm_adamw / pimhbm_restore and the argument checks both platforms share.
#include "update/update_ffi.h"

#include <string>

namespace pimhbm::update {

using ffi_util::check_buffer;
using ffi_util::check_digest_table;
using ffi_util::dtype_name;
using ffi_util::invalid;

namespace {
constexpr const char* kAdamW = "pimhbm.adamw";
constexpr const char* kRestore = "pimhbm.restore";
}  // namespace

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
  const bool has_mirror = b.p_m->element_count() != 0 && n != 0;
  const int64_t nr = has_mirror ? n : 0, nrm = has_mirror ? nm : 0;
  const int64_t nchunks_r = has_mirror ? nchunks : 0, nchunks_rm = has_mirror ? nchunks_m : 0;
  const Check checks[] = {
      {"gradient", b.g, pt, n},
      {"master", b.master, ffi::DataType::F32, nm},
      {"mu", b.mu, ffi::DataType::F32, n},
      {"nu", b.nu, ffi::DataType::F32, n},
      {"step scalars", b.step, ffi::DataType::F32, 3},
      {"new parameters", *b.p_out, pt, n},
      {"new master", *b.master_out, ffi::DataType::F32, nm},
      {"new mu", *b.mu_out, ffi::DataType::F32, n},
      {"new nu", *b.nu_out, ffi::DataType::F32, n},
      {"mirror parameters", *b.p_m, pt, nr},
      {"mirror master", *b.master_m, ffi::DataType::F32, nrm},
      {"mirror mu", *b.mu_m, ffi::DataType::F32, nr},
      {"mirror nu", *b.nu_m, ffi::DataType::F32, nr},
      {"fault map", *b.faults, ffi::DataType::S32, nchunks},
      {"gradient non-finite map", *b.grad_nonfinite, ffi::DataType::S32, nchunks},
  };
  for (const Check& c : checks) {
    if (auto err = check_buffer(kAdamW, c.name, c.buf, c.dtype, c.count); err.failure()) {
      return err;
    }
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
                {"mirror digests of the parameters", *b.dm_p, nchunks_r},
                {"mirror digests of the master weights", *b.dm_master, nchunks_rm},
                {"mirror digests of mu", *b.dm_mu, nchunks_r},
                {"mirror digests of nu", *b.dm_nu, nchunks_r}};
  for (const auto& t : tables) {
    if (auto err = check_digest_table(kAdamW, t.name, t.buf, t.chunks); err.failure()) return err;
  }

  AdamWLeaf& L = *leaf;
  L.n = n;
  L.chunk_elems = a.chunk_elems;
  L.param_bf16 = pt == ffi::DataType::BF16;
  L.has_master = has_master;
  L.p = b.p.untyped_data();
  L.master = static_cast<const float*>(b.master.untyped_data());
  L.mu = static_cast<const float*>(b.mu.untyped_data());
  L.nu = static_cast<const float*>(b.nu.untyped_data());
  L.g = b.g.untyped_data();
  L.d_p = static_cast<const uint32_t*>(b.d_p.untyped_data());
  L.d_master = static_cast<const uint32_t*>(b.d_master.untyped_data());
  L.d_mu = static_cast<const uint32_t*>(b.d_mu.untyped_data());
  L.d_nu = static_cast<const uint32_t*>(b.d_nu.untyped_data());
  L.p_out = b.p_out->untyped_data();
  L.master_out = static_cast<float*>(b.master_out->untyped_data());
  L.mu_out = static_cast<float*>(b.mu_out->untyped_data());
  L.nu_out = static_cast<float*>(b.nu_out->untyped_data());
  L.dn_p = static_cast<uint32_t*>(b.dn_p->untyped_data());
  L.dn_master = static_cast<uint32_t*>(b.dn_master->untyped_data());
  L.dn_mu = static_cast<uint32_t*>(b.dn_mu->untyped_data());
  L.dn_nu = static_cast<uint32_t*>(b.dn_nu->untyped_data());
  L.has_mirror = has_mirror;
  L.p_mirror = b.p_m->untyped_data();
  L.master_mirror = static_cast<float*>(b.master_m->untyped_data());
  L.mu_mirror = static_cast<float*>(b.mu_m->untyped_data());
  L.nu_mirror = static_cast<float*>(b.nu_m->untyped_data());
  L.dm_p = static_cast<uint32_t*>(b.dm_p->untyped_data());
  L.dm_master = static_cast<uint32_t*>(b.dm_master->untyped_data());
  L.dm_mu = static_cast<uint32_t*>(b.dm_mu->untyped_data());
  L.dm_nu = static_cast<uint32_t*>(b.dm_nu->untyped_data());
  L.faults = static_cast<int32_t*>(b.faults->untyped_data());
  L.grad_nonfinite = static_cast<int32_t*>(b.grad_nonfinite->untyped_data());
  // The write side must not be the read side: the read side is what a skipped step keeps.
  if (n != 0 && (L.p_out == L.p || L.mu_out == L.mu || L.nu_out == L.nu ||
                 (has_master && L.master_out == L.master))) {
    return invalid(kAdamW, "the write side of the state is the read side (the same buffer)");
  }
  return ffi::Error::Success();
}

ffi::Error validate_restore(const ffi::AnyBuffer& commit, const ffi::RemainingArgs& args,
                            const ffi::RemainingRets& rets, std::vector<CopyPair>* pairs) {
  if (auto err = check_buffer(kRestore, "commit flag", commit, ffi::DataType::S32, 1);
      err.failure()) {
    return err;
  }
  const size_t k = rets.size();
  if (args.size() != 2 * k) {
    return invalid(kRestore, "expected " + std::to_string(k) + " sources and " +
                                 std::to_string(k) + " destinations, got " +
                                 std::to_string(args.size()) + " buffers");
  }
  pairs->clear();
  for (size_t i = 0; i < k; ++i) {
    auto src = args.get<ffi::AnyBuffer>(i);
    auto dst_in = args.get<ffi::AnyBuffer>(k + i);
    auto dst = rets.get<ffi::AnyBuffer>(i);
    if (!src || !dst_in || !dst) return invalid(kRestore, "buffer " + std::to_string(i) + " is not a buffer");
    if (src->size_bytes() != (*dst)->size_bytes() ||
        src->element_type() != (*dst)->element_type()) {
      return invalid(kRestore, "pair " + std::to_string(i) + ": source " +
                                   dtype_name(src->element_type()) +
                                   ffi_util::shape_str(src->dimensions()) +
                                   " does not match destination " +
                                   dtype_name((*dst)->element_type()) +
                                   ffi_util::shape_str((*dst)->dimensions()));
    }
    pairs->push_back({src->untyped_data(), (*dst)->untyped_data(),
                      static_cast<int64_t>(src->size_bytes())});
  }
  return ffi::Error::Success();
}

namespace {

AdamWAttrs attrs(int64_t chunk_elems, float b1, float b2, float omb1, float omb2, float eps,
                 float eps_root, float wd) {
  return AdamWAttrs{chunk_elems, AdamWHyper{b1, b2, omb1, omb2, eps, eps_root, wd}};
}

ffi::Error adamw_cpu_impl(ffi::AnyBuffer p, ffi::AnyBuffer master, ffi::AnyBuffer mu,
                          ffi::AnyBuffer nu, ffi::AnyBuffer g, ffi::AnyBuffer d_p,
                          ffi::AnyBuffer d_master, ffi::AnyBuffer d_mu, ffi::AnyBuffer d_nu,
                          ffi::AnyBuffer, ffi::AnyBuffer, ffi::AnyBuffer, ffi::AnyBuffer,
                          ffi::AnyBuffer, ffi::AnyBuffer, ffi::AnyBuffer, ffi::AnyBuffer,
                          ffi::AnyBuffer, ffi::AnyBuffer, ffi::AnyBuffer, ffi::AnyBuffer,
                          ffi::AnyBuffer, ffi::AnyBuffer, ffi::AnyBuffer, ffi::AnyBuffer,
                          ffi::AnyBuffer step, ffi::Result<ffi::AnyBuffer> p_out,
                          ffi::Result<ffi::AnyBuffer> master_out,
                          ffi::Result<ffi::AnyBuffer> mu_out, ffi::Result<ffi::AnyBuffer> nu_out,
                          ffi::Result<ffi::AnyBuffer> dn_p, ffi::Result<ffi::AnyBuffer> dn_master,
                          ffi::Result<ffi::AnyBuffer> dn_mu, ffi::Result<ffi::AnyBuffer> dn_nu,
                          ffi::Result<ffi::AnyBuffer> p_m, ffi::Result<ffi::AnyBuffer> master_m,
                          ffi::Result<ffi::AnyBuffer> mu_m, ffi::Result<ffi::AnyBuffer> nu_m,
                          ffi::Result<ffi::AnyBuffer> dm_p, ffi::Result<ffi::AnyBuffer> dm_master,
                          ffi::Result<ffi::AnyBuffer> dm_mu, ffi::Result<ffi::AnyBuffer> dm_nu,
                          ffi::Result<ffi::AnyBuffer> faults,
                          ffi::Result<ffi::AnyBuffer> grad_nonfinite, int64_t chunk_elems,
                          float b1, float b2, float omb1, float omb2, float eps, float eps_root,
                          float wd) {
  AdamWBuffers b{p,     master,   mu,    nu,        g,     d_p,   d_master, d_mu,
                 d_nu,  step,     p_out, master_out, mu_out, nu_out, dn_p,   dn_master,
                 dn_mu, dn_nu,    p_m,   master_m,  mu_m,  nu_m,  dm_p,   dm_master,
                 dm_mu, dm_nu,    faults, grad_nonfinite};
  AdamWLeaf leaf;
  if (auto err = validate_adamw(b, attrs(chunk_elems, b1, b2, omb1, omb2, eps, eps_root, wd),
                                &leaf);
      err.failure()) {
    return err;
  }
  adamw_cpu(leaf, AdamWHyper{b1, b2, omb1, omb2, eps, eps_root, wd},
            static_cast<const float*>(step.untyped_data()));
  return ffi::Error::Success();
}

ffi::Error restore_cpu_impl(ffi::AnyBuffer commit, ffi::RemainingArgs args,
                            ffi::RemainingRets rets) {
  std::vector<CopyPair> pairs;
  if (auto err = validate_restore(commit, args, rets, &pairs); err.failure()) return err;
  restore_cpu(static_cast<const int32_t*>(commit.untyped_data()), pairs);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace pimhbm::update

XLA_FFI_DEFINE_HANDLER_SYMBOL(PimhbmAdamWCpu, pimhbm::update::adamw_cpu_impl,
                              PIMHBM_ADAMW_BINDING(xla::ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(PimhbmRestoreCpu, pimhbm::update::restore_cpu_impl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .RemainingArgs()
                                  .RemainingRets());
