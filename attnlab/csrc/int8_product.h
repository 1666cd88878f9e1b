// Rows times an int8 weight: the products of an int8 model (modules/quantized.py).
//
// The scheme is llama.cpp's Q8_0: along each output's row of W (out, in), blocks of 32
// weights share one float16 scale d, and w = d * q with q = round(w / d) in [-127, 127],
// d = max|w| / 127 (symmetric, no zero point). Padded to whole blocks (zeros) and to
// whole bands of 16 outputs, W is stored for vpdpbusd (vec.h's Avx512Dot):
//   data   (bands, blocks * 512) uint8: band b, block j, group k (inputs 4k..4k+3 of the
//          block), output o of the band, input t of the group at
//          [b][j * 512 + k * 64 + o * 4 + t] = q + 128 (the unsigned operand);
//   scales (bands, blocks * 16) the float16 scales' bits, [b][j * 16 + o].
// A band is contiguous, so a product's threads each stream whole bands, and the layout of
// several products side by side (q|k|v) is their bands one after the other.
//
// x is quantised on the fly the same way, per block of 32 (llama.cpp quantises a row
// for its Q8_0 products alike): x = dx * qx. Then y[o] = sum over blocks j of
// d[o, j] * dx[j] * (sum over the block of q * qx), the inner sum exact in int32:
// vpdpbusd sums four (q + 128) * qx a lane, and starting each block's lanes at
// -128 * sum(qx) takes the 128 back out. The portable loop computes the same integers
// and the same float operations in the same order: both paths give the same bits.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "row_product.h"

namespace attnlab {

constexpr int64_t Q8_BLOCK = 32, Q8_BAND = 16, Q8_BLOCK_BYTES = Q8_BLOCK * Q8_BAND;
// Rows of x that share each pass over a band's weights (q8_band_dot).
constexpr int64_t Q8_ROWS = 4;

// Where input i of output o of a band lies in the band's data (the layout above).
inline int64_t q8_at(int64_t i, int64_t o) {
  const int64_t j = i / Q8_BLOCK, t = i % Q8_BLOCK;
  return j * Q8_BLOCK_BYTES + (t / 4) * 64 + o * 4 + t % 4;
}

// One row of x quantised per block of 32: qx (blocks * 32), dx (blocks), and
// corr[j] = -128 * sum of block j's qx.
struct QuantRow {
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int32_t> corr;
};

// llama.cpp's quantize_row_q8_0: d = max|x| / 127, q = round(x * 127 / max|x|) (ties to
// even, as its vector code rounds), zeros past n. A block holding NaN or an infinity
// gets d = NaN, so that every output it reaches is NaN (never a silent finite number).
inline void quantize_row(const float* x, int64_t n, int64_t blocks, int8_t* q, float* d,
                         int32_t* corr) {
  for (int64_t j = 0; j < blocks; ++j) {
    const int64_t lo = j * Q8_BLOCK, hi = std::min(n, lo + Q8_BLOCK);
    float amax = 0.0f;
    bool finite = true;
    for (int64_t i = lo; i < hi; ++i) {
      amax = std::max(amax, std::fabs(x[i]));
      finite &= std::isfinite(x[i]);
    }
    const float id = amax != 0.0f && finite ? 127.0f / amax : 0.0f;
    int32_t sum = 0;
    for (int64_t i = lo; i < lo + Q8_BLOCK; ++i) {
      // (a block with NaN or an infinity: q = 0, d = NaN; x * 0 would be NaN, whose
      // conversion to an integer is undefined)
      const int8_t v = i < hi && finite ? static_cast<int8_t>(std::nearbyint(x[i] * id)) : 0;
      q[i] = v;
      sum += v;
    }
    d[j] = finite ? amax / 127.0f : std::numeric_limits<float>::quiet_NaN();
    corr[j] = -128 * sum;
  }
}

// y[0, 16) of one band of W from a quantised row, the portable loop.
ATTNLAB_PER_ISA static void q8_band(const uint8_t* w, const uint16_t* scales, int64_t blocks,
                                   const int8_t* qx, const float* dx, const int32_t* corr,
                                   float* y) {
  float acc[Q8_BAND] = {};
  for (int64_t j = 0; j < blocks; ++j) {
    int32_t s[Q8_BAND];
    for (int o = 0; o < Q8_BAND; ++o) s[o] = corr[j];
    const uint8_t* wj = w + j * Q8_BLOCK_BYTES;
    const int8_t* xj = qx + j * Q8_BLOCK;
    for (int k = 0; k < 8; ++k)
      for (int o = 0; o < Q8_BAND; ++o)
        for (int t = 0; t < 4; ++t) s[o] += int32_t(wj[k * 64 + o * 4 + t]) * xj[4 * k + t];
    for (int o = 0; o < Q8_BAND; ++o) {
      const float d = float(c10::Half(scales[j * Q8_BAND + o], c10::Half::from_bits()));
      acc[o] = std::fma(float(s[o]), d * dx[j], acc[o]);
    }
  }
  for (int o = 0; o < Q8_BAND; ++o) y[o] = acc[o];
}

}  // namespace attnlab

#if defined(ATTNLAB_X86)
#include <immintrin.h>

namespace attnlab {

// quantize_row on AVX-512: the same maximum, the same products x * (127 / max) and the
// same rounding (the default mode, ties to even), so the same bytes (a block with NaN or
// an infinity: q = 0 and d = NaN in both). The scalar loop took about 2% of an int8 token
// (one Zen 5 core) and 16% of a prompt's time.
ATTNLAB_AVX512_DOT inline void quantize_row_dot(const float* x, int64_t n, int64_t blocks,
                                                int8_t* q, float* d, int32_t* corr) {
  const __m512 sign = _mm512_set1_ps(-0.0f);
  for (int64_t j = 0; j < blocks; ++j) {
    const int64_t left = n - j * Q8_BLOCK;
    const __mmask16 m0 = left >= 16 ? 0xFFFF : __mmask16((1u << left) - 1);
    const __mmask16 m1 = left >= 32 ? 0xFFFF : left > 16 ? __mmask16((1u << (left - 16)) - 1) : 0;
    const __m512 v0 = _mm512_maskz_loadu_ps(m0, x + j * Q8_BLOCK);
    const __m512 v1 = _mm512_maskz_loadu_ps(m1, x + j * Q8_BLOCK + 16);
    // 0x99: quiet NaN, +infinity, -infinity, signalling NaN
    const bool finite = !(_mm512_fpclass_ps_mask(v0, 0x99) | _mm512_fpclass_ps_mask(v1, 0x99));
    const float amax = _mm512_reduce_max_ps(
        _mm512_max_ps(_mm512_andnot_ps(sign, v0), _mm512_andnot_ps(sign, v1)));
    const __m512 id = _mm512_set1_ps(amax != 0.0f && finite ? 127.0f / amax : 0.0f);
    const __mmask16 keep = finite ? 0xFFFF : 0;  // q = 0 where d is NaN, as quantize_row
    const __m512i q0 = _mm512_maskz_cvtps_epi32(keep, _mm512_mul_ps(v0, id));
    const __m512i q1 = _mm512_maskz_cvtps_epi32(keep, _mm512_mul_ps(v1, id));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + j * Q8_BLOCK), _mm512_cvtepi32_epi8(q0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + j * Q8_BLOCK + 16), _mm512_cvtepi32_epi8(q1));
    d[j] = finite ? amax / 127.0f : std::numeric_limits<float>::quiet_NaN();
    corr[j] = -128 * _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
  }
}

// y[0, 16) of one band on vpdpbusd for each of R rows of x (row r's quantised blocks at
// r * blocks blocks, its outputs at y + r * ldy): per block, eight groups of four inputs,
// each broadcast to every lane, two int32 accumulators a row (even and odd groups:
// independent chains). The R rows share each load of the weights and their chains run
// side by side: one row alone is a chain of dependent vpdpbusd, which bound a prompt's
// rows (R = 4: SmolLM-135M's 32-token prompt 39 -> 31 ms, 512 tokens 949 -> 1276 tok/s,
// one Zen 5 core). Every row's
// integers and float operations are those of R = 1, in the same order: the same bits.
// One band at a time: the bands follow one another in memory, so a product reads one
// stream, where four bands side by side ran 3-9% slower (interleaved rounds, one Zen 5
// core).
// PF, pf, pf_end: two lines of [pf, pf_end) fetched into L2 per block, pf advanced (what
// the caller reads next; a template argument, so that the loop without holds no pointers).
template <int R, bool PF = false>
ATTNLAB_AVX512_DOT inline void q8_band_dot(const uint8_t* w, const uint16_t* scales,
                                           int64_t blocks, const int8_t* qx, const float* dx,
                                           const int32_t* corr, float* y, int64_t ldy,
                                           const char** pf = nullptr,
                                           const char* pf_end = nullptr) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t j = 0; j < blocks; ++j) {
    if (PF) fetch_ahead(*pf, pf_end);
    __m512i s[R][2];
    for (int r = 0; r < R; ++r)
      s[r][0] = _mm512_set1_epi32(corr[r * blocks + j]), s[r][1] = _mm512_setzero_si512();
    const uint8_t* wj = w + j * Q8_BLOCK_BYTES;
#pragma GCC unroll 8
    for (int k = 0; k < 8; ++k) {
      const __m512i wk = _mm512_loadu_si512(wj + k * 64);
      for (int r = 0; r < R; ++r) {
        int32_t group;
        std::memcpy(&group, qx + (r * blocks + j) * Q8_BLOCK + 4 * k, 4);
        s[r][k & 1] = _mm512_dpbusd_epi32(s[r][k & 1], wk, _mm512_set1_epi32(group));
      }
    }
    const __m512 d = _mm512_cvtph_ps(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + j * Q8_BAND)));
    for (int r = 0; r < R; ++r)
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s[r][0], s[r][1])),
                               _mm512_mul_ps(d, _mm512_set1_ps(dx[r * blocks + j])), acc[r]);
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * ldy, acc[r]);
}

// Bands [b0, b1) of `rows` (1 to Q8_ROWS) quantised rows into y: row r's 16 floats a band
// at y + r * ldy; [*pf, pf_end) fetched into L2 as they go (none where pf is null).
template <int R>
ATTNLAB_AVX512_DOT static void q8_bands_dot(const uint8_t* w, const uint16_t* scales,
                                            int64_t blocks, int64_t b0, int64_t b1,
                                            const int8_t* qx, const float* dx,
                                            const int32_t* corr, float* y, int64_t ldy,
                                            const char** pf, const char* pf_end) {
  const int64_t bb = blocks * Q8_BLOCK_BYTES, bs = blocks * Q8_BAND;
  for (int64_t b = b0; b < b1; ++b) {
    if (pf != nullptr)
      q8_band_dot<R, true>(w + b * bb, scales + b * bs, blocks, qx, dx, corr,
                           y + 16 * (b - b0), ldy, pf, pf_end);
    else
      q8_band_dot<R>(w + b * bb, scales + b * bs, blocks, qx, dx, corr, y + 16 * (b - b0), ldy);
  }
}

ATTNLAB_AVX512_DOT static void q8_rows_dot(const uint8_t* w, const uint16_t* scales,
                                           int64_t blocks, int64_t b0, int64_t b1,
                                           int64_t rows, const int8_t* qx, const float* dx,
                                           const int32_t* corr, float* y, int64_t ldy,
                                           const char** pf = nullptr,
                                           const char* pf_end = nullptr) {
  switch (rows) {
    case 1: return q8_bands_dot<1>(w, scales, blocks, b0, b1, qx, dx, corr, y, ldy, pf, pf_end);
    case 2: return q8_bands_dot<2>(w, scales, blocks, b0, b1, qx, dx, corr, y, ldy, pf, pf_end);
    case 3: return q8_bands_dot<3>(w, scales, blocks, b0, b1, qx, dx, corr, y, ldy, pf, pf_end);
    default:
      return q8_bands_dot<4>(w, scales, blocks, b0, b1, qx, dx, corr, y, ldy, pf, pf_end);
  }
}

}  // namespace attnlab

#else

namespace attnlab {
inline void q8_rows_dot(const uint8_t*, const uint16_t*, int64_t, int64_t, int64_t, int64_t,
                        const int8_t*, const float*, const int32_t*, float*, int64_t,
                        const char** = nullptr, const char* = nullptr) {}
inline void quantize_row_dot(const float*, int64_t, int64_t, int8_t*, float*, int32_t*) {}
}  // namespace attnlab

#endif

namespace attnlab {

// y (rows, n_out) = residual + bias + x (rows, n_in) W^T, W (n_out, n_in) in the layout
// above; residual (rows, n_out) and bias (n_out) may be null, y may alias residual.
// Threads take groups of four bands (64 outputs); each group runs every row, so its
// weights are read from memory once.
inline void int8_product(const float* x, int64_t rows, int64_t n_in, const uint8_t* w,
                         const uint16_t* scales, int64_t n_out, const float* bias,
                         const float* residual, float* y) {
  const int64_t blocks = (n_in + Q8_BLOCK - 1) / Q8_BLOCK;
  const int64_t bands = (n_out + Q8_BAND - 1) / Q8_BAND;
  QuantRow qx;
  qx.q.resize(rows * blocks * Q8_BLOCK);
  qx.d.resize(rows * blocks);
  qx.corr.resize(rows * blocks);
  const bool dot = dot_products_active();
  for (int64_t r = 0; r < rows; ++r)
    (dot ? quantize_row_dot : quantize_row)(x + r * n_in, n_in, blocks,
                                            qx.q.data() + r * blocks * Q8_BLOCK,
                                            qx.d.data() + r * blocks, qx.corr.data() + r * blocks);
  const int64_t groups = (bands + 3) / 4;
  const int64_t threads = std::min(product_threads(rows * n_in * n_out), groups);
  const int64_t pieces = threads == 1 ? 1 : std::min(groups, ROW_PRODUCT_PIECES);
  std::atomic<int64_t> next{0};
  parallel_region(threads, [&](int64_t, int64_t) {
    constexpr int64_t width = 4 * Q8_BAND;  // outputs of a group
    float out[Q8_ROWS * width];
    for (int64_t k = next.fetch_add(1); k < pieces; k = next.fetch_add(1)) {
      for (int64_t g = groups * k / pieces; g < groups * (k + 1) / pieces; ++g) {
        const int64_t b0 = 4 * g, b1 = std::min(bands, b0 + 4);
        // With more than one pass over the group (a prompt), the passes fetch the next
        // group's weights into L2 as they go: its read from memory and the passes from
        // cache took turns (32 rows x SmolLM-135M's matrices, one Zen 4 core: cold 30 ms,
        // warm 23). A single pass reads its group from memory anyway.
        const int64_t next_bands = g + 1 < groups * (k + 1) / pieces && rows > Q8_ROWS
                                       ? std::min(bands, b1 + 4) - b1 : 0;
        const char* pf = reinterpret_cast<const char*>(w + b1 * blocks * Q8_BLOCK_BYTES);
        const char* pf_end = pf + next_bands * blocks * Q8_BLOCK_BYTES;
        for (int64_t r0 = 0; r0 < rows; r0 += Q8_ROWS) {
          const int64_t n = std::min(Q8_ROWS, rows - r0);
          const int8_t* q = qx.q.data() + r0 * blocks * Q8_BLOCK;
          const float* d = qx.d.data() + r0 * blocks;
          const int32_t* c = qx.corr.data() + r0 * blocks;
          if (dot) {
            q8_rows_dot(w, scales, blocks, b0, b1, n, q, d, c, out, width,
                        next_bands > 0 ? &pf : nullptr, pf_end);
          } else {
            for (int64_t r = 0; r < n; ++r)
              for (int64_t b = b0; b < b1; ++b)
                q8_band(w + b * blocks * Q8_BLOCK_BYTES, scales + b * blocks * Q8_BAND,
                        blocks, q + r * blocks * Q8_BLOCK, d + r * blocks, c + r * blocks,
                        out + r * width + Q8_BAND * (b - b0));
          }
          const int64_t o1 = std::min(n_out, b1 * Q8_BAND);
          for (int64_t r = r0; r < r0 + n; ++r) {
            const float* res = residual ? residual + r * n_out : nullptr;
            for (int64_t o = b0 * Q8_BAND; o < o1; ++o)
              y[r * n_out + o] = plus(out[(r - r0) * width + o - b0 * Q8_BAND], bias, res, o);
          }
        }
      }
    }
  });
}

}  // namespace attnlab
