// Storage and accumulation types. Kernels are templates on the storage type S of their
// tensors (float, double, c10::BFloat16, c10::Half) and accumulate in Acc<S> (float;
// double for double): a tile of bf16 or fp16 rows is converted into float scratch as it
// is read (to_acc) and results are rounded back as they are written (from_acc), so no
// float32 copy of a whole input is ever made.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstring>
#include <type_traits>

#include "vec.h"

namespace attnlab {

template <typename S>
struct AccOf {
  using type = float;
};
template <>
struct AccOf<double> {
  using type = double;
};
template <typename S>
using Acc = typename AccOf<S>::type;

// dst[0..n) = src as the accumulation type.
inline void to_acc(const float* src, float* dst, int64_t n) {
  std::memcpy(dst, src, n * sizeof(float));
}
inline void to_acc(const double* src, double* dst, int64_t n) {
  std::memcpy(dst, src, n * sizeof(double));
}
// bf16 is the top half of a float: a shift.
ATTNLAB_PER_ISA static void to_acc(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
  for (int64_t j = 0; j < n; ++j) {
    const uint32_t bits = uint32_t(s[j]) << 16;
    std::memcpy(dst + j, &bits, 4);
  }
}
ATTNLAB_PER_ISA static void to_acc(const c10::Half* src, float* dst, int64_t n) {
#if defined(ATTNLAB_X86) && defined(__FLT16_MAX__)
  const _Float16* s = reinterpret_cast<const _Float16*>(src);  // F16C's vcvtph2ps where present
  for (int64_t j = 0; j < n; ++j) dst[j] = float(s[j]);
#else
  for (int64_t j = 0; j < n; ++j) dst[j] = float(src[j]);
#endif
}

// dst[0..n) = src rounded to the storage type (to nearest, ties to even; NaN stays NaN).
inline void from_acc(const float* src, float* dst, int64_t n) {
  std::memcpy(dst, src, n * sizeof(float));
}
inline void from_acc(const double* src, double* dst, int64_t n) {
  std::memcpy(dst, src, n * sizeof(double));
}
ATTNLAB_PER_ISA static void from_acc(const float* src, c10::BFloat16* dst, int64_t n) {
  uint16_t* d = reinterpret_cast<uint16_t*>(dst);
  for (int64_t j = 0; j < n; ++j) {
    uint32_t bits;
    std::memcpy(&bits, src + j, 4);
    const bool nan = (bits & 0x7fffffffu) > 0x7f800000u;
    const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    d[j] = nan ? uint16_t((bits >> 16) | 0x40u) : uint16_t(rounded);
  }
}
ATTNLAB_PER_ISA static void from_acc(const float* src, c10::Half* dst, int64_t n) {
#if defined(ATTNLAB_X86) && defined(__FLT16_MAX__)
  _Float16* d = reinterpret_cast<_Float16*>(dst);
  for (int64_t j = 0; j < n; ++j) d[j] = _Float16(src[j]);
#else
  for (int64_t j = 0; j < n; ++j) dst[j] = c10::Half(src[j]);
#endif
}

// Vectors of floats loaded from either storage: float as it is, bf16 widened (a shift).
// Templates over the storage type read their rows through these, one statement a loop.
typedef uint16_t u16x8 __attribute__((vector_size(16)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
ATTNLAB_INLINE f8 load8(const c10::BFloat16* p) {
  u16x8 h;
  std::memcpy(&h, p, sizeof(h));
  return (f8)(__builtin_convertvector(h, u32x8) << 16);  // a vector cast keeps the bits
}
ATTNLAB_INLINE f16v load16(const c10::BFloat16* p) {
  u16x16 h;
  std::memcpy(&h, p, sizeof(h));
  return (f16v)(__builtin_convertvector(h, u32x16) << 16);
}

// x rounded to bf16 and widened back: the value a bf16 product multiplies.
inline float bf16_rounded(float x) { return float(c10::BFloat16(x)); }

// A block of `rows` rows of `cols` values (row stride ld) of storage type S as the
// accumulation type: the memory itself where S is already that type (ld unchanged), else
// a converted copy in `scratch` (ld = cols).
template <typename S, typename Scratch>
const Acc<S>* rows_as_acc(const S* src, int64_t ld, int64_t rows, int64_t cols, Scratch& scratch,
                          int64_t& ld_out) {
  if constexpr (std::is_same_v<S, Acc<S>>) {
    ld_out = ld;
    return src;
  } else {
    if (static_cast<int64_t>(scratch.size()) < rows * cols) scratch.resize(rows * cols);
    for (int64_t r = 0; r < rows; ++r) to_acc(src + r * ld, scratch.data() + r * cols, cols);
    ld_out = cols;
    return scratch.data();
  }
}

}  // namespace attnlab
