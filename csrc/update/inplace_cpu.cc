// CPU reference of the in-place update: per group, per chunk -- check, update, digest, parity --
// each in its plainest form.
#include <algorithm>
#include <cstring>
#include <vector>

#include "parity/groups.h"
#include "scan/scan.h"
#include "update/inplace.h"
#include "update/inplace_math.h"

namespace pimhbm::update {

namespace {

// One tensor of a leaf as bytes: where it is, its element size, its tables and parity rows.
struct TensorView {
  uint8_t* data;
  int size;
  uint32_t* table;
  uint32_t* rows;
};

std::vector<TensorView> tensors_of(const InPlaceLeaf& L) {
  std::vector<TensorView> t = {
      {static_cast<uint8_t*>(L.p), L.param_bf16 ? 2 : 4, L.d_p, L.q_p},
      {reinterpret_cast<uint8_t*>(L.mu), 4, L.d_mu, L.q_mu},
      {reinterpret_cast<uint8_t*>(L.nu), 4, L.d_nu, L.q_nu}};
  if (L.has_master) t.push_back({reinterpret_cast<uint8_t*>(L.master), 2, L.d_master, L.q_master});
  return t;
}

int32_t fault_bit(size_t tensor) {
  constexpr int32_t kBits[] = {kFaultParam, kFaultMu, kFaultNu, kFaultMaster};
  return kBits[tensor];
}

ElemState load_elem(const InPlaceLeaf& L, int64_t i) {
  ElemState x{0, 0, L.mu[i], L.nu[i]};
  std::memcpy(&x.p, static_cast<const uint8_t*>(L.p) + i * (L.param_bf16 ? 2 : 4),
              L.param_bf16 ? 2 : 4);
  if (L.has_master) x.r = L.master[i];
  return x;
}

void store_elem(const InPlaceLeaf& L, int64_t i, const ElemState& x) {
  std::memcpy(static_cast<uint8_t*>(L.p) + i * (L.param_bf16 ? 2 : 4), &x.p, L.param_bf16 ? 2 : 4);
  if (L.has_master) L.master[i] = static_cast<uint16_t>(x.r);
  L.mu[i] = x.mu;
  L.nu[i] = x.nu;
}

float grad_at(const InPlaceLeaf& L, const void* g, int64_t i) {
  if (L.param_bf16) {
    uint16_t b;
    std::memcpy(&b, static_cast<const uint8_t*>(g) + 2 * i, 2);
    return bf16_to_float(b);
  }
  float f;
  std::memcpy(&f, static_cast<const uint8_t*>(g) + 4 * i, 4);
  return f;
}

struct ChunkResult {
  int32_t faults;
  int32_t kept;
};

// Chunk c of leaf L: checked and, where it verifies, updated (gradient `g`, indexed from the
// chunk's first element), its digests rewritten and its change XORed into `acc` (a byte row per
// tensor). A chunk that does not verify is left as it is.
ChunkResult update_chunk(const InPlaceLeaf& L, int64_t c, const void* g, const AdamWHyper& h,
                         const AdamWStep& s, std::vector<std::vector<uint8_t>>* acc) {
  const int64_t first = c * L.chunk_elems;
  const int64_t count = std::min(L.chunk_elems, L.n - first);
  const std::vector<TensorView> ts = tensors_of(L);
  ChunkResult r{0, 0};
  std::vector<std::vector<uint8_t>> old(ts.size());
  for (size_t t = 0; t < ts.size(); ++t) {
    const uint8_t* at = ts[t].data + first * ts[t].size;
    const int64_t len = count * ts[t].size;
    old[t].assign(at, at + len);
    const uint64_t d = scan::chunk_digest(at, len, static_cast<int64_t>(inplace_key_chunk(L, c)));
    if (d != digest_join(ts[t].table[2 * c], ts[t].table[2 * c + 1])) r.faults |= fault_bit(t);
  }
  if (r.faults != 0) return r;
  for (int64_t i = 0; i < count; ++i) {
    ElemState x = load_elem(L, first + i);
    if (!update_elem(x, grad_at(L, g, i), L.param_bf16, L.has_master, h, s)) ++r.kept;
    store_elem(L, first + i, x);
  }
  for (size_t t = 0; t < ts.size(); ++t) {
    const uint8_t* at = ts[t].data + first * ts[t].size;
    const int64_t len = count * ts[t].size;
    const uint64_t d = scan::chunk_digest(at, len, static_cast<int64_t>(inplace_key_chunk(L, c)));
    ts[t].table[2 * c] = digest_lo(d);
    ts[t].table[2 * c + 1] = digest_hi(d);
    if (acc != nullptr) {
      for (int64_t b = 0; b < len; ++b) (*acc)[t][b] ^= old[t][b] ^ at[b];
    }
  }
  return r;
}

// The parity rows of group `grp` XORed with `acc`.
void fold_parity(const InPlaceLeaf& L, int64_t grp, const std::vector<std::vector<uint8_t>>& acc) {
  const std::vector<TensorView> ts = tensors_of(L);
  for (size_t t = 0; t < ts.size(); ++t) {
    auto* row = reinterpret_cast<uint8_t*>(ts[t].rows) + grp * L.chunk_elems * ts[t].size;
    for (size_t b = 0; b < acc[t].size(); ++b) row[b] ^= acc[t][b];
  }
}

// The chunks of group `grp` (each chunk its own group without parity).
parity::GroupSpan members(const InPlaceLeaf& L, int64_t grp) {
  if (L.group == 0) return {static_cast<uint32_t>(grp), 1, 1};
  return parity::group_span(inplace_chunks(L), L.group, grp);
}

// The parity rows of group `grp` made anew: the XOR of its chunks as they now are (whatever the
// rows held before, damage included, is gone).
void fresh_parity(const InPlaceLeaf& L, int64_t grp) {
  const parity::GroupSpan span = members(L, grp);
  for (const TensorView& t : tensors_of(L)) {
    auto* row = reinterpret_cast<uint8_t*>(t.rows) + grp * L.chunk_elems * t.size;
    std::fill(row, row + L.chunk_elems * t.size, uint8_t{0});
    for (uint32_t m = 0; m < span.count; ++m) {
      const int64_t first = span.chunk(m) * L.chunk_elems;
      const int64_t end = std::min(L.n, first + L.chunk_elems);
      for (int64_t b = 0; b < (end - first) * t.size; ++b) row[b] ^= t.data[first * t.size + b];
    }
  }
}

std::vector<std::vector<uint8_t>> zero_rows(const InPlaceLeaf& L) {
  std::vector<std::vector<uint8_t>> acc;
  for (const TensorView& t : tensors_of(L)) acc.emplace_back(L.chunk_elems * t.size, 0);
  return acc;
}

// A skipped step's reports: the checks' damaged chunks, nothing kept. (An update that runs
// writes every chunk's over them.)
void clear_reports(const InPlaceLeaf& L) {
  const int64_t n = inplace_chunks(L);
  for (int64_t c = 0; c < n; ++c) {
    L.faults[c] = L.checked != nullptr && L.checked[c] != 0 ? kFaultParam : 0;
  }
  std::fill(L.kept, L.kept + n, 0);
}

void record(const InPlaceLeaf& L, int64_t c, const ChunkResult& r, uint64_t* totals) {
  L.faults[c] = r.faults;
  L.kept[c] = r.kept;
  totals[kTotalFaulty] += r.faults != 0 ? 1 : 0;
  totals[kTotalKept] += static_cast<uint64_t>(r.kept);
  totals[kTotalSuspect] += (r.faults & kFaultParam) != 0 ? 1 : 0;
}

// Chunk c's gradient into the next stash row, if there is one.
void stash_chunk(const InPlaceLeaf& L, int64_t c, int32_t faults, const Stash& stash,
                 uint64_t* totals) {
  const int64_t slot = static_cast<int64_t>(totals[kTotalStashed]++);
  if (slot >= stash.capacity) return;
  const int size = L.param_bf16 ? 2 : 4;
  const int64_t first = c * L.chunk_elems;
  const int64_t count = std::min(L.chunk_elems, L.n - first);
  std::memcpy(stash.rows + slot * L.chunk_elems, static_cast<const uint8_t*>(L.g) + first * size,
              static_cast<size_t>(count * size));
  int32_t* row = stash.index + kStashIndexColumns * slot;
  row[0] = L.index;
  row[1] = static_cast<int32_t>(c);
  row[2] = faults;
}

void clear_stash(const Stash& stash, int64_t row_words) {
  std::fill(stash.rows, stash.rows + stash.capacity * row_words, 0u);
  for (int64_t k = 0; k < stash.capacity; ++k) {
    int32_t* row = stash.index + kStashIndexColumns * k;
    row[0] = row[1] = -1;
    row[2] = 0;
  }
}

}  // namespace

void inplace_cpu(const InPlaceLeaf* leaves, size_t count, const AdamWHyper& hyper,
                 const float* step, const int32_t* go, const Stash& stash, uint64_t* totals) {
  std::fill(totals, totals + kInPlaceTotals, 0);
  if (count > 0) clear_stash(stash, leaves[0].chunk_elems);
  const AdamWStep s = adamw_step(step);
  for (size_t i = 0; i < count; ++i) {
    const InPlaceLeaf& L = leaves[i];
    clear_reports(L);
    if (*go == 0) continue;
    for (int64_t grp = 0; grp < inplace_groups(L); ++grp) {
      std::vector<std::vector<uint8_t>> acc = zero_rows(L);
      bool left = false;  // a chunk of the group was not written
      const parity::GroupSpan span = members(L, grp);
      for (uint32_t m = 0; m < span.count; ++m) {
        const int64_t c = span.chunk(m);
        const int size = L.param_bf16 ? 2 : 4;
        const void* g = static_cast<const uint8_t*>(L.g) + c * L.chunk_elems * size;
        const ChunkResult r = update_chunk(L, c, g, hyper, s, L.group > 0 ? &acc : nullptr);
        record(L, c, r, totals);
        if (r.faults != 0) stash_chunk(L, c, r.faults, stash, totals);
        left |= r.faults != 0;
      }
      // A chunk left unwritten is damaged in memory: its correct bytes live only in the old
      // rows, which the changes of the written chunks carry forward. Otherwise the rows are
      // made anew from the group, which also clears any damage they took since the last step.
      if (L.group > 0 && left) fold_parity(L, grp, acc);
      if (L.group > 0 && !left) fresh_parity(L, grp);
    }
  }
}

void redo_cpu(const InPlaceLeaf* leaves, size_t count, const AdamWHyper& hyper, const float* step,
              const StashIn& stash, uint64_t* totals) {
  std::fill(totals, totals + kInPlaceTotals, 0);
  const AdamWStep s = adamw_step(step);
  for (size_t i = 0; i < count; ++i) clear_reports(leaves[i]);
  for (int64_t k = 0; k < stash.entries; ++k) {
    const int32_t leaf = stash.index[kStashIndexColumns * k];
    const int32_t c = stash.index[kStashIndexColumns * k + 1];
    const InPlaceLeaf* L = nullptr;
    for (size_t i = 0; i < count; ++i) L = leaves[i].index == leaf ? &leaves[i] : L;
    if (L == nullptr || c < 0 || c >= inplace_chunks(*L)) continue;  // unused or foreign rows
    std::vector<std::vector<uint8_t>> acc = zero_rows(*L);
    const ChunkResult r = update_chunk(*L, c, stash.rows + k * L->chunk_elems, hyper, s,
                                       L->group > 0 ? &acc : nullptr);
    record(*L, c, r, totals);
    if (r.faults == 0 && L->group > 0) {
      fold_parity(*L, parity::group_of(inplace_chunks(*L), L->group, c), acc);
    }
  }
}

}  // namespace pimhbm::update
