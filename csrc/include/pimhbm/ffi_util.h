// Helpers shared by the FFI handlers: input validation with messages a user understands.
// Handlers never call typed_data<T>() on a buffer whose dtype they have not checked (it
// aborts the process); they check the dtype and use untyped_data().
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "pimhbm/digest.h"
#include "pimhbm/elem.h"
#include "pimhbm/ffi_error.h"
#include "xla/ffi/api/ffi.h"

namespace pimhbm::ffi_util {

namespace ffi = xla::ffi;

inline std::string dtype_name(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::PRED:
      return "bool";
    case ffi::DataType::S8:
      return "int8";
    case ffi::DataType::S16:
      return "int16";
    case ffi::DataType::S32:
      return "int32";
    case ffi::DataType::S64:
      return "int64";
    case ffi::DataType::U8:
      return "uint8";
    case ffi::DataType::U16:
      return "uint16";
    case ffi::DataType::U32:
      return "uint32";
    case ffi::DataType::U64:
      return "uint64";
    case ffi::DataType::F16:
      return "float16";
    case ffi::DataType::F32:
      return "float32";
    case ffi::DataType::F64:
      return "float64";
    case ffi::DataType::BF16:
      return "bfloat16";
    case ffi::DataType::F8E4M3FN:
      return "float8_e4m3fn";
    case ffi::DataType::F8E5M2:
      return "float8_e5m2";
    case ffi::DataType::C64:
      return "complex64";
    case ffi::DataType::C128:
      return "complex128";
    default:
      return "dtype #" + std::to_string(static_cast<int>(t));
  }
}

// The element class of a protected dtype, or nothing for dtypes we do not protect.
inline std::optional<Elem> elem_of(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::PRED:
    case ffi::DataType::S8:
    case ffi::DataType::S16:
    case ffi::DataType::S32:
    case ffi::DataType::S64:
    case ffi::DataType::U8:
    case ffi::DataType::U16:
    case ffi::DataType::U32:
    case ffi::DataType::U64:
      return Elem::kRaw;
    case ffi::DataType::F64:
      return Elem::kF64;
    case ffi::DataType::F32:
      return Elem::kF32;
    case ffi::DataType::F16:
      return Elem::kF16;
    case ffi::DataType::BF16:
      return Elem::kBF16;
    case ffi::DataType::F8E4M3FN:
      return Elem::kF8E4M3FN;
    case ffi::DataType::F8E5M2:
      return Elem::kF8E5M2;
    default:
      return std::nullopt;
  }
}

inline ffi::Error check_chunk_bytes(std::string_view op, int64_t chunk_bytes) {
  if (chunk_bytes <= 0 || chunk_bytes % kChunkAlign != 0) {
    return invalid(
        op, "chunk_bytes must be a positive multiple of 16, got " + std::to_string(chunk_bytes));
  }
  return ffi::Error::Success();
}

// Plain string building: no iostreams in handlers (a process may have loaded another
// libstdc++ than the one this module was built against, and its locale facets differ).
inline std::string shape_str(ffi::AnyBuffer::Dimensions dims) {
  std::string out = "(";
  for (size_t i = 0; i < dims.size(); ++i) out += (i ? ", " : "") + std::to_string(dims[i]);
  return out + (dims.size() == 1 ? ",)" : ")");
}

// Checks that `buf` has dtype `want` and exactly `count` elements (any shape).
inline ffi::Error check_buffer(std::string_view op, std::string_view name,
                               const ffi::AnyBuffer& buf, ffi::DataType want, int64_t count) {
  if (buf.element_type() != want) {
    return invalid(op, std::string(name) + " must be " + dtype_name(want) + ", got " +
                           dtype_name(buf.element_type()));
  }
  if (static_cast<int64_t>(buf.element_count()) != count) {
    return invalid(op, std::string(name) + " must have " + std::to_string(count) +
                           " elements, got shape " + shape_str(buf.dimensions()));
  }
  return ffi::Error::Success();
}

// The digest table of a buffer with n chunks: uint32 of shape (n, 2).
inline ffi::Error check_digest_table(std::string_view op, std::string_view name,
                                     const ffi::AnyBuffer& buf, int64_t nchunks) {
  auto dims = buf.dimensions();
  if (buf.element_type() != ffi::DataType::U32 || dims.size() != 2 || dims[0] != nchunks ||
      dims[1] != 2) {
    return invalid(op, std::string(name) + " must be a uint32 digest table of shape (" +
                           std::to_string(nchunks) + ", 2), got " + dtype_name(buf.element_type()) +
                           shape_str(dims));
  }
  return ffi::Error::Success();
}

// The element class of a protected tensor, or an error naming the dtype.
inline ffi::ErrorOr<Elem> protected_elem(std::string_view op, const ffi::AnyBuffer& x) {
  std::optional<Elem> e = elem_of(x.element_type());
  if (!e) {
    return invalid(op, "dtype " + dtype_name(x.element_type()) +
                           " is not protected (supported: float64/32/16, bfloat16, "
                           "float8_e4m3fn, float8_e5m2, bool and 8-64 bit integers)");
  }
  return *e;
}

}  // namespace pimhbm::ffi_util
