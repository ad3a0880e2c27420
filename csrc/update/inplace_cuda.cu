// The in-place update on the GPU (inplace.h): one warp per parity group, its chunks in order
// (parity/groups.h says which they are).
//
// A lane holds its part of a chunk in registers -- groups gi = lane + 32 j (j < kG) of four
// elements of every tensor, 4 kG elements a lane, chunks of 128 kG elements -- so the warp sums
// the chunk's old digest terms (shuffles, no block barrier) and knows the chunk's verdict before
// its first write: a chunk that does not verify is never written. A verified chunk is updated
// in registers and stored, its new digests summed the same way, and its old and new bytes
// XORed into two sums for the group, which the lane keeps for its own positions in shared
// memory (no other lane touches them: no barrier either). At the group's end each lane writes
// its positions of the parity rows: the new bytes' sum where every chunk committed (the rows are
// not read), else the rows XORed with both sums (the committed chunks' changes). The math is
// inplace_math.h's, bit for bit the CPU reference's.
#include <cuda_runtime.h>

#include <algorithm>
#include <vector>

#include "parity/groups.h"
#include "pimhbm/cuda_check.h"
#include "pimhbm/digest.h"
#include "pimhbm/word_muls.cuh"
#include "update/adamw_kernel.cuh"
#include "update/inplace.h"
#include "update/inplace_math.h"

namespace pimhbm::update {
namespace {

constexpr int kWarps = 4;  // a block: 128 threads
constexpr int kMaxLeaves = 64;

// The groups a launch takes: of leaf i, groups group0[i] .. group0[i] + first_group[i + 1] -
// first_group[i] - 1.
struct Table {
  InPlaceLeaf leaf[kMaxLeaves];
  int64_t first_group[kMaxLeaves + 1];
  int64_t group0[kMaxLeaves];
  int count;
};
static_assert(sizeof(Table) < 32000, "the leaf table must fit the kernel parameters");

__device__ __forceinline__ int lane_id() { return threadIdx.x & 31; }

// A lane's part of a chunk: four elements of every tensor for each of its kG groups. 16-bit
// words stay two to a register as loaded: a bf16 group of four is its 64-bit digest unit as it
// is, with no unpacking and repacking around the digests (bench/NOTES.md, in-place v7).
template <int kG, bool kBF16>
struct Part {
  static constexpr int kPW = kBF16 ? 2 : 4;  // registers a group of the parameter and gradient
  uint32_t p[kG][kPW];  // fp32 bits, or bf16 pairs (element 2i low, 2i + 1 high)
  uint32_t r[kG][2];    // master remainders, in pairs
  uint32_t g[kG][kPW];  // gradient bits (as p)
  float mu[kG][4], nu[kG][4];
  int live[kG];  // elements of the group inside the chunk: 4, fewer at a ragged end, or 0
};

// Element k (0-3) of a group of four held as kPW registers: a 16-bit half or a whole word.
template <int kPW>
__device__ __forceinline__ uint32_t word_of(const uint32_t (&w)[kPW], int k) {
  if constexpr (kPW == 2) return (w[k >> 1] >> (16 * (k & 1))) & 0xFFFFu;
  return w[k];
}

// The same, set (the register's other half kept).
template <int kPW>
__device__ __forceinline__ void set_word(uint32_t (&w)[kPW], int k, uint32_t v) {
  if constexpr (kPW == 2) {
    const int sh = 16 * (k & 1);
    w[k >> 1] = (w[k >> 1] & ~(0xFFFFu << sh)) | (v << sh);
  } else {
    w[k] = v;
  }
}

// Loads group j of the lane (group gi of the chunk, elements e .. e + 3 of the tensors, gradient
// from `g` at chunk offset 4 gi): vector loads when whole, else element by element, zero past
// the end (never a load past it).
template <bool kBF16, bool kMaster, int kG>
__device__ __forceinline__ void load_group(const InPlaceLeaf& L, const void* g, int64_t e,
                                           int64_t ge, int j, Part<kG, kBF16>& x) {
  const int live = x.live[j];
  if (live == 4) {
    if constexpr (kBF16) {
      const uint2 pv = __ldg(reinterpret_cast<const uint2*>(static_cast<const uint16_t*>(L.p) + e));
      const uint2 gv = __ldg(reinterpret_cast<const uint2*>(static_cast<const uint16_t*>(g) + ge));
      x.p[j][0] = pv.x, x.p[j][1] = pv.y;
      x.g[j][0] = gv.x, x.g[j][1] = gv.y;
    } else {
      const uint4 pv = __ldg(reinterpret_cast<const uint4*>(static_cast<const uint32_t*>(L.p) + e));
      const uint4 gv = __ldg(reinterpret_cast<const uint4*>(static_cast<const uint32_t*>(g) + ge));
      x.p[j][0] = pv.x, x.p[j][1] = pv.y, x.p[j][2] = pv.z, x.p[j][3] = pv.w;
      x.g[j][0] = gv.x, x.g[j][1] = gv.y, x.g[j][2] = gv.z, x.g[j][3] = gv.w;
    }
    if constexpr (kMaster) {
      const uint2 rv = __ldg(reinterpret_cast<const uint2*>(L.master + e));
      x.r[j][0] = rv.x, x.r[j][1] = rv.y;
    }
    const float4 mu = __ldg(reinterpret_cast<const float4*>(L.mu + e));
    const float4 nu = __ldg(reinterpret_cast<const float4*>(L.nu + e));
    x.mu[j][0] = mu.x, x.mu[j][1] = mu.y, x.mu[j][2] = mu.z, x.mu[j][3] = mu.w;
    x.nu[j][0] = nu.x, x.nu[j][1] = nu.y, x.nu[j][2] = nu.z, x.nu[j][3] = nu.w;
    return;
  }
#pragma unroll
  for (int w = 0; w < Part<kG, kBF16>::kPW; ++w) x.p[j][w] = x.g[j][w] = 0;
  x.r[j][0] = x.r[j][1] = 0;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    x.mu[j][k] = x.nu[j][k] = 0.0f;
    if (k >= live) continue;
    if constexpr (kBF16) {
      set_word<2>(x.p[j], k, static_cast<const uint16_t*>(L.p)[e + k]);
      set_word<2>(x.g[j], k, static_cast<const uint16_t*>(g)[ge + k]);
    } else {
      x.p[j][k] = static_cast<const uint32_t*>(L.p)[e + k];
      x.g[j][k] = static_cast<const uint32_t*>(g)[ge + k];
    }
    if constexpr (kMaster) set_word<2>(x.r[j], k, L.master[e + k]);
    x.mu[j][k] = L.mu[e + k];
    x.nu[j][k] = L.nu[e + k];
  }
}

template <bool kBF16, bool kMaster, int kG>
__device__ __forceinline__ void store_group(const InPlaceLeaf& L, int64_t e, int j,
                                            const Part<kG, kBF16>& x) {
  const int live = x.live[j];
  if (live == 4) {
    if constexpr (kBF16) {
      *reinterpret_cast<uint2*>(static_cast<uint16_t*>(L.p) + e) = make_uint2(x.p[j][0], x.p[j][1]);
    } else {
      *reinterpret_cast<uint4*>(static_cast<uint32_t*>(L.p) + e) =
          make_uint4(x.p[j][0], x.p[j][1], x.p[j][2], x.p[j][3]);
    }
    if constexpr (kMaster) {
      *reinterpret_cast<uint2*>(L.master + e) = make_uint2(x.r[j][0], x.r[j][1]);
    }
    *reinterpret_cast<float4*>(L.mu + e) =
        make_float4(x.mu[j][0], x.mu[j][1], x.mu[j][2], x.mu[j][3]);
    *reinterpret_cast<float4*>(L.nu + e) =
        make_float4(x.nu[j][0], x.nu[j][1], x.nu[j][2], x.nu[j][3]);
    return;
  }
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    if (k >= live) continue;
    if constexpr (kBF16) {
      static_cast<uint16_t*>(L.p)[e + k] = static_cast<uint16_t>(word_of<2>(x.p[j], k));
    } else {
      static_cast<uint32_t*>(L.p)[e + k] = x.p[j][k];
    }
    if constexpr (kMaster) L.master[e + k] = static_cast<uint16_t>(word_of<2>(x.r[j], k));
    L.mu[e + k] = x.mu[j][k];
    L.nu[e + k] = x.nu[j][k];
  }
}

// The lane's digest terms of its part, one sum per tensor (missing elements are zero: no
// terms, as the digest's padding; no master weights: that sum stays zero).
struct Terms {
  uint64_t p = 0, r = 0, mu = 0, nu = 0;
};

// The digest's word multipliers of a chunk of 128 kG elements (digest.h), in shared memory:
// muls[v] for words 4 v .. 4 v + 3. A lane's group gi is its fp32 tensors' words 4 gi .. 4 gi + 3
// (muls[gi]) and its 16-bit tensors' words 2 gi and 2 gi + 1 (the pair at word 2 gi).
template <bool kBF16, bool kMaster, int kG>
__device__ __forceinline__ Terms lane_terms(const Part<kG, kBF16>& x, const uint4* muls) {
  Terms t;
#pragma unroll
  for (int j = 0; j < kG; ++j) {
    const int gi = lane_id() + 32 * j;
    const uint4 m32 = muls[gi];
    const uint2 m16 = reinterpret_cast<const uint2*>(muls)[gi];
    const auto words = [](const float(&f)[4]) {
      return make_uint4(__float_as_uint(f[0]), __float_as_uint(f[1]), __float_as_uint(f[2]),
                        __float_as_uint(f[3]));
    };
    if constexpr (kBF16) {
      t.p += pair_terms(x.p[j][0], x.p[j][1], m16.x, m16.y);
    } else {
      t.p += vector_terms(make_uint4(x.p[j][0], x.p[j][1], x.p[j][2], x.p[j][3]), m32);
    }
    if constexpr (kMaster) t.r += pair_terms(x.r[j][0], x.r[j][1], m16.x, m16.y);
    t.mu += vector_terms(words(x.mu[j]), m32);
    t.nu += vector_terms(words(x.nu[j]), m32);
  }
  return t;
}

// The warp's four sums, transposed: lanes 8 v .. 8 v + 7 end with the whole sum of tensor v (0 the
// parameter, 1 the master remainder, 2 mu, 3 nu). Each step halves what a lane still carries, so
// the four take 6 64-bit shuffles where four full reductions take 20.
__device__ __forceinline__ uint64_t transposed_sum(const Terms& t) {
  const bool upper16 = lane_id() & 16, upper8 = lane_id() & 8;
  uint64_t a = upper16 ? t.mu : t.p;  // kept: tensors 2 upper16 + {0, 1}
  uint64_t b = upper16 ? t.nu : t.r;
  a += __shfl_xor_sync(0xFFFFFFFFu, upper16 ? t.p : t.mu, 16);
  b += __shfl_xor_sync(0xFFFFFFFFu, upper16 ? t.r : t.nu, 16);
  uint64_t v = upper8 ? b : a;  // kept: tensor lane >> 3
  v += __shfl_xor_sync(0xFFFFFFFFu, upper8 ? a : b, 8);
#pragma unroll
  for (int off = 4; off > 0; off >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, off);
  return v;
}

// The tensor whose sum the lane holds after transposed_sum: its digest table (null: the leaf
// has none -- no master weights), its length in the chunk, its fault bit.
struct LaneTensor {
  uint32_t* table;
  uint64_t bytes;
  int32_t fault;
};

template <bool kBF16, bool kMaster>
__device__ __forceinline__ LaneTensor lane_tensor(const InPlaceLeaf& L, int64_t count) {
  const uint64_t n = static_cast<uint64_t>(count);
  const int v = lane_id() >> 3;  // selects, not a switch: the lanes of a warp must not diverge
  uint32_t* const low = v == 0 ? L.d_p : (kMaster ? L.d_master : nullptr);
  uint32_t* const high = v == 2 ? L.d_mu : L.d_nu;
  const uint64_t low_bytes = v == 0 ? n * (kBF16 ? 2 : 4) : n * 2;
  return {v < 2 ? low : high, v < 2 ? low_bytes : n * 4,
          v == 0   ? kFaultParam
          : v == 1 ? kFaultMaster
          : v == 2 ? kFaultMu
                   : kFaultNu};
}

// The digest chunk c must have, as its table holds it (the lane's tensor; 0 where it has none).
// Loaded as the chunk's data is, not after the sums: a load behind the reduction would put a
// whole memory latency on every chunk's path.
__device__ __forceinline__ uint64_t expected_digest(const LaneTensor& t, int64_t c) {
  if (t.table == nullptr) return 0;
  const uint2 d = *reinterpret_cast<const uint2*>(t.table + 2 * c);
  return digest_join(d.x, d.y);
}

// Which tensors of chunk c fail their digests: one finalisation a lane and a vote, so every
// lane gets the same answer from one instruction (and the compiler sees it uniform).
// `key_chunk`: c's index in the whole tensor (inplace_key_chunk).
__device__ __forceinline__ int32_t faults_of(const LaneTensor& t, uint64_t key_chunk,
                                             uint64_t expected, uint64_t sum) {
  const bool bad = t.table != nullptr && finalize(sum, t.bytes, key_chunk) != expected;
  const uint32_t votes = __ballot_sync(0xFFFFFFFFu, bad);
  return (votes & 1u ? kFaultParam : 0) | (votes & (1u << 8) ? kFaultMaster : 0) |
         (votes & (1u << 16) ? kFaultMu : 0) | (votes & (1u << 24) ? kFaultNu : 0);
}

__device__ __forceinline__ void write_table(const LaneTensor& t, int64_t c, uint64_t key_chunk,
                                            uint64_t sum) {
  if ((lane_id() & 7) != 0 || t.table == nullptr) return;
  kernel::table_write(t.table, c, finalize(sum, t.bytes, key_chunk));
}

// The warp's parity sums for a group, each lane its own groups of four: the XOR of the committed
// chunks' bytes before and after the update. Slot 1 and 2 the moments' words; slot 0 the
// parameter's four words (fp32), or with bf16 its two pair registers and then the master
// remainders' two (the words as loaded and stored).
template <int kG>
struct Acc {
  uint4 (*before)[32 * kG];  // [3][32 kG]
  uint4 (*after)[32 * kG];
};

// Group j of the lane's part as parity slot w's words (acc's layout).
template <int kG, bool kBF16, bool kMaster>
__device__ __forceinline__ uint4 slot_words(const Part<kG, kBF16>& x, int j, int w) {
  const auto bits = [](const float(&f)[4]) {
    return make_uint4(__float_as_uint(f[0]), __float_as_uint(f[1]), __float_as_uint(f[2]),
                      __float_as_uint(f[3]));
  };
  if (w == 1) return bits(x.mu[j]);
  if (w == 2) return bits(x.nu[j]);
  if constexpr (kBF16) {
    return make_uint4(x.p[j][0], x.p[j][1], kMaster ? x.r[j][0] : 0u, kMaster ? x.r[j][1] : 0u);
  }
  return make_uint4(x.p[j][0], x.p[j][1], x.p[j][2], x.p[j][3]);
}

// Group j of the lane's part XORed into one of acc's sums.
template <int kG, bool kBF16, bool kMaster>
__device__ __forceinline__ void xor_into(uint4 (*sum)[32 * kG], const Part<kG, kBF16>& x, int j) {
  const int gi = lane_id() + 32 * j;
#pragma unroll
  for (int w = 0; w < 3; ++w) {
    const uint4 v = slot_words<kG, kBF16, kMaster>(x, j, w);
    uint4& a = sum[w][gi];
    a.x ^= v.x, a.y ^= v.y, a.z ^= v.z, a.w ^= v.w;
  }
}

// Whether an element's new values may be written: the parameter's test, both moments finite,
// the element inside the chunk. Bitwise, not short-circuit: the compares chain into one
// predicate, with no branch.
__device__ __forceinline__ bool writable(bool param_ok, float m, float v, bool live) {
  return param_ok & finite_f32(m) & finite_f32(v) & live;
}

// Group j of the lane, bf16 with master weights, updated in place: each element's master word is
// one byte permutation of the pair registers (p << 16 | r, plus 0x8000: split_master's form), and
// the new words permute back into the pairs. The same values as update_elem. An element keeps
// its old values where a new one would not be finite, or past a ragged end; the warp takes those
// selects only when one of its lanes has such an element (a vote), which no element of a
// training step with valid hyperparameters does. Returns the elements kept.
template <int kG, bool kEpsRoot>
__device__ __forceinline__ uint32_t update_master_group(Part<kG, true>& x, int j,
                                                        const AdamWHyper& hy, const AdamWStep& s) {
  uint32_t old[4];
  float w[4], m[4], v[4];
  // split_finite covers the new master too, and split_master's NaN case.
  const auto ok = [&x, j](float w, float m, float v, int k) {
    return writable(split_finite(w), m, v, k < x.live[j]);
  };
  bool all_ok = true;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const uint32_t pair = x.g[j][k >> 1];
    const float g = __uint_as_float(k & 1 ? pair & 0xFFFF0000u : pair << 16);
    old[k] = __byte_perm(x.r[j][k >> 1], x.p[j][k >> 1], k & 1 ? 0x7632 : 0x5410);
    w[k] = __uint_as_float(old[k] - 0x8000u), m[k] = x.mu[j][k], v[k] = x.nu[j][k];
    adamw_element<kEpsRoot>(g, w[k], m[k], v[k], hy, s);
    all_ok &= ok(w[k], m[k], v[k], k);
  }
  uint32_t word[4], kept = 0;
#pragma unroll
  for (int k = 0; k < 4; ++k) word[k] = __float_as_uint(w[k]) + 0x8000u;
  if (__any_sync(0xFFFFFFFFu, !all_ok)) {  // the compares again: no per-element flags held
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const bool keeps = !ok(w[k], m[k], v[k], k);
      kept += keeps && k < x.live[j] ? 1u : 0u;
      word[k] = keeps ? old[k] : word[k];
      m[k] = keeps ? x.mu[j][k] : m[k];
      v[k] = keeps ? x.nu[j][k] : v[k];
    }
  }
#pragma unroll
  for (int k = 0; k < 4; ++k) x.mu[j][k] = m[k], x.nu[j][k] = v[k];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    x.p[j][h] = __byte_perm(word[2 * h], word[2 * h + 1], 0x7632);
    x.r[j][h] = __byte_perm(word[2 * h], word[2 * h + 1], 0x5410);
  }
  return kept;
}

// Group j of the lane without master weights (fp32 or bf16 parameters), as update_master_group:
// the same values as update_elem, the kept elements' selects behind a vote. A new bf16
// parameter rounds to nearest even; the largest finite one, 0x7F7F, is odd, so from 0x7F7F8000
// on the rounding reaches the infinity and split_finite is its test too. Returns the elements
// kept.
template <int kG, bool kBF16, bool kEpsRoot>
__device__ __forceinline__ uint32_t update_plain_group(Part<kG, kBF16>& x, int j,
                                                       const AdamWHyper& hy, const AdamWStep& s) {
  constexpr int kPW = Part<kG, kBF16>::kPW;
  float w[4], m[4], v[4];
  const auto ok = [&x, j](float w, float m, float v, int k) {
    return writable(kBF16 ? split_finite(w) : finite_f32(w), m, v, k < x.live[j]);
  };
  bool all_ok = true;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    w[k] = kernel::param_value(word_of<kPW>(x.p[j], k), kBF16), m[k] = x.mu[j][k],
    v[k] = x.nu[j][k];
    adamw_element<kEpsRoot>(kernel::param_value(word_of<kPW>(x.g[j], k), kBF16), w[k], m[k], v[k],
                            hy, s);
    all_ok &= ok(w[k], m[k], v[k], k);
  }
  uint32_t word[4], kept = 0;
#pragma unroll
  for (int k = 0; k < 4; ++k) {  // float_to_bf16 without its NaN case: a NaN is never written
    const uint32_t bits = __float_as_uint(w[k]);
    word[k] = kBF16 ? bf16_round_bits(bits) : bits;
  }
  if (__any_sync(0xFFFFFFFFu, !all_ok)) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const bool keeps = !ok(w[k], m[k], v[k], k);
      kept += keeps && k < x.live[j] ? 1u : 0u;
      word[k] = keeps ? word_of<kPW>(x.p[j], k) : word[k];
      m[k] = keeps ? x.mu[j][k] : m[k];
      v[k] = keeps ? x.nu[j][k] : v[k];
    }
  }
#pragma unroll
  for (int k = 0; k < 4; ++k) x.mu[j][k] = m[k], x.nu[j][k] = v[k];
  if constexpr (kBF16) {
    x.p[j][0] = __byte_perm(word[0], word[1], 0x5410);
    x.p[j][1] = __byte_perm(word[2], word[3], 0x5410);
  } else {
#pragma unroll
    for (int k = 0; k < 4; ++k) x.p[j][k] = word[k];
  }
  return kept;
}

// Group j of the lane updated in place (x). Returns the elements kept.
template <bool kBF16, bool kMaster, int kG, bool kEpsRoot>
__device__ __forceinline__ uint32_t update_group(Part<kG, kBF16>& x, int j, const AdamWHyper& h,
                                                 const AdamWStep& s) {
  if constexpr (kBF16 && kMaster) return update_master_group<kG, kEpsRoot>(x, j, h, s);
  return update_plain_group<kG, kBF16, kEpsRoot>(x, j, h, s);
}

struct ChunkVerdict {
  int32_t faults;
  uint32_t kept;
};

// Chunk c: loaded, checked, and where it verifies updated, stored, its tables rewritten and its
// old and new bytes XORed into acc. Warp-uniform result. `x` keeps the chunk's gradient for the
// stash. kWhole: every element of the chunk is there (the compiler drops the ragged paths).
// kEpsRoot: as adamw_element's.
template <bool kBF16, bool kMaster, bool kParity, int kG, bool kWhole, bool kEpsRoot>
__device__ ChunkVerdict warp_chunk(const InPlaceLeaf& L, int64_t c, const void* g,
                                   const AdamWHyper& h, const AdamWStep& s, Acc<kG> acc,
                                   const uint4* muls, Part<kG, kBF16>& x) {
  const int64_t first = c * L.chunk_elems;
  const int64_t count = min(L.chunk_elems, L.n - first);
  const uint64_t key_chunk = inplace_key_chunk(L, c);
  const LaneTensor tensor = lane_tensor<kBF16, kMaster>(L, count);
  const uint64_t expected = expected_digest(tensor, c);
#pragma unroll
  for (int j = 0; j < kG; ++j) {
    const int64_t e = 4 * (lane_id() + 32 * j);
    const int64_t left = count - e;
    x.live[j] = kWhole || left >= 4 ? 4 : (left > 0 ? static_cast<int>(left) : 0);
    load_group<kBF16, kMaster, kG>(L, g, first + e, e, j, x);
  }
  const int32_t faults = faults_of(tensor, key_chunk, expected,
                                   transposed_sum(lane_terms<kBF16, kMaster, kG>(x, muls)));
  if (faults != 0) return {faults, 0};
  uint32_t kept = 0;
#pragma unroll
  for (int j = 0; j < kG; ++j) {
    if constexpr (kParity) xor_into<kG, kBF16, kMaster>(acc.before, x, j);
    kept += update_group<kBF16, kMaster, kG, kEpsRoot>(x, j, h, s);
    store_group<kBF16, kMaster, kG>(L, first + 4 * (lane_id() + 32 * j), j, x);
    if constexpr (kParity) xor_into<kG, kBF16, kMaster>(acc.after, x, j);
  }
  write_table(tensor, c, key_chunk, transposed_sum(lane_terms<kBF16, kMaster, kG>(x, muls)));
  return {0, __reduce_add_sync(0xFFFFFFFFu, kept)};
}

// The parity sums of a block's warps live in dynamic shared memory: with chunks of 512 the two
// sums of four warps (48 KiB) and the word multipliers pass the 48 KiB a block may hold
// statically.
template <bool kParity, int kG>
constexpr int acc_bytes() {
  return kParity ? kWarps * 2 * 3 * 32 * kG * static_cast<int>(sizeof(uint4)) : 0;
}

template <bool kParity, int kG>
__device__ __forceinline__ Acc<kG> warp_acc() {
  extern __shared__ uint4 acc_memory[];
  using Row = uint4[32 * kG];
  Row* const rows = reinterpret_cast<Row*>(acc_memory) + (kParity ? 6 * (threadIdx.x >> 5) : 0);
  return {rows, rows + 3};
}

template <int kG>
__device__ __forceinline__ void zero_acc(Acc<kG> acc) {
#pragma unroll
  for (int w = 0; w < 3; ++w) {
#pragma unroll
    for (int j = 0; j < kG; ++j) {
      acc.before[w][lane_id() + 32 * j] = make_uint4(0, 0, 0, 0);
      acc.after[w][lane_id() + 32 * j] = make_uint4(0, 0, 0, 0);
    }
  }
}

__device__ __forceinline__ uint4 xor4(uint4 a, uint4 b) {
  return make_uint4(a.x ^ b.x, a.y ^ b.y, a.z ^ b.z, a.w ^ b.w);
}

// The group's parity rows written, each lane its own positions: with `fold`, the rows XORed with
// the committed chunks' changes (before ^ after); else the new chunks' sum as it is (the rows are
// not read).
template <bool kBF16, bool kMaster, int kG>
__device__ __forceinline__ void write_parity(const InPlaceLeaf& L, int64_t grp, Acc<kG> acc,
                                             bool fold) {
  constexpr int64_t ce = 128 * kG;
#pragma unroll
  for (int j = 0; j < kG; ++j) {
    const int gi = lane_id() + 32 * j;
    uint4 v[3];
#pragma unroll
    for (int w = 0; w < 3; ++w) {
      v[w] = fold ? xor4(acc.before[w][gi], acc.after[w][gi]) : acc.after[w][gi];
    }
    if constexpr (kBF16) {
      uint2* qp = reinterpret_cast<uint2*>(L.q_p + grp * (ce / 2)) + gi;
      const uint2 o = fold ? *qp : make_uint2(0, 0);
      *qp = make_uint2(o.x ^ v[0].x, o.y ^ v[0].y);
      if constexpr (kMaster) {
        uint2* qr = reinterpret_cast<uint2*>(L.q_master + grp * (ce / 2)) + gi;
        const uint2 r = fold ? *qr : make_uint2(0, 0);
        *qr = make_uint2(r.x ^ v[0].z, r.y ^ v[0].w);
      }
    } else {
      uint4* qp = reinterpret_cast<uint4*>(L.q_p + grp * ce) + gi;
      *qp = xor4(fold ? *qp : make_uint4(0, 0, 0, 0), v[0]);
    }
    uint4* qs[2] = {reinterpret_cast<uint4*>(L.q_mu + grp * ce) + gi,
                    reinterpret_cast<uint4*>(L.q_nu + grp * ce) + gi};
#pragma unroll
    for (int w = 1; w < 3; ++w) *qs[w - 1] = xor4(fold ? *qs[w - 1] : make_uint4(0, 0, 0, 0), v[w]);
  }
}

__device__ __forceinline__ void record(const InPlaceLeaf& L, int64_t c, const ChunkVerdict& v,
                                       uint64_t* totals) {
  if (lane_id() != 0) return;
  L.faults[c] = v.faults;
  L.kept[c] = static_cast<int32_t>(v.kept);
  auto* t = reinterpret_cast<unsigned long long*>(totals);
  if (v.faults != 0) {
    atomicAdd(&t[kTotalFaulty], 1ull);
    if ((v.faults & kFaultParam) != 0) atomicAdd(&t[kTotalSuspect], 1ull);
  }
  if (v.kept != 0) atomicAdd(&t[kTotalKept], static_cast<unsigned long long>(v.kept));
}

// Chunk c's gradient (held by the lanes) into a stash row, if one is left.
template <bool kBF16, int kG>
__device__ void stash_chunk(const InPlaceLeaf& L, int64_t c, int32_t faults,
                            const Part<kG, kBF16>& x, const Stash& stash, uint64_t* totals) {
  unsigned long long slot = 0;
  auto* t = reinterpret_cast<unsigned long long*>(totals);
  if (lane_id() == 0) slot = atomicAdd(&t[kTotalStashed], 1ull);
  slot = __shfl_sync(0xFFFFFFFFu, slot, 0);
  if (slot >= static_cast<unsigned long long>(stash.capacity)) return;
  uint32_t* row = stash.rows + static_cast<int64_t>(slot) * L.chunk_elems;
#pragma unroll
  for (int j = 0; j < kG; ++j) {
    const int64_t e = 4 * (lane_id() + 32 * j);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      if (k >= x.live[j]) continue;
      if constexpr (kBF16) {
        reinterpret_cast<uint16_t*>(row)[e + k] = static_cast<uint16_t>(word_of<2>(x.g[j], k));
      } else {
        row[e + k] = x.g[j][k];
      }
    }
  }
  if (lane_id() == 0) {
    int32_t* index = stash.index + kStashIndexColumns * static_cast<int64_t>(slot);
    index[0] = L.index;
    index[1] = static_cast<int32_t>(c);
    index[2] = faults;
  }
}

// The chunks of group `grp` (each chunk its own group without parity).
template <bool kParity>
__device__ __forceinline__ parity::GroupSpan members(const InPlaceLeaf& L, int64_t grp) {
  if constexpr (kParity) return parity::group_span(inplace_chunks(L), L.group, grp);
  return {static_cast<uint32_t>(grp), 1, 1};
}

__device__ __forceinline__ int leaf_of(const Table& T, int64_t gg) {
  int i = 0;
  while (i + 1 < T.count && gg >= T.first_group[i + 1]) ++i;
  return i;
}

// Blocks an SM the main launch asks for. A warp holds one chunk and has no load in flight while
// it computes it, so more warps hide more of the loads' latency: with parity, at chunks of up to
// 256 elements, 6 blocks (80 registers, a few bytes spilled outside the chunk loop) ran 11 %
// faster in the training step than 4 (128 registers); without parity 6 ran slower
// (bench/NOTES.md, "The digest as word products", run 119).
template <bool kParity, int kG, bool kWhole>
constexpr int min_blocks() {
  return kWhole && kParity && kG <= 2 ? 6 : 4;
}

// kWhole: the table's groups hold whole chunks only (the main launch); else each is a tensor's
// last group, whose last chunk is short (the tail launch).
template <bool kBF16, bool kMaster, bool kParity, int kG, bool kWhole, bool kEpsRoot>
__global__ void __launch_bounds__(32 * kWarps, min_blocks<kParity, kG, kWhole>())
    inplace_kernel(const __grid_constant__ Table T, const AdamWHyper h, const float* step,
                   const int32_t* go, Stash stash, uint64_t* totals) {
  __shared__ uint4 muls[32 * kG];
  fill_word_muls(muls);
  const bool skipped = *go == 0;  // nothing written but the reports
  const AdamWStep s = adamw_step(step);
  const int warp = threadIdx.x >> 5;
  const Acc<kG> acc = warp_acc<kParity, kG>();
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarps;
  for (int64_t gg = static_cast<int64_t>(blockIdx.x) * kWarps + warp; gg < T.first_group[T.count];
       gg += warps) {
    const int i = leaf_of(T, gg);
    const InPlaceLeaf& L = T.leaf[i];
    const int64_t grp = T.group0[i] + gg - T.first_group[i];
    const parity::GroupSpan span = members<kParity>(L, grp);
    if (skipped) {  // the reports: the checks' damaged chunks, nothing kept
      for (uint32_t m = lane_id(); m < span.count; m += 32) {
        const int64_t c = span.chunk(m);
        L.faults[c] = L.checked != nullptr && L.checked[c] != 0 ? kFaultParam : 0;
        L.kept[c] = 0;
      }
      continue;
    }
    if constexpr (kParity) zero_acc<kG>(acc);
    bool left = false;  // a chunk of the group was not written (warp-uniform)
    for (uint32_t m = 0; m < span.count; ++m) {
      const int64_t c = span.chunk(m);
      Part<kG, kBF16> x;
      const void* g = static_cast<const uint8_t*>(L.g) + c * L.chunk_elems * (kBF16 ? 2 : 4);
      const ChunkVerdict v =
          warp_chunk<kBF16, kMaster, kParity, kG, kWhole, kEpsRoot>(L, c, g, h, s, acc, muls, x);
      record(L, c, v, totals);
      if (v.faults != 0) stash_chunk<kBF16, kG>(L, c, v.faults, x, stash, totals);
      left |= v.faults != 0;
    }
    // A chunk left unwritten has its correct bytes only in the old rows (inplace.h).
    if constexpr (kParity) write_parity<kBF16, kMaster, kG>(L, grp, acc, left);
  }
}

// A redo: entry k's warp takes every entry of its (leaf, parity group), in order, if k is the
// first of them (one writer a parity row).
template <bool kBF16, bool kMaster, bool kParity, int kG>
__global__ void __launch_bounds__(32 * kWarps)
    redo_kernel(const __grid_constant__ Table T, const AdamWHyper h, const float* step,
                StashIn stash, uint64_t* totals) {
  __shared__ uint4 muls[32 * kG];
  fill_word_muls(muls);
  const AdamWStep s = adamw_step(step);
  const int warp = threadIdx.x >> 5;
  const Acc<kG> acc = warp_acc<kParity, kG>();
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarps;
  const auto at = [&](int64_t k, int col) { return stash.index[kStashIndexColumns * k + col]; };
  for (int64_t k = static_cast<int64_t>(blockIdx.x) * kWarps + warp; k < stash.entries;
       k += warps) {
    int i = -1;
    for (int j = 0; j < T.count; ++j) i = T.leaf[j].index == at(k, 0) ? j : i;
    if (i < 0 || at(k, 1) < 0 || at(k, 1) >= inplace_chunks(T.leaf[i])) continue;
    const InPlaceLeaf& L = T.leaf[i];
    const int64_t chunks = inplace_chunks(L);
    const auto group_of = [&](int64_t c) {
      return kParity ? parity::group_of(chunks, L.group, c) : c;
    };
    const auto same_group = [&](int64_t j) {
      return at(j, 0) == at(k, 0) && at(j, 1) >= 0 && at(j, 1) < chunks &&
             group_of(at(j, 1)) == group_of(at(k, 1));
    };
    bool first = true;
    for (int64_t j = 0; j < k; ++j) first &= !same_group(j);
    if (!first) continue;
    for (int64_t j = k; j < stash.entries; ++j) {
      if (!same_group(j)) continue;
      const int64_t c = at(j, 1);
      if constexpr (kParity) zero_acc<kG>(acc);
      Part<kG, kBF16> x;
      const ChunkVerdict v = warp_chunk<kBF16, kMaster, kParity, kG, false, true>(
          L, c, stash.rows + j * L.chunk_elems, h, s, acc, muls, x);
      record(L, c, v, totals);
      if constexpr (kParity) {
        if (v.faults == 0) write_parity<kBF16, kMaster, kG>(L, group_of(c), acc, true);
      }
    }
  }
}

struct Kind {
  bool bf16, master, parity;
  int g;  // groups of four a lane: chunk_elems / 128
  bool operator==(const Kind& o) const {
    return bf16 == o.bf16 && master == o.master && parity == o.parity && g == o.g;
  }
};

Kind kind_of(const InPlaceLeaf& L) {
  return {L.param_bf16, L.has_master, L.group > 0, static_cast<int>(L.chunk_elems / 128)};
}

struct Launch {
  bool whole;  // the main launch (whole chunks) or the tail one
  const AdamWHyper& h;
  const float* step;
  const int32_t* go;
  const Stash* stash;
  const StashIn* redo;
  uint64_t* totals;
  cudaStream_t stream;
};

int blocks_for(int64_t warps) {
  return static_cast<int>(std::min<int64_t>((warps + kWarps - 1) / kWarps, 1 << 20));
}

template <typename Kernel>
cudaError_t allow_acc(Kernel kernel, int bytes) {
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
}

template <bool kBF16, bool kMaster, bool kParity, int kG>
cudaError_t launch_kind(const Table& T, const Launch& l) {
  constexpr int smem = acc_bytes<kParity, kG>();
  if (l.redo != nullptr) {
    if (l.redo->entries == 0) return cudaSuccess;
    auto* kernel = redo_kernel<kBF16, kMaster, kParity, kG>;
    PIMHBM_CUDA_RETURN_IF_ERROR(allow_acc(kernel, smem));
    kernel<<<blocks_for(l.redo->entries), 32 * kWarps, smem, l.stream>>>(T, l.h, l.step, *l.redo,
                                                                         l.totals);
  } else {
    // The main launch leaves out eps_root's addition where it adds nothing (adamw_math.h); the
    // tail launch, a few chunks, keeps one kernel.
    auto* kernel = !l.whole             ? inplace_kernel<kBF16, kMaster, kParity, kG, false, true>
                   : eps_root_free(l.h) ? inplace_kernel<kBF16, kMaster, kParity, kG, true, false>
                                        : inplace_kernel<kBF16, kMaster, kParity, kG, true, true>;
    PIMHBM_CUDA_RETURN_IF_ERROR(allow_acc(kernel, smem));
    kernel<<<blocks_for(T.first_group[T.count]), 32 * kWarps, smem, l.stream>>>(
        T, l.h, l.step, l.go, *l.stash, l.totals);
  }
  PIMHBM_CUDA_RETURN_LAUNCH_ERROR();
  return cudaSuccess;
}

template <bool kBF16, bool kMaster, bool kParity>
cudaError_t launch_groups(const Table& T, int g, const Launch& l) {
  if (g == 1) return launch_kind<kBF16, kMaster, kParity, 1>(T, l);
  if (g == 2) return launch_kind<kBF16, kMaster, kParity, 2>(T, l);
  if (g == 4) return launch_kind<kBF16, kMaster, kParity, 4>(T, l);
  return cudaErrorInvalidValue;  // the handler takes chunks of 128, 256 or 512 elements only
}

template <bool kBF16, bool kMaster>
cudaError_t launch_parity(const Table& T, const Kind& k, const Launch& l) {
  return k.parity ? launch_groups<kBF16, kMaster, true>(T, k.g, l)
                  : launch_groups<kBF16, kMaster, false>(T, k.g, l);
}

cudaError_t launch_table(const Table& T, const Kind& k, const Launch& l) {
  if (k.bf16 && k.master) return launch_parity<true, true>(T, k, l);
  if (k.bf16) return launch_parity<true, false>(T, k, l);
  return launch_parity<false, false>(T, k, l);
}

// Groups of a leaf whose chunks are all whole, and whether its last group holds a short chunk.
int64_t whole_groups(const InPlaceLeaf& L) {
  const bool ragged = L.n % L.chunk_elems != 0;
  return inplace_groups(L) - (ragged ? 1 : 0);
}

// Leaves of one kind in tables of up to kMaxLeaves, one launch each: with l.whole, their
// groups of whole chunks; else their last groups where they hold a short chunk. A redo: every
// leaf (its kernel takes the stash's entries).
cudaError_t launch_all(const InPlaceLeaf* leaves, size_t count, const Launch& l) {
  std::vector<bool> done(count, false);
  for (size_t i = 0; i < count; ++i) {
    if (done[i]) continue;
    const Kind kind = kind_of(leaves[i]);
    Table T{};
    T.count = 0;
    T.first_group[0] = 0;
    for (size_t j = i; j < count; ++j) {
      if (done[j] || !(kind_of(leaves[j]) == kind)) continue;
      done[j] = true;
      const InPlaceLeaf& L = leaves[j];
      const int64_t whole = whole_groups(L);
      const int64_t groups = l.redo != nullptr ? inplace_groups(L)
                             : l.whole         ? whole
                                               : inplace_groups(L) - whole;
      if (inplace_chunks(L) == 0 || (l.redo == nullptr && groups == 0)) continue;
      T.leaf[T.count] = L;
      T.group0[T.count] = l.redo == nullptr && !l.whole ? whole : 0;
      T.first_group[T.count + 1] = T.first_group[T.count] + groups;
      if (++T.count == kMaxLeaves) {
        PIMHBM_CUDA_RETURN_IF_ERROR(launch_table(T, kind, l));
        T.count = 0;
      }
    }
    if (T.count > 0) PIMHBM_CUDA_RETURN_IF_ERROR(launch_table(T, kind, l));
  }
  return cudaSuccess;
}

// The totals zero; for a redo (no stash) every report of every leaf zero; for the update (the
// kernel writes each chunk's reports) the stash cleared: rows 0, index (-1, -1, 0).
cudaError_t clear(const InPlaceLeaf* leaves, size_t count, uint64_t* totals, const Stash* stash,
                  cudaStream_t stream);

}  // namespace

cudaError_t inplace_cuda(const InPlaceLeaf* leaves, size_t count, const AdamWHyper& hyper,
                         const float* step, const int32_t* go, const Stash& stash, uint64_t* totals,
                         cudaStream_t stream) {
  PIMHBM_CUDA_RETURN_IF_ERROR(clear(leaves, count, totals, &stash, stream));
  PIMHBM_CUDA_RETURN_IF_ERROR(
      launch_all(leaves, count, Launch{true, hyper, step, go, &stash, nullptr, totals, stream}));
  return launch_all(leaves, count, Launch{false, hyper, step, go, &stash, nullptr, totals, stream});
}

cudaError_t redo_cuda(const InPlaceLeaf* leaves, size_t count, const AdamWHyper& hyper,
                      const float* step, const StashIn& stash, uint64_t* totals,
                      cudaStream_t stream) {
  PIMHBM_CUDA_RETURN_IF_ERROR(clear(leaves, count, totals, nullptr, stream));
  return launch_all(leaves, count,
                    Launch{false, hyper, step, nullptr, nullptr, &stash, totals, stream});
}

namespace {

__global__ void clear_stash_index(int32_t* index, int64_t rows) {
  for (int64_t k = blockIdx.x * blockDim.x + threadIdx.x; k < rows; k += gridDim.x * blockDim.x) {
    index[kStashIndexColumns * k] = -1;
    index[kStashIndexColumns * k + 1] = -1;
    index[kStashIndexColumns * k + 2] = 0;
  }
}

cudaError_t clear(const InPlaceLeaf* leaves, size_t count, uint64_t* totals, const Stash* stash,
                  cudaStream_t stream) {
  PIMHBM_CUDA_RETURN_IF_ERROR(
      cudaMemsetAsync(totals, 0, kInPlaceTotals * sizeof(uint64_t), stream));
  // The update's kernel writes every chunk's reports itself (a memset a leaf and report cost as
  // much as the rest of the launches together: bench/NOTES.md); a redo visits only its entries.
  for (size_t i = 0; i < count && stash == nullptr; ++i) {
    const size_t bytes = static_cast<size_t>(inplace_chunks(leaves[i])) * sizeof(int32_t);
    if (bytes == 0) continue;
    PIMHBM_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(leaves[i].faults, 0, bytes, stream));
    PIMHBM_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(leaves[i].kept, 0, bytes, stream));
  }
  if (stash != nullptr && stash->capacity > 0 && count > 0) {
    const size_t rows = static_cast<size_t>(stash->capacity * leaves[0].chunk_elems) * 4;
    PIMHBM_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(stash->rows, 0, rows, stream));
    clear_stash_index<<<1, 128, 0, stream>>>(stash->index, stash->capacity);
    PIMHBM_CUDA_RETURN_LAUNCH_ERROR();
  }
  return cudaSuccess;
}

}  // namespace
}  // namespace pimhbm::update
