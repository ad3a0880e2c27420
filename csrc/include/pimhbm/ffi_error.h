// How FFI handlers fail: every check returns an ffi::Error whose message starts with the op's
// name ("pimhbm.scan: ..."), and a handler returns the first one it meets. A CUDA call's result
// becomes such an error through cuda_status, so that CUDA failures read like every other one.
#pragma once

#include <string>
#include <string_view>
#include <utility>

#include "xla/ffi/api/ffi.h"

#if defined(PIMHBM_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

// Returns from the calling function when `expr`, an ffi::Error, is a failure.
#define PIMHBM_FFI_RETURN_IF_ERROR(expr)                       \
  do {                                                         \
    ::xla::ffi::Error pimhbm_ffi_error_ = (expr);              \
    if (pimhbm_ffi_error_.failure()) return pimhbm_ffi_error_; \
  } while (0)

// `lhs = value of rhs` for an ffi::ErrorOr<T> `rhs`, or returns its error.
#define PIMHBM_FFI_ASSIGN_OR_RETURN(lhs, rhs) \
  PIMHBM_FFI_ASSIGN_OR_RETURN_(PIMHBM_FFI_CONCAT_(pimhbm_ffi_or_, __LINE__), lhs, rhs)
#define PIMHBM_FFI_ASSIGN_OR_RETURN_(tmp, lhs, rhs) \
  auto tmp = (rhs);                                 \
  if (tmp.has_error()) return tmp.error();          \
  lhs = std::move(*tmp)
#define PIMHBM_FFI_CONCAT_(a, b) PIMHBM_FFI_CONCAT__(a, b)
#define PIMHBM_FFI_CONCAT__(a, b) a##b

namespace pimhbm::ffi_util {

namespace ffi = xla::ffi;

// Bad input: what the user passed, and what the op wanted.
inline ffi::Error invalid(std::string_view op, const std::string& what) {
  return ffi::Error::InvalidArgument(std::string(op) + ": " + what);
}

// `err` (an invalid() of `op`) with `where` ("leaf 3: ") put after the op's name.
inline ffi::Error in_context(std::string_view op, const std::string& where, const ffi::Error& err) {
  const std::string head = std::string(op) + ": ";
  std::string msg = err.message();
  if (msg.rfind(head, 0) == 0) msg = msg.substr(head.size());
  return invalid(op, where + msg);
}

#if defined(PIMHBM_WITH_CUDA)
// The result of a CUDA call (or of a launcher that returns the first one it met) as an
// ffi::Error of `op`: success, or an internal error with CUDA's message (and the call, if named).
inline ffi::Error cuda_status(std::string_view op, cudaError_t err, std::string_view call = {}) {
  if (err == cudaSuccess) return ffi::Error::Success();
  std::string where = std::string(op) + ": CUDA error";
  if (!call.empty()) where += " in " + std::string(call);
  return ffi::Error::Internal(where + ": " + cudaGetErrorString(err));
}
#endif

}  // namespace pimhbm::ffi_util
