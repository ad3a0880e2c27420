// The handlers of pimhbm_attention_fwd / pimhbm_attention_bwd for both platforms, and their
// CPU launches. Every buffer's dtype and shape is checked against q's before any pointer is
// taken.
#include "attention/attention_ffi.h"

#include <string>

#include "pimhbm/ffi_util.h"

namespace pimhbm::attention {

using ffi_util::dtype_name;
using ffi_util::invalid;
using ffi_util::shape_str;

ffi::Error launch(ffi_util::OnCpu, const Forward& c) {
  forward_cpu(c);
  return ffi::Error::Success();
}

ffi::Error launch(ffi_util::OnCpu, const Backward& c) {
  backward_cpu(c);
  return ffi::Error::Success();
}

namespace {

constexpr const char* kFwd = "pimhbm.attention";
constexpr const char* kBwd = "pimhbm.attention (backward)";
constexpr int64_t kMaxGrid = 65535;            // batch and heads index CUDA grid dimensions
constexpr int64_t kMaxSeq = (1ll << 31) - 64;  // positions are int on the GPU

ffi::Error check_dims(const char* op, const char* name, const ffi::AnyBuffer& x, ffi::DataType want,
                      std::initializer_list<int64_t> dims) {
  const auto got = x.dimensions();
  bool same = x.element_type() == want && got.size() == dims.size();
  for (size_t i = 0; same && i < dims.size(); ++i) same = got[i] == dims.begin()[i];
  if (same) return ffi::Error::Success();
  std::string shape = "(";
  for (int64_t d : dims) shape += (shape.size() > 1 ? ", " : "") + std::to_string(d);
  return invalid(op, std::string(name) + " must be " + dtype_name(want) + shape + "), got " +
                         dtype_name(x.element_type()) + shape_str(got));
}

// q [batch, seq, heads, head_dim] and k, v [batch, seq, kv_heads, head_dim], all bfloat16.
ffi::ErrorOr<Shape> shape_of(const char* op, const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                             const ffi::AnyBuffer& v, bool causal) {
  const auto qd = q.dimensions(), kd = k.dimensions();
  if (q.element_type() != ffi::DataType::BF16 || qd.size() != 4) {
    return invalid(op, "q must be bfloat16 [batch, seq, heads, head_dim], got " +
                           dtype_name(q.element_type()) + shape_str(qd));
  }
  const Shape s{qd[0], qd[1], qd[2], kd.size() == 4 ? kd[2] : 0, qd[3], causal};
  if (!supported_head_dim(s.head_dim)) {
    return invalid(op, "head_dim must be 16, 32, 64 or 128, got " + std::to_string(s.head_dim));
  }
  if (kd.size() != 4 || s.kv_heads < 1 || s.heads % s.kv_heads != 0) {
    return invalid(op, "k must be [batch, seq, kv_heads, head_dim] with kv_heads dividing q's " +
                           std::to_string(s.heads) + " heads, got " + shape_str(kd));
  }
  PIMHBM_FFI_RETURN_IF_ERROR(
      check_dims(op, "k", k, ffi::DataType::BF16, {s.batch, s.seq, s.kv_heads, s.head_dim}));
  PIMHBM_FFI_RETURN_IF_ERROR(
      check_dims(op, "v", v, ffi::DataType::BF16, {s.batch, s.seq, s.kv_heads, s.head_dim}));
  if (s.batch > kMaxGrid || s.heads > kMaxGrid || s.seq > kMaxSeq) {
    return invalid(
        op, "at most 65535 sequences, 65535 heads and 2^31 - 64 positions, got " + shape_str(qd));
  }
  return s;
}

const uint16_t* bf16_in(const ffi::AnyBuffer& x) {
  return static_cast<const uint16_t*>(x.untyped_data());
}
uint16_t* bf16_out(ffi::Result<ffi::AnyBuffer>& x) {
  return static_cast<uint16_t*>(x->untyped_data());
}

// q, k, v -> o, lse float32 [batch, heads, seq]
template <typename Platform>
ffi::Error forward_handler(Platform on, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                           ffi::Result<ffi::AnyBuffer> o, ffi::Result<ffi::AnyBuffer> lse,
                           bool causal) {
  PIMHBM_FFI_ASSIGN_OR_RETURN(const Shape s, shape_of(kFwd, q, k, v, causal));
  const auto bf16 = ffi::DataType::BF16, f32 = ffi::DataType::F32;
  PIMHBM_FFI_RETURN_IF_ERROR(
      check_dims(kFwd, "o", *o, bf16, {s.batch, s.seq, s.heads, s.head_dim}));
  PIMHBM_FFI_RETURN_IF_ERROR(check_dims(kFwd, "lse", *lse, f32, {s.batch, s.heads, s.seq}));
  return launch(on, Forward{s, bf16_in(q), bf16_in(k), bf16_in(v), bf16_out(o),
                            static_cast<float*>(lse->untyped_data())});
}

// q, k, v, o, lse, dO -> dq, dk, dv, delta float32 [batch, heads, seq] (scratch)
template <typename Platform>
ffi::Error backward_handler(Platform on, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                            ffi::AnyBuffer o, ffi::AnyBuffer lse, ffi::AnyBuffer d_o,
                            ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
                            ffi::Result<ffi::AnyBuffer> dv, ffi::Result<ffi::AnyBuffer> delta,
                            bool causal) {
  PIMHBM_FFI_ASSIGN_OR_RETURN(const Shape s, shape_of(kBwd, q, k, v, causal));
  const auto bf16 = ffi::DataType::BF16, f32 = ffi::DataType::F32;
  const std::initializer_list<int64_t> q_dims{s.batch, s.seq, s.heads, s.head_dim};
  const std::initializer_list<int64_t> kv_dims{s.batch, s.seq, s.kv_heads, s.head_dim};
  const std::initializer_list<int64_t> row_dims{s.batch, s.heads, s.seq};
  PIMHBM_FFI_RETURN_IF_ERROR(check_dims(kBwd, "o", o, bf16, q_dims));
  PIMHBM_FFI_RETURN_IF_ERROR(check_dims(kBwd, "lse", lse, f32, row_dims));
  PIMHBM_FFI_RETURN_IF_ERROR(check_dims(kBwd, "the output gradient", d_o, bf16, q_dims));
  PIMHBM_FFI_RETURN_IF_ERROR(check_dims(kBwd, "dq", *dq, bf16, q_dims));
  PIMHBM_FFI_RETURN_IF_ERROR(check_dims(kBwd, "dk", *dk, bf16, kv_dims));
  PIMHBM_FFI_RETURN_IF_ERROR(check_dims(kBwd, "dv", *dv, bf16, kv_dims));
  PIMHBM_FFI_RETURN_IF_ERROR(check_dims(kBwd, "delta", *delta, f32, row_dims));
  return launch(on, Backward{s, bf16_in(q), bf16_in(k), bf16_in(v), bf16_in(o), bf16_in(d_o),
                             static_cast<const float*>(lse.untyped_data()),
                             static_cast<float*>(delta->untyped_data()), bf16_out(dq), bf16_out(dk),
                             bf16_out(dv)});
}

}  // namespace
}  // namespace pimhbm::attention

// q, k, v -> o, lse
#define PIMHBM_ATTENTION_FWD_BINDING(bind) \
  bind.Arg<::xla::ffi::AnyBuffer>()        \
      .Arg<::xla::ffi::AnyBuffer>()        \
      .Arg<::xla::ffi::AnyBuffer>()        \
      .Ret<::xla::ffi::AnyBuffer>()        \
      .Ret<::xla::ffi::AnyBuffer>()        \
      .Attr<bool>("causal")
PIMHBM_FFI_HANDLERS(PimhbmAttentionFwd, pimhbm::attention::forward_handler,
                    PIMHBM_ATTENTION_FWD_BINDING, PIMHBM_FFI_CAPTURABLE);

// q, k, v, o, lse, dO -> dq, dk, dv, delta
#define PIMHBM_ATTENTION_BWD_BINDING(bind) \
  bind.Arg<::xla::ffi::AnyBuffer>()        \
      .Arg<::xla::ffi::AnyBuffer>()        \
      .Arg<::xla::ffi::AnyBuffer>()        \
      .Arg<::xla::ffi::AnyBuffer>()        \
      .Arg<::xla::ffi::AnyBuffer>()        \
      .Arg<::xla::ffi::AnyBuffer>()        \
      .Ret<::xla::ffi::AnyBuffer>()        \
      .Ret<::xla::ffi::AnyBuffer>()        \
      .Ret<::xla::ffi::AnyBuffer>()        \
      .Ret<::xla::ffi::AnyBuffer>()        \
      .Attr<bool>("causal")
PIMHBM_FFI_HANDLERS(PimhbmAttentionBwd, pimhbm::attention::backward_handler,
                    PIMHBM_ATTENTION_BWD_BINDING, PIMHBM_FFI_CAPTURABLE);
