// Causal (or full) grouped-query attention, deterministic by construction: forward and
// backward as plain C++ (the reference) and as CUDA kernels.
//
// Layouts (row-major, bf16 stored as uint16_t): q and o [batch, seq, heads, head_dim], k and v
// [batch, seq, kv_heads, head_dim]; query head h reads kv head h / (heads / kv_heads). Scores
// are scaled by 1 / sqrt(head_dim); lse and delta are float [batch, heads, seq]: lse the log of
// each query row's softmax denominator (natural log, the scale included), delta the row sum of
// dO * O that the backward pass needs.
//
// Every sum runs in a fixed order: the forward pass over key blocks in order; the backward pass
// computes dK and dV per key block (looping over query blocks, and over the query heads that
// share the kv head, in order) and dQ per query block (looping over key blocks) in two
// separate passes, so no value is ever accumulated by atomics. Two calls on the same inputs
// are bitwise equal, on the CPU and on the GPU.
#pragma once

#include <cmath>
#include <cstdint>

#if defined(PIMHBM_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace pimhbm::attention {

struct Shape {
  int64_t batch, seq, heads, kv_heads, head_dim;
  bool causal;

  int64_t group() const { return heads / kv_heads; }  // query heads per kv head
  float scale() const { return 1.0f / std::sqrt(static_cast<float>(head_dim)); }
  int64_t q_elems() const { return batch * seq * heads * head_dim; }
  int64_t kv_elems() const { return batch * seq * kv_heads * head_dim; }
  int64_t rows() const { return batch * heads * seq; }  // entries of lse and delta
};

// The head dims the kernels are built for.
inline bool supported_head_dim(int64_t d) { return d == 16 || d == 32 || d == 64 || d == 128; }

struct Forward {
  Shape shape;
  const uint16_t *q, *k, *v;
  uint16_t* o;
  float* lse;
};

struct Backward {
  Shape shape;
  const uint16_t *q, *k, *v, *o, *d_o;
  const float* lse;
  float* delta;  // written: rowsum(dO * O), the backward pass's scratch
  uint16_t *dq, *dk, *dv;
};

void forward_cpu(const Forward& call);
void backward_cpu(const Backward& call);

#if defined(PIMHBM_WITH_CUDA)
cudaError_t forward_cuda(const Forward& call, cudaStream_t stream);
cudaError_t backward_cuda(const Backward& call, cudaStream_t stream);
// The backward pass's first step alone: call.delta = rowsum(dO * O) (for other kernels of the
// backward pass that start from it).
cudaError_t delta_cuda(const Backward& call, cudaStream_t stream);
#endif

}  // namespace pimhbm::attention
