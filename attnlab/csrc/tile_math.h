// Row operations on one score tile, and the tile products (GEMM).
//
// The float row loops are compiled three times (AVX-512, AVX2+FMA, baseline
// x86-64) with GCC's target_clones and picked at load time, so one cached build
// is safe on any x86-64 machine and still vectorised on the one it runs on
// (-march=native would not be). exp is a branch-free polynomial so that the
// loops vectorise without -ffast-math; double keeps std::exp (tests only).
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define ATTNLAB_CLONES \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define ATTNLAB_CLONES
#endif

namespace attnlab {

// Eight floats as one value: GCC/Clang vector extensions, so each target clone
// below gets the widest instructions it has (two SSE halves in the baseline one).
typedef float f8 __attribute__((vector_size(32)));
typedef int32_t i8 __attribute__((vector_size(32)));
// Helpers taking or returning f8 must inline into each clone: called out of line,
// the baseline copy would pass f8 in memory while an AVX clone passes it in ymm.
#define ATTNLAB_INLINE static inline __attribute__((always_inline))

ATTNLAB_INLINE f8 load8(const float* p) {
  f8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
ATTNLAB_INLINE void store8(float* p, f8 v) { std::memcpy(p, &v, sizeof(v)); }
ATTNLAB_INLINE f8 splat8(float x) { return f8{} + x; }
// The last n < 8 values of a row padded with `fill`.
ATTNLAB_INLINE f8 load_tail(const float* p, int64_t n, float fill) {
  float buf[8];
  for (int j = 0; j < 8; ++j) buf[j] = j < n ? p[j] : fill;
  return load8(buf);
}

// e^x to about 1 ulp (Cephes expf): e^x = 2^n e^r with |r| <= ln2/2. Exactly 0
// below -87.33 and for -inf, so masked scores give weights of exactly zero.
ATTNLAB_INLINE f8 exp8(f8 x) {
  const f8 lo = splat8(-87.33654f), hi = splat8(88.0f);
  f8 xc = x < lo ? lo : x;
  xc = xc > hi ? hi : xc;
  const f8 magic = splat8(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  const f8 n = (xc * 1.44269504088896341f + magic) - magic;
  f8 r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  f8 y = splat8(1.9875691500e-4f);
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  const i8 bits = (__builtin_convertvector(n, i8) + 127) << 23;
  const f8 e = y * (f8)bits;  // a vector cast reinterprets the bits: 2^n
  return x < lo ? f8{} : e;
}

ATTNLAB_INLINE float sum8(f8 v) {
  float t = 0.0f;
  for (int j = 0; j < 8; ++j) t += v[j];
  return t;
}

// max of x[0..n); -inf when n == 0.
ATTNLAB_CLONES static float row_max(const float* x, int64_t n) {
  const float neg = -std::numeric_limits<float>::infinity();
  f8 m = splat8(neg);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const f8 v = load8(x + j);
    m = v > m ? v : m;
  }
  if (j < n) {
    const f8 v = load_tail(x + j, n - j, neg);
    m = v > m ? v : m;
  }
  float out = neg;
  for (int k = 0; k < 8; ++k) out = std::max(out, m[k]);
  return out;
}

// Whether x[0..n) holds a NaN (called off the hot path only: rows whose max is -inf).
template <typename T>
static inline bool any_nan(const T* x, int64_t n) {
  bool found = false;
  for (int64_t j = 0; j < n; ++j) found |= x[j] != x[j];  // branch-free: vectorises
  return found;
}

// x = exp(x - shift) in place; returns the sum of the new x.
ATTNLAB_CLONES static float exp_shift_sum(float* x, int64_t n, float shift) {
  f8 sum{};
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const f8 e = exp8(load8(x + j) - shift);
    store8(x + j, e);
    sum += e;
  }
  if (j < n) {  // padded with -inf: exp gives 0 there, which adds nothing
    const f8 e = exp8(load_tail(x + j, n - j, -std::numeric_limits<float>::infinity()) - shift);
    for (int64_t k = 0; k < n - j; ++k) x[j + k] = e[k];
    sum += e;
  }
  return sum8(sum);
}

ATTNLAB_CLONES static void scale_row(float* x, int64_t n, float a) {
  for (int64_t j = 0; j < n; ++j) x[j] *= a;
}

// dS = P * (dP - D_i), the softmax backward of one row, into p.
ATTNLAB_CLONES static void softmax_grad_row(float* p, const float* dp, int64_t n, float d) {
  for (int64_t j = 0; j < n; ++j) p[j] *= dp[j] - d;
}

static inline double row_max(const double* x, int64_t n) {
  double m = -std::numeric_limits<double>::infinity();
  for (int64_t j = 0; j < n; ++j) m = std::max(m, x[j]);
  return m;
}

static inline double exp_shift_sum(double* x, int64_t n, double shift) {
  double sum = 0.0;
  for (int64_t j = 0; j < n; ++j) sum += (x[j] = std::exp(x[j] - shift));
  return sum;
}

static inline void scale_row(double* x, int64_t n, double a) {
  for (int64_t j = 0; j < n; ++j) x[j] *= a;
}

static inline void softmax_grad_row(double* p, const double* dp, int64_t n, double d) {
  for (int64_t j = 0; j < n; ++j) p[j] *= dp[j] - d;
}

// Dropout decision of one weight, a pure function of (seed, flat index) so that
// the backward regenerates the forward's pattern whatever the tiling.
static inline bool dropout_keeps(uint64_t seed, uint64_t index, double p) {
  uint64_t z = seed ^ (index * 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return static_cast<double>(z >> 40) * (1.0 / 16777216.0) >= p;  // 24-bit uniform
}

}  // namespace attnlab

// The Fortran BLAS that torch's own build links (MKL on x86-64 wheels). Weak: a
// torch without it leaves these null and the tile products go through ATen.
extern "C" {
void sgemm_(const char*, const char*, const int*, const int*, const int*, const float*,
            const float*, const int*, const float*, const int*, const float*, float*,
            const int*) __attribute__((weak));
void dgemm_(const char*, const char*, const int*, const int*, const int*, const double*,
            const double*, const int*, const double*, const int*, const double*, double*,
            const int*) __attribute__((weak));
}

namespace attnlab {

// Which routine multiplies the tiles; tests switch it to check each one. Auto: the
// AVX-512 kernel of tile_gemm.h for float where the CPU has it (flash_common.h),
// else the BLAS torch links; Blas: always that BLAS; Aten: ATen's addmm.
enum class GemmPath : int { Auto = 0, Blas = 1, Aten = 2 };
inline GemmPath& gemm_path() {
  static GemmPath path = GemmPath::Auto;
  return path;
}

// Row-major C (m x n) = alpha * op(A) op(B) + beta * C, op(X) = X^T when tX.
// A column-major BLAS sees row-major C as C^T = op(B)^T op(A)^T: swap the operands.
template <typename T>
void gemm_rm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, T alpha, const T* a,
             int64_t lda, const T* b, int64_t ldb, T beta, T* c, int64_t ldc) {
  if (m == 0 || n == 0 || k == 0) return;  // k == 0 does not occur: head_dim >= 1
  const char ca = ta ? 'T' : 'N', cb = tb ? 'T' : 'N';
  const int M = static_cast<int>(m), N = static_cast<int>(n), K = static_cast<int>(k);
  const int LA = static_cast<int>(lda), LB = static_cast<int>(ldb), LC = static_cast<int>(ldc);
  if constexpr (std::is_same_v<T, float>) {
    if (sgemm_ != nullptr && gemm_path() != GemmPath::Aten) {
      sgemm_(&cb, &ca, &N, &M, &K, &alpha, b, &LB, a, &LA, &beta, c, &LC);
      return;
    }
  } else {
    if (dgemm_ != nullptr && gemm_path() != GemmPath::Aten) {
      dgemm_(&cb, &ca, &N, &M, &K, &alpha, b, &LB, a, &LA, &beta, c, &LC);
      return;
    }
  }
  const auto opts = at::TensorOptions().dtype(c10::CppTypeToScalarType<T>::value);
  auto view = [&](const T* p, bool t, int64_t rows, int64_t cols, int64_t ld) {
    // the stored matrix is (rows x cols) as op() sees it transposed when t
    at::Tensor x = t ? at::from_blob(const_cast<T*>(p), {cols, rows}, {ld, 1}, opts)
                     : at::from_blob(const_cast<T*>(p), {rows, cols}, {ld, 1}, opts);
    return t ? x.t() : x;
  };
  at::Tensor out = at::from_blob(c, {m, n}, {ldc, 1}, opts);
  out.addmm_(view(a, ta, m, k, lda), view(b, tb, k, n, ldb), beta, alpha);
}

}  // namespace attnlab
