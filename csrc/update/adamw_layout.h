// The buffers of one leaf of a pimhbm_adamw call, described once: the handler checks a call
// against this table (update_ffi.cc), and the Python front builds its calls from it by name
// (pimhbm._core.adamw_layout(), python/pimhbm/update.py) -- which operand is which, which one
// is aliased with which result, what dtype and how many elements each must have.
//
// A call's operands: the step scalars (float32 (3,): lr, 1 - b1^t, 1 - b2^t), then every
// leaf's operands (the rows below that have one, in order). Its results: every leaf's results
// (the rows that have one, in order), then the call's totals (uint32 (2, 2): two 64-bit
// counters, AdamWLeaf::totals, as (low, high) words).
#pragma once

namespace pimhbm::update {

// What the update does with a buffer.
enum class Role {
  kRead,    // an operand it only reads: the state as committed, its digests, the gradient
  kWrite,   // the write side: an operand aliased with a result, which the update writes whole
  kCopy,    // the device copy: the same, written only where the chunk verified
  kReport,  // a result only: what the update saw, per chunk
};

// Which tensor of the leaf a buffer holds (or holds the digest table of).
enum class Tensor { kP, kMaster, kMu, kNu, kGradient, kFaults, kGradNonfinite };

// The dtype a buffer must have.
enum class Dtype {
  kParam,    // the parameters': float32, or bfloat16 (the only kind with master weights)
  kU16,      // the master weights' remainders (adamw_math.h, split_master)
  kF32,      // the moments
  kS32,      // the reports
  kDigests,  // a digest table: uint32, shape (chunks, 2)
};

// How many elements: one per element of the leaf, or one per chunk. Master rows have none
// without master weights, device copy rows none without the device copy.
enum class Count { kElements, kChunks };

struct LeafBuffer {
  const char* name;  // what error messages call it
  Role role;
  Tensor tensor;
  bool table;  // the tensor's digest table rather than the tensor
  Dtype dtype;
  Count count;
};

// clang-format off
inline constexpr LeafBuffer kLeafBuffers[] = {
    // name                                   role          tensor             table  dtype            count
    {"parameters",                            Role::kRead,  Tensor::kP,        false, Dtype::kParam,   Count::kElements},
    {"master",                                Role::kRead,  Tensor::kMaster,   false, Dtype::kU16,     Count::kElements},
    {"mu",                                    Role::kRead,  Tensor::kMu,       false, Dtype::kF32,     Count::kElements},
    {"nu",                                    Role::kRead,  Tensor::kNu,       false, Dtype::kF32,     Count::kElements},
    {"gradient",                              Role::kRead,  Tensor::kGradient, false, Dtype::kParam,   Count::kElements},
    {"digests of the parameters",             Role::kRead,  Tensor::kP,        true,  Dtype::kDigests, Count::kChunks},
    {"digests of the master weights",         Role::kRead,  Tensor::kMaster,   true,  Dtype::kDigests, Count::kChunks},
    {"digests of mu",                         Role::kRead,  Tensor::kMu,       true,  Dtype::kDigests, Count::kChunks},
    {"digests of nu",                         Role::kRead,  Tensor::kNu,       true,  Dtype::kDigests, Count::kChunks},
    {"new parameters",                        Role::kWrite, Tensor::kP,        false, Dtype::kParam,   Count::kElements},
    {"new master",                            Role::kWrite, Tensor::kMaster,   false, Dtype::kU16,     Count::kElements},
    {"new mu",                                Role::kWrite, Tensor::kMu,       false, Dtype::kF32,     Count::kElements},
    {"new nu",                                Role::kWrite, Tensor::kNu,       false, Dtype::kF32,     Count::kElements},
    {"new digests of the parameters",         Role::kWrite, Tensor::kP,        true,  Dtype::kDigests, Count::kChunks},
    {"new digests of the master weights",     Role::kWrite, Tensor::kMaster,   true,  Dtype::kDigests, Count::kChunks},
    {"new digests of mu",                     Role::kWrite, Tensor::kMu,       true,  Dtype::kDigests, Count::kChunks},
    {"new digests of nu",                     Role::kWrite, Tensor::kNu,       true,  Dtype::kDigests, Count::kChunks},
    {"device copy parameters",                Role::kCopy,  Tensor::kP,        false, Dtype::kParam,   Count::kElements},
    {"device copy master",                    Role::kCopy,  Tensor::kMaster,   false, Dtype::kU16,     Count::kElements},
    {"device copy mu",                        Role::kCopy,  Tensor::kMu,       false, Dtype::kF32,     Count::kElements},
    {"device copy nu",                        Role::kCopy,  Tensor::kNu,       false, Dtype::kF32,     Count::kElements},
    {"device copy digests of the parameters", Role::kCopy,  Tensor::kP,        true,  Dtype::kDigests, Count::kChunks},
    {"device copy digests of the master weights", Role::kCopy, Tensor::kMaster, true, Dtype::kDigests, Count::kChunks},
    {"device copy digests of mu",             Role::kCopy,  Tensor::kMu,       true,  Dtype::kDigests, Count::kChunks},
    {"device copy digests of nu",             Role::kCopy,  Tensor::kNu,       true,  Dtype::kDigests, Count::kChunks},
    {"fault map",                             Role::kReport, Tensor::kFaults,  false, Dtype::kS32,     Count::kChunks},
    {"gradient non-finite map",               Role::kReport, Tensor::kGradNonfinite, false, Dtype::kS32, Count::kChunks},
};
// clang-format on
inline constexpr int kLeafRows = static_cast<int>(sizeof(kLeafBuffers) / sizeof(kLeafBuffers[0]));

constexpr bool has_operand(const LeafBuffer& b) { return b.role != Role::kReport; }
constexpr bool has_result(const LeafBuffer& b) { return b.role != Role::kRead; }

// Where row `row` stands among its leaf's operands / results (-1: it has none).
constexpr int operand_of(int row) {
  int k = 0;
  for (int i = 0; i < row; ++i) k += has_operand(kLeafBuffers[i]) ? 1 : 0;
  return has_operand(kLeafBuffers[row]) ? k : -1;
}
constexpr int result_of(int row) {
  int k = 0;
  for (int i = 0; i < row; ++i) k += has_result(kLeafBuffers[i]) ? 1 : 0;
  return has_result(kLeafBuffers[row]) ? k : -1;
}

// Operands and results per leaf.
constexpr int leaf_operands() {
  int k = 0;
  for (const LeafBuffer& b : kLeafBuffers) k += has_operand(b) ? 1 : 0;
  return k;
}
constexpr int leaf_results() {
  int k = 0;
  for (const LeafBuffer& b : kLeafBuffers) k += has_result(b) ? 1 : 0;
  return k;
}
inline constexpr int kLeafOperands = leaf_operands();
inline constexpr int kLeafResults = leaf_results();
static_assert(kLeafOperands == 25 && kLeafResults == 18,
              "the layout of the programs the Python front builds");

// The row of (role, tensor, digest table or not), or -1.
constexpr int row_of(Role role, Tensor tensor, bool table) {
  for (int i = 0; i < kLeafRows; ++i) {
    const LeafBuffer& b = kLeafBuffers[i];
    if (b.role == role && b.tensor == tensor && b.table == table) return i;
  }
  return -1;
}

// The names the Python front knows these by.
constexpr const char* role_name(Role r) {
  constexpr const char* kNames[] = {"read", "write", "copy", "report"};
  return kNames[static_cast<int>(r)];
}
constexpr const char* tensor_key(Tensor t) {
  constexpr const char* kNames[] = {"p", "master", "mu", "nu", "g", "faults", "grad_nonfinite"};
  return kNames[static_cast<int>(t)];
}
constexpr const char* dtype_rule(Dtype d) {
  constexpr const char* kNames[] = {"param", "uint16", "float32", "int32", "uint32"};
  return kNames[static_cast<int>(d)];
}
constexpr const char* count_rule(Count c) { return c == Count::kElements ? "elements" : "chunks"; }

}  // namespace pimhbm::update
