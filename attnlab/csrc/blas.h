// The tile products' fallback: the BLAS torch links (MKL on x86-64 wheels), or ATen's
// product where there is none; and the switch the tests use to run each path.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <type_traits>

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

// Which routine multiplies the tiles; tests switch it to check each one (set_gemm_path).
// Auto: the AVX-512 kernel of tile_gemm.h for float where the CPU has it, else the BLAS
// torch links; Blas: always that BLAS; Aten: ATen's addmm.
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
