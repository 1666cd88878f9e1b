// Row operations on one tile of scores, in the accumulation type (float; double for the
// tests' exactness checks): the online softmax's max, exp-and-sum and rescale, and the
// softmax backward. The float ones are compiled per instruction set (vec.h).
#pragma once

#include <cmath>

#include "vec.h"

namespace attnlab {

// max of x[0..n); -inf when n == 0 (NaN is skipped: callers check for it, see any_nan).
ATTNLAB_PER_ISA static float row_max(const float* x, int64_t n) {
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
ATTNLAB_PER_ISA static float exp_shift_sum(float* x, int64_t n, float shift) {
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

ATTNLAB_PER_ISA static void scale_row(float* x, int64_t n, float a) {
  for (int64_t j = 0; j < n; ++j) x[j] *= a;
}

// dS = P * (dP - D_i), the softmax backward of one row, into p.
ATTNLAB_PER_ISA static void softmax_grad_row(float* p, const float* dp, int64_t n, float d) {
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

}  // namespace attnlab
