// The bf16 one-row products on vdpbf16ps (vec.h's Avx512Dot level).
//
// vdpbf16ps adds to each float lane the products of one PAIR of bf16 values:
// acc[l] += a[2l] * b[2l] + a[2l+1] * b[2l+1].
//
// By rows (the layout modules/fused.py packs bf16 weights in): a row W[o, :] is already
// pairs along its inputs, and so is x as bf16 (bf16_pairs), so a row's dot product is
// 32 weights a vdpbf16ps with nothing rearranged. This streams a weight at about the
// speed of a plain read of memory, where the columns' loop below reaches about three
// quarters of it (one Zen 5 core, SmolLM-135M's matrices).
//
// By columns: a weight packed (in, out) holds W[i, :] and W[i + 1, :] as two rows, so two
// rows are interleaved as they are read (vpunpck{l,h}wd: 32 outputs of two rows -> two
// vectors of 16 output pairs), and x[i], x[i + 1] is one 32-bit pair broadcast to every
// lane. The unpacks work
// within 128-bit lanes, so a chunk of 32 outputs comes out in "pair order": the low
// vector holds outputs {0-3, 8-11, 16-19, 24-27}, the high one {4-7, 12-15, 20-23,
// 28-31}; the partial output stays in that order until bf16_dot_order puts it back.
// x is rounded to bf16 (the instruction multiplies bf16 by bf16), sums are float32.
//
// bf16_dot_active() says whether this path runs: the CPU has it and the tests' switch
// (set_dot_products) allows it; row_product.h's template loops run otherwise.
#pragma once

#include <ATen/ATen.h>

#include <atomic>
#include <cstdint>
#include <vector>

#include "convert.h"

namespace attnlab {

// The tests' switch: false runs the portable loops even where the CPU has the dot
// products (set_dot_products in products.cpp).
inline std::atomic<bool>& dot_products_allowed() {
  static std::atomic<bool> allowed{true};
  return allowed;
}

inline bool dot_products_active() {
  return cpu_level() >= Level::Avx512Dot && dot_products_allowed().load();
}

inline bool bf16_dot_active() {
#if defined(ATTNLAB_X86)
  return dot_products_active();
#else
  return false;
#endif
}

// Floats a partial output of n outputs takes in pair order (whole chunks of 32).
inline int64_t bf16_dot_width(int64_t n) { return (n + 31) / 32 * 32; }

// x as bf16 pairs: pairs[p] = bf16(x[2p]) | bf16(x[2p + 1]) << 16 (0 past the end).
inline std::vector<uint32_t> bf16_pairs(const float* x, int64_t n) {
  std::vector<uint32_t> pairs((n + 1) / 2);
  for (int64_t i = 0; i < n; ++i)
    pairs[i / 2] |= uint32_t(c10::BFloat16(x[i]).x) << (16 * (i % 2));
  return pairs;
}

// acc[0, bf16_dot_width(n)) from pair order back to output order, in place.
inline void bf16_dot_order(float* acc, int64_t n) {
  float chunk[32];
  for (int64_t c = 0; c < n; c += 32) {
    for (int l = 0; l < 4; ++l)
      for (int j = 0; j < 4; ++j) {
        chunk[8 * l + j] = acc[c + 4 * l + j];
        chunk[8 * l + 4 + j] = acc[c + 16 + 4 * l + j];
      }
    std::copy(chunk, chunk + 32, acc + c);
  }
}

}  // namespace attnlab

#if defined(ATTNLAB_X86)
#include <immintrin.h>

#define ATTNLAB_AVX512_DOT \
  __attribute__((target("avx512f,avx512vl,avx512bw,avx512dq,avx512bf16,avx512vnni,fma")))

namespace attnlab {

// 32 bf16 values at q; Tail: only those of the mask tail (a masked load runs at half the
// speed of a plain one here, so only the last chunk of a row takes one).
template <bool Tail>
ATTNLAB_AVX512_DOT inline __m512i bf16_load(const uint16_t* q, __mmask32 tail) {
  if constexpr (Tail) return _mm512_maskz_loadu_epi16(tail, q);
  return _mm512_loadu_si512(q);
}

// One chunk of 32 outputs of P pairs of rows (Tail: the last, n_out % 32 of them):
// acc[c, c + 32) += the pairs' products.
template <int P, bool Tail>
ATTNLAB_AVX512_DOT inline void bf16_pair_chunk(const uint16_t* const* r, const __m512i* xv,
                                               int64_t c, __mmask32 tail, float* acc) {
  __m512 lo = _mm512_loadu_ps(acc + c), hi = _mm512_loadu_ps(acc + c + 16);
#pragma GCC unroll 4
  for (int p = 0; p < P; ++p) {
    const __m512i a = bf16_load<Tail>(r[2 * p] + c, tail);
    const __m512i b =
        r[2 * p + 1] ? bf16_load<Tail>(r[2 * p + 1] + c, tail) : _mm512_setzero_si512();
    lo = _mm512_dpbf16_ps(lo, (__m512bh)_mm512_unpacklo_epi16(a, b), (__m512bh)xv[p]);
    hi = _mm512_dpbf16_ps(hi, (__m512bh)_mm512_unpackhi_epi16(a, b), (__m512bh)xv[p]);
  }
  _mm512_storeu_ps(acc + c, lo);
  _mm512_storeu_ps(acc + c + 16, hi);
}

// Rows [i, i + 2P) of W in P pairs (the last row of an odd i1 paired with zeros), every
// chunk of 32 outputs: P pairs of row streams advance side by side, the partial loaded
// and stored once per chunk.
template <int P>
ATTNLAB_AVX512_DOT inline void bf16_pair_rows(const uint16_t* w, int64_t ld,
                                              const uint32_t* pairs, int64_t n_out, int64_t i,
                                              int64_t i1, float* acc) {
  const int64_t rem = n_out % 32;
  const __mmask32 tail = rem ? (__mmask32(1) << rem) - 1 : ~__mmask32(0);
  __m512i xv[P];
  const uint16_t* r[2 * P];
  for (int p = 0; p < P; ++p) {
    xv[p] = _mm512_set1_epi32(static_cast<int>(pairs[i / 2 + p]));
    r[2 * p] = w + (i + 2 * p) * ld;
    r[2 * p + 1] = i + 2 * p + 1 < i1 ? r[2 * p] + ld : nullptr;
  }
  int64_t c = 0;
  for (; c + 32 <= n_out; c += 32) bf16_pair_chunk<P, false>(r, xv, c, tail, acc);
  if (rem) bf16_pair_chunk<P, true>(r, xv, c, tail, acc);
}

// y[r * ldy + o] = W[o, :] . x_r (+ bias, residual) for o in [o0, o1) and the R rows x_r
// (bf16 bits, row r at x + r * ldx; as bf16_pairs for R = 1), W (out, in) bf16 bits with
// row stride ld; residual only for R = 1. One row of W after another, two chains of sums
// per row of x, each load of W serving the R rows of x: the rows of a packed block follow
// one another in memory, so the product reads one stream, where eight rows of W side by
// side (eight streams) ran 10-18% slower (interleaved rounds, one Zen 5 core, SmolLM-135M's
// matrices). A prompt's few rows (R = 4) share each pass over W from cache.
template <int R>
ATTNLAB_AVX512_DOT static void dots_bf16_dot(const uint16_t* w, int64_t ld, const uint16_t* x,
                                             int64_t ldx, int64_t n_in, int64_t o0, int64_t o1,
                                             const float* bias, const float* residual, float* y,
                                             int64_t ldy) {
  const int64_t rem = n_in % 32;
  const __mmask32 tail = rem ? (__mmask32(1) << rem) - 1 : ~__mmask32(0);
  for (int64_t o = o0; o < o1; ++o) {
    const uint16_t* row = w + o * ld;
    __m512 a0[R], a1[R];
    for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm512_setzero_ps();
    int64_t i = 0;
    // Plain loads: a masked load runs at half the speed here.
    for (; i + 64 <= n_in; i += 64) {
      if constexpr (R == 1) {  // decoding: the weight read once per token (vec.h)
        stream_hint(row + i);
        stream_hint(row + i + 32);
      }
      const __m512i w0 = _mm512_loadu_si512(row + i), w1 = _mm512_loadu_si512(row + i + 32);
      for (int r = 0; r < R; ++r) {
        a0[r] = _mm512_dpbf16_ps(a0[r], (__m512bh)w0,
                                 (__m512bh)_mm512_loadu_si512(x + r * ldx + i));
        a1[r] = _mm512_dpbf16_ps(a1[r], (__m512bh)w1,
                                 (__m512bh)_mm512_loadu_si512(x + r * ldx + i + 32));
      }
    }
    if (i + 32 <= n_in) {
      const __m512i w0 = _mm512_loadu_si512(row + i);
      for (int r = 0; r < R; ++r)
        a0[r] = _mm512_dpbf16_ps(a0[r], (__m512bh)w0,
                                 (__m512bh)_mm512_loadu_si512(x + r * ldx + i));
      i += 32;
    }
    if (rem) {
      const __m512i w1 = _mm512_maskz_loadu_epi16(tail, row + i);
      for (int r = 0; r < R; ++r)
        a1[r] = _mm512_dpbf16_ps(a1[r], (__m512bh)w1,
                                 (__m512bh)_mm512_maskz_loadu_epi16(tail, x + r * ldx + i));
    }
    for (int r = 0; r < R; ++r) {
      const float s = _mm512_reduce_add_ps(_mm512_add_ps(a0[r], a1[r]));
      y[r * ldy + o] = s + (bias ? bias[o] : 0.0f) + (residual ? residual[o] : 0.0f);
    }
  }
}

// acc (pair order, bf16_dot_width(n_out) floats) += sum over i in [i0, i1) of
// x[i] * W[i, :], W (in, out) bf16 bits with row stride ld; i0 even; pairs as
// bf16_pairs.
ATTNLAB_AVX512_DOT static void axpys_bf16_dot(const uint16_t* w, int64_t ld,
                                              const uint32_t* pairs, int64_t n_out,
                                              int64_t i0, int64_t i1, float* acc) {
  int64_t i = i0;
  for (; i + 8 <= i1; i += 8) bf16_pair_rows<4>(w, ld, pairs, n_out, i, i1, acc);
  for (; i < i1; i += 2) bf16_pair_rows<1>(w, ld, pairs, n_out, i, i1, acc);
}

}  // namespace attnlab

#else

namespace attnlab {
inline void axpys_bf16_dot(const uint16_t*, int64_t, const uint32_t*, int64_t, int64_t,
                           int64_t, float*) {}
template <int R>
inline void dots_bf16_dot(const uint16_t*, int64_t, const uint16_t*, int64_t, int64_t, int64_t,
                          int64_t, const float*, const float*, float*, int64_t) {}
}  // namespace attnlab

#endif
