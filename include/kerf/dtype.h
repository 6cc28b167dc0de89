// Element types kerf knows, shared by the IR, the runtime and the ops.
#pragma once

#if defined(__cplusplus) && __cplusplus < 202002L && !defined(_MSVC_LANG)
#error "kerf's headers need C++20 (-std=c++20; CMake: kerf::kerf asks for cxx_std_20)"
#endif

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace kerf {

// u8 is a storage type (packed 4-bit weights, byte tables): tensors of it are
// loaded and stored, and its tiles convert to other dtypes (zero-extending);
// arithmetic on u8 tiles happens in i32, as C promotes unsigned char to int.
enum class DType : uint8_t { i1, i32, i64, f16, bf16, f32, f64, u8 };

// Canonical short name: "i1", "i32", "i64", "f16", "bf16", "f32", "f64", "u8".
const char* dtype_name(DType t);
// Accepts the canonical names and the common aliases ("float32", "bfloat16", "bool", ...).
std::optional<DType> parse_dtype(std::string_view name);

// Bytes per element; i1 is stored as one byte. Inline: every launch and op check asks.
constexpr int dtype_size_bytes(DType t) {
  switch (t) {
    case DType::i1:
    case DType::u8: return 1;
    case DType::f16:
    case DType::bf16: return 2;
    case DType::i32:
    case DType::f32: return 4;
    case DType::i64:
    case DType::f64: return 8;
  }
  return 0;
}
inline bool is_float(DType t) {
  return t == DType::f16 || t == DType::bf16 || t == DType::f32 || t == DType::f64;
}
inline bool is_int(DType t) { return t == DType::i1 || t == DType::i32 || t == DType::i64; }
inline bool is_half(DType t) { return t == DType::f16 || t == DType::bf16; }

// Scalar conversions used by references, tests and the CPU paths.
float bf16_to_float(uint16_t bits);
uint16_t float_to_bf16(float value);  // round to nearest even, NaN kept a NaN
float f16_to_float(uint16_t bits);
uint16_t float_to_f16(float value);  // round to nearest even

}  // namespace kerf
