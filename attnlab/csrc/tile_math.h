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

// e^x to about 1 ulp (Cephes expf): e^x = 2^n e^r with |r| <= ln2/2. Exactly 0
// below -87.33 and for -inf, so masked scores give weights of exactly zero.
static inline float exp_poly(float x) {
  const float lo = -87.33654f;
  const float xc = std::min(std::max(x, lo), 88.0f);
  float n = xc * 1.44269504088896341f;
  n = (n + 12582912.0f) - 12582912.0f;  // round to nearest, vectorisable (1.5 * 2^23)
  float r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof(two_n));
  return x < lo ? 0.0f : y * two_n;
}

// max of x[0..n); -inf when n == 0.
ATTNLAB_CLONES static float row_max(const float* x, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
  for (int64_t j = 0; j < n; ++j) m = std::max(m, x[j]);
  return m;
}

// x = exp(x - shift) in place; returns the sum of the new x.
ATTNLAB_CLONES static float exp_shift_sum(float* x, int64_t n, float shift) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < n; ++j) {
    const float e = exp_poly(x[j] - shift);
    x[j] = e;
    sum += e;
  }
  return sum;
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

inline bool& use_aten_gemm() {  // a switch for tests of the fallback
  static bool flag = false;
  return flag;
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
    if (sgemm_ != nullptr && !use_aten_gemm()) {
      sgemm_(&cb, &ca, &N, &M, &K, &alpha, b, &LB, a, &LA, &beta, c, &LC);
      return;
    }
  } else {
    if (dgemm_ != nullptr && !use_aten_gemm()) {
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
