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
// Two vectors of 16 a step, each with its own sum: one exp is a chain of about twenty
// dependent operations, and with one vector a step the out-of-order window could not
// overlap enough iterations to hide it: 0.67 -> 0.38 ns a value on rows of 512 (Zen 4,
// one thread), the flash forward 5-6% faster (it had spent 17% of its kernel time here).
ATTNLAB_PER_ISA static float exp_shift_sum(float* x, int64_t n, float shift) {
  f16v sum0{}, sum1{};
  int64_t j = 0;
  for (; j + 32 <= n; j += 32) {
    const f16v e0 = exp16(load16(x + j) - shift), e1 = exp16(load16(x + j + 16) - shift);
    store16(x + j, e0);
    store16(x + j + 16, e1);
    sum0 += e0;
    sum1 += e1;
  }
  f8 sum{};
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
  return sum8(fold16(sum0 + sum1) + sum);
}

ATTNLAB_PER_ISA static void scale_row(float* x, int64_t n, float a) {
  for (int64_t j = 0; j < n; ++j) x[j] *= a;
}

// dS = P * (dP - D_i), the softmax backward of one row, into p.
ATTNLAB_PER_ISA static void softmax_grad_row(float* p, const float* dp, int64_t n, float d) {
  for (int64_t j = 0; j < n; ++j) p[j] *= dp[j] - d;
}

// x = cap * tanh(x / cap) (Gemma 2's softcap), keeping tanh(x / cap) in t (or not: null).
ATTNLAB_PER_ISA static void softcap_row(float* x, int64_t n, float cap, float* t) {
  const float inv = 1.0f / cap;
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {  // one zmm with AVX-512
    const f16v th = tanh16(load16(x + j) * inv);
    if (t != nullptr) store16(t + j, th);
    store16(x + j, th * cap);
  }
  for (; j + 8 <= n; j += 8) {
    const f8 th = tanh8(load8(x + j) * inv);
    if (t != nullptr) store8(t + j, th);
    store8(x + j, th * cap);
  }
  for (; j < n; ++j) {
    const float th = std::tanh(x[j] * inv);
    if (t != nullptr) t[j] = th;
    x[j] = th * cap;
  }
}

// x[c] -= slope * |p - (j0 + c)| (ALiBi: the distance of key j0 + c from position p).
ATTNLAB_PER_ISA static void alibi_row(float* x, int64_t n, float slope, int64_t p, int64_t j0) {
  const float d0 = static_cast<float>(p - j0);
  for (int64_t c = 0; c < n; ++c) x[c] -= slope * std::fabs(d0 - static_cast<float>(c));
}

// dS = dS' * (1 - t^2): through the softcap, t = tanh(raw / cap) as softcap_row kept it.
ATTNLAB_PER_ISA static void softcap_grad_row(float* ds, const float* t, int64_t n) {
  for (int64_t j = 0; j < n; ++j) ds[j] *= 1.0f - t[j] * t[j];
}

static inline void softcap_row(double* x, int64_t n, double cap, double* t) {
  for (int64_t j = 0; j < n; ++j) {
    const double th = std::tanh(x[j] / cap);
    if (t != nullptr) t[j] = th;
    x[j] = th * cap;
  }
}

static inline void alibi_row(double* x, int64_t n, double slope, int64_t p, int64_t j0) {
  for (int64_t c = 0; c < n; ++c) x[c] -= slope * std::fabs(static_cast<double>(p - j0 - c));
}

static inline void softcap_grad_row(double* ds, const double* t, int64_t n) {
  for (int64_t j = 0; j < n; ++j) ds[j] *= 1.0 - t[j] * t[j];
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
