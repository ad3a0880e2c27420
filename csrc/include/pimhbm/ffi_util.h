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

// The dtypes handlers name in messages, by their NumPy names, and the element class of those
// we protect (elem.h; the others have none).
struct DtypeInfo {
  ffi::DataType type;
  const char* name;
  std::optional<Elem> elem;
};
inline constexpr DtypeInfo kDtypes[] = {
    {ffi::DataType::PRED, "bool", Elem::kRaw},
    {ffi::DataType::S8, "int8", Elem::kRaw},
    {ffi::DataType::S16, "int16", Elem::kRaw},
    {ffi::DataType::S32, "int32", Elem::kRaw},
    {ffi::DataType::S64, "int64", Elem::kRaw},
    {ffi::DataType::U8, "uint8", Elem::kRaw},
    {ffi::DataType::U16, "uint16", Elem::kRaw},
    {ffi::DataType::U32, "uint32", Elem::kRaw},
    {ffi::DataType::U64, "uint64", Elem::kRaw},
    {ffi::DataType::F16, "float16", Elem::kF16},
    {ffi::DataType::F32, "float32", Elem::kF32},
    {ffi::DataType::F64, "float64", Elem::kF64},
    {ffi::DataType::BF16, "bfloat16", Elem::kBF16},
    {ffi::DataType::F8E4M3FN, "float8_e4m3fn", Elem::kF8E4M3FN},
    {ffi::DataType::F8E5M2, "float8_e5m2", Elem::kF8E5M2},
    {ffi::DataType::C64, "complex64", std::nullopt},
    {ffi::DataType::C128, "complex128", std::nullopt},
};

inline const DtypeInfo* dtype_info(ffi::DataType t) {
  for (const DtypeInfo& d : kDtypes) {
    if (d.type == t) return &d;
  }
  return nullptr;
}

inline std::string dtype_name(ffi::DataType t) {
  const DtypeInfo* d = dtype_info(t);
  return d ? d->name : "dtype #" + std::to_string(static_cast<int>(t));
}

// The element class of a protected dtype, or nothing for dtypes we do not protect.
inline std::optional<Elem> elem_of(ffi::DataType t) {
  const DtypeInfo* d = dtype_info(t);
  return d ? d->elem : std::nullopt;
}

// A chunk size (chunk_bytes, or the update's chunk_elems): a positive multiple of 16, at most
// kMaxChunkSize (a chunk of elements up to 4 bytes then stays within the digest's words).
inline ffi::Error check_chunk_size(std::string_view op, std::string_view name, int64_t size) {
  if (size <= 0 || size % kChunkAlign != 0) {
    return invalid(
        op, std::string(name) + " must be a positive multiple of 16, got " + std::to_string(size));
  }
  if (size > kMaxChunkSize) {
    return invalid(op, std::string(name) + " must be at most " + std::to_string(kMaxChunkSize) +
                           ", got " + std::to_string(size));
  }
  return ffi::Error::Success();
}

inline ffi::Error check_chunk_bytes(std::string_view op, int64_t chunk_bytes) {
  return check_chunk_size(op, "chunk_bytes", chunk_bytes);
}

// Plain string building: no iostreams in handlers (a process may have loaded another
// libstdc++ than the one this module was built against, and its locale facets differ).
inline std::string shape_str(ffi::AnyBuffer::Dimensions dims) {
  std::string out = "(";
  for (size_t i = 0; i < dims.size(); ++i) out += (i ? ", " : "") + std::to_string(dims[i]);
  return out + (dims.size() == 1 ? ",)" : ")");
}

// Checks that `buf` (any buffer: its dtype checked already, by the FFI's typed decoding or by
// check_buffer) has exactly `count` elements (any shape).
template <typename Buffer>
ffi::Error check_count(std::string_view op, std::string_view name, const Buffer& buf,
                       int64_t count) {
  if (static_cast<int64_t>(buf.element_count()) != count) {
    return invalid(op, std::string(name) + " must have " + std::to_string(count) +
                           " elements, got shape " + shape_str(buf.dimensions()));
  }
  return ffi::Error::Success();
}

// Checks that `buf` has dtype `want` and exactly `count` elements (any shape).
inline ffi::Error check_buffer(std::string_view op, std::string_view name,
                               const ffi::AnyBuffer& buf, ffi::DataType want, int64_t count) {
  if (buf.element_type() != want) {
    return invalid(op, std::string(name) + " must be " + dtype_name(want) + ", got " +
                           dtype_name(buf.element_type()));
  }
  return check_count(op, name, buf, count);
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
