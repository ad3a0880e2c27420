// CPU reference of the guarded AdamW update: verify, update, digest, each in its plainest form.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "scan/scan.h"
#include "update/adamw.h"

namespace pimhbm::update {

int64_t leaf_chunks(const AdamWLeaf& leaf) {
  return leaf.n == 0 ? 0 : (leaf.n + leaf.chunk_elems - 1) / leaf.chunk_elems;
}

namespace {

// Does chunk c (elements [first, first + count), `size` bytes each) match its table entry?
bool matches(const void* base, int64_t first, int64_t count, int size, int64_t c,
             const uint32_t* table) {
  const auto* bytes = static_cast<const uint8_t*>(base) + first * size;
  const uint64_t d = scan::chunk_digest(bytes, count * size, c);
  return d == digest_join(table[2 * c], table[2 * c + 1]);
}

void write_digest(const void* base, int64_t first, int64_t count, int size, int64_t c,
                  uint32_t* table) {
  const auto* bytes = static_cast<const uint8_t*>(base) + first * size;
  const uint64_t d = scan::chunk_digest(bytes, count * size, c);
  table[2 * c] = digest_lo(d);
  table[2 * c + 1] = digest_hi(d);
}

float load_param(const AdamWLeaf& leaf, const void* p, int64_t i) {
  if (leaf.param_bf16) {
    uint16_t b;
    std::memcpy(&b, static_cast<const uint8_t*>(p) + 2 * i, 2);
    return bf16_to_float(b);
  }
  float f;
  std::memcpy(&f, static_cast<const uint8_t*>(p) + 4 * i, 4);
  return f;
}

void store_param(const AdamWLeaf& leaf, void* p, int64_t i, float w) {
  if (leaf.param_bf16) {
    const uint16_t b = float_to_bf16(w);
    std::memcpy(static_cast<uint8_t*>(p) + 2 * i, &b, 2);
  } else {
    std::memcpy(static_cast<uint8_t*>(p) + 4 * i, &w, 4);
  }
}

}  // namespace

void adamw_cpu(const AdamWLeaf& leaf, const AdamWHyper& hyper, const float* step) {
  const AdamWStep s = adamw_step(step);
  const int psize = leaf.param_bf16 ? 2 : 4;
  const int64_t nchunks = leaf_chunks(leaf);
  for (int64_t c = 0; c < nchunks; ++c) {
    const int64_t first = c * leaf.chunk_elems;
    const int64_t count = std::min(leaf.chunk_elems, leaf.n - first);
    int32_t faults = 0;
    faults |= matches(leaf.p, first, count, psize, c, leaf.d_p) ? 0 : kFaultParam;
    if (leaf.has_master) {
      faults |= matches(leaf.master, first, count, 2, c, leaf.d_master) ? 0 : kFaultMaster;
    }
    faults |= matches(leaf.mu, first, count, 4, c, leaf.d_mu) ? 0 : kFaultMu;
    faults |= matches(leaf.nu, first, count, 4, c, leaf.d_nu) ? 0 : kFaultNu;

    // elements whose new values are not all finite: a NaN/Inf gradient value, eps 0 where a
    // moment is 0, an overflow -- one count for all of them. Tested on what was stored (the
    // kernel tests the float before it is stored: inplace_math.h's new_values_finite).
    int32_t bad = 0;
    for (int64_t i = first; i < first + count; ++i) {
      const float g = load_param(leaf, leaf.g, i);
      float m = leaf.mu[i], v = leaf.nu[i], w;
      if (leaf.has_master) {  // the master is stored as p and a remainder
        uint16_t p;
        std::memcpy(&p, static_cast<const uint8_t*>(leaf.p) + 2 * i, 2);
        w = join_master(p, leaf.master[i]);
        adamw_element(g, w, m, v, hyper, s);
        const SplitMaster out = split_master(w);
        std::memcpy(static_cast<uint8_t*>(leaf.p_out) + 2 * i, &out.p, 2);
        leaf.master_out[i] = out.r;
      } else {
        w = load_param(leaf, leaf.p, i);
        adamw_element(g, w, m, v, hyper, s);
        store_param(leaf, leaf.p_out, i, w);
      }
      const bool stored_finite = std::isfinite(load_param(leaf, leaf.p_out, i)) &&
                                 std::isfinite(w) && std::isfinite(m) && std::isfinite(v);
      bad += stored_finite ? 0 : 1;
      leaf.mu_out[i] = m;
      leaf.nu_out[i] = v;
    }
    write_digest(leaf.p_out, first, count, psize, c, leaf.dn_p);
    if (leaf.has_master) write_digest(leaf.master_out, first, count, 2, c, leaf.dn_master);
    write_digest(leaf.mu_out, first, count, 4, c, leaf.dn_mu);
    write_digest(leaf.nu_out, first, count, 4, c, leaf.dn_nu);
    if (leaf.has_copy && faults == 0) {  // the device copy takes only verified chunks
      const auto copy = [&](const void* src, void* dst, int size, const uint32_t* t_src,
                            uint32_t* t_dst) {
        std::memcpy(static_cast<uint8_t*>(dst) + first * size,
                    static_cast<const uint8_t*>(src) + first * size, count * size);
        t_dst[2 * c] = t_src[2 * c];
        t_dst[2 * c + 1] = t_src[2 * c + 1];
      };
      copy(leaf.p_out, leaf.p_copy, psize, leaf.dn_p, leaf.dc_p);
      if (leaf.has_master)
        copy(leaf.master_out, leaf.master_copy, 2, leaf.dn_master, leaf.dc_master);
      copy(leaf.mu_out, leaf.mu_copy, 4, leaf.dn_mu, leaf.dc_mu);
      copy(leaf.nu_out, leaf.nu_copy, 4, leaf.dn_nu, leaf.dc_nu);
    }
    leaf.faults[c] = faults;
    leaf.grad_nonfinite[c] = bad;
    if (leaf.totals != nullptr) {
      leaf.totals[0] += faults != 0 ? 1 : 0;
      leaf.totals[1] += static_cast<uint64_t>(bad);
    }
  }
}

}  // namespace pimhbm::update
