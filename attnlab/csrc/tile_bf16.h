// The bf16 tile products on vdpbf16ps (vec.h's Avx512Dot level): many rows (a prompt, an
// encoder's batch) times a bf16 weight packed by rows (modules/fused.py).
//
// C (m x n) = A (m x k) W^T + bias, A's rows bf16 (k contiguous, lda apart), W (n x k)
// bf16 rows (ldw apart), sums in float32. vdpbf16ps adds to each float lane the products
// of one PAIR of bf16 values, so the operands are arranged by pairs of neighbouring
// inputs:
//   - A's pair (2p, 2p + 1) of a row is one 32-bit word, broadcast to every lane;
//   - a panel of PANEL (64) outputs of W is packed pairs-major first (pack_pairs): for
//     each pair p, 64 words W[j][2p] | W[j][2p + 1] << 16, four vectors of 16 outputs.
// A block of MR rows x NV vectors of outputs stays in registers over all pairs, as in
// tile_gemm.h's float kernel (6 x 4: 24 accumulators, 4 panel vectors, one broadcast).
// Each output is rounded once, to C's type (float32 or bf16), after the bias is added.
//
// k must be even (A's last word would otherwise reach past its row); callers decline odd k.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "tile_gemm.h"
#include "vec.h"

#if defined(ATTNLAB_X86)
#include <immintrin.h>

#include <c10/util/BFloat16.h>

#define ATTNLAB_AVX512_BF16 \
  __attribute__((target("avx512f,avx512vl,avx512bw,avx512dq,avx512bf16,fma")))

namespace attnlab {

namespace tile_bf16 {

// r[c] = column c of the 16 x 16 words r[0..16) (rows in, columns out).
ATTNLAB_AVX512_BF16 inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 4; ++j) {
      t[8 * i + j] = _mm512_shuffle_i32x4(r[8 * i + j], r[8 * i + 4 + j], 0x88);
      t[8 * i + 4 + j] = _mm512_shuffle_i32x4(r[8 * i + j], r[8 * i + 4 + j], 0xdd);
    }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_i32x4(t[j], t[8 + j], 0x88);
    r[8 + j] = _mm512_shuffle_i32x4(t[j], t[8 + j], 0xdd);
  }
}

// panel[p * PANEL + j] = the pair (2p, 2p + 1) of W's row j, for the rows [0, rows) of a
// panel (rows <= PANEL; the others zero) and the pairs [0, k / 2): 16 rows x 16 pairs at
// a time, read as rows and transposed in registers.
ATTNLAB_AVX512_BF16 inline void pack_pairs(const uint16_t* w, int64_t ldw, int64_t rows,
                                           int64_t k, uint32_t* panel) {
  const int64_t pairs = k / 2;
  for (int64_t p0 = 0; p0 < pairs; p0 += 16) {
    const int64_t n = std::min<int64_t>(16, pairs - p0);
    const __mmask16 m = n == 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1u);
    for (int64_t j0 = 0; j0 < PANEL; j0 += 16) {
      __m512i r[16];
      for (int64_t i = 0; i < 16; ++i) {
        const uint16_t* row = w + (j0 + i) * ldw + 2 * p0;
        r[i] = j0 + i >= rows ? _mm512_setzero_si512()
               : n == 16      ? _mm512_loadu_si512(row)
                              : _mm512_maskz_loadu_epi32(m, row);
      }
      transpose16(r);
      for (int64_t c = 0; c < n; ++c) _mm512_storeu_si512(panel + (p0 + c) * PANEL + j0, r[c]);
    }
  }
}

template <typename C>
ATTNLAB_AVX512_BF16 inline void store(C* c, __mmask16 m, __m512 v) {
  if constexpr (std::is_same_v<C, float>) {
    _mm512_mask_storeu_ps(c, m, v);
  } else {
    _mm256_mask_storeu_epi16(c, m, (__m256i)_mm512_cvtneps_pbh(v));
  }
}

// C[i, j] = sum over pairs p of A(i, pair p) . panel(p, j) + bias[j], for the MR rows of a
// block and NV vectors of 16 outputs (the last masked).
template <int MR, int NV, bool PF, typename C>
ATTNLAB_AVX512_BF16 __attribute__((always_inline)) inline void block(
    int64_t pairs, const uint16_t* a, int64_t lda, const uint32_t* panel, __mmask16 last,
    const float* bias, C* c, int64_t ldc, const char*& pf, const char* pf_end) {
  __m512 acc[MR][NV];
#pragma GCC unroll 32
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    if (PF) fetch_ahead(pf, pf_end);
    const uint32_t* bp = panel + p * PANEL;
    __m512i bv[NV];
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) bv[j] = _mm512_loadu_si512(bp + 16 * j);
#pragma GCC unroll 32
    for (int i = 0; i < MR; ++i) {
      uint32_t word;
      __builtin_memcpy(&word, a + i * lda + 2 * p, 4);
      const __m512bh ai = (__m512bh)_mm512_set1_epi32(static_cast<int>(word));
#pragma GCC unroll 4
      for (int j = 0; j < NV; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], (__m512bh)bv[j], ai);
    }
  }
#pragma GCC unroll 4
  for (int j = 0; j < NV; ++j) {
    const __mmask16 m = j == NV - 1 ? last : __mmask16(0xFFFF);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(m, bias + 16 * j) : _mm512_setzero_ps();
#pragma GCC unroll 32
    for (int i = 0; i < MR; ++i) store(c + i * ldc + 16 * j, m, _mm512_add_ps(acc[i][j], b));
  }
}

// Rows rows (< MR) at the bottom: the same block, fewer registers.
template <int MR, int NV, bool PF, typename C>
ATTNLAB_AVX512_BF16 inline void tail(int rows, int64_t pairs, const uint16_t* a, int64_t lda,
                                     const uint32_t* panel, __mmask16 last, const float* bias,
                                     C* c, int64_t ldc, const char*& pf, const char* pf_end) {
  if constexpr (MR > 0) {
    if (rows == MR)
      block<MR, NV, PF>(pairs, a, lda, panel, last, bias, c, ldc, pf, pf_end);
    else
      tail<MR - 1, NV, PF>(rows, pairs, a, lda, panel, last, bias, c, ldc, pf, pf_end);
  }
}

// ahead, ahead_bytes: memory the caller reads next (the next band of the weight), fetched
// into L2 two lines per pair of the k loop (enough for a band of 64 rows from 17 rows of A
// on), so that it streams in while this panel is multiplied from cache instead of after.
// In bursts before each block of rows it recovered a third of the difference. PF: whether
// there is any (a template argument, as tile_gemm.h's: the loop without holds no pointers).
template <int NV, bool PF, typename C>
ATTNLAB_AVX512_BF16 inline void panel_rows(int64_t m, int64_t pairs, const uint16_t* a,
                                           int64_t lda, const uint32_t* panel, __mmask16 last,
                                           const float* bias, C* c, int64_t ldc,
                                           const char* ahead, int64_t ahead_bytes) {
  constexpr int MR = NV == 4 ? 6 : NV == 3 ? 8 : 12;
  const char* pf = ahead;
  const char* pf_end = PF ? ahead + ahead_bytes : nullptr;
  int64_t i = 0;
  for (; i + MR <= m; i += MR)
    block<MR, NV, PF>(pairs, a + i * lda, lda, panel, last, bias, c + i * ldc, ldc, pf, pf_end);
  if (i < m)
    tail<MR - 1, NV, PF>(static_cast<int>(m - i), pairs, a + i * lda, lda, panel, last, bias,
                         c + i * ldc, ldc, pf, pf_end);
}

template <int NV, typename C>
ATTNLAB_AVX512_BF16 inline void panel_rows_fetching(int64_t m, int64_t pairs, const uint16_t* a,
                                                    int64_t lda, const uint32_t* panel,
                                                    __mmask16 last, const float* bias, C* c,
                                                    int64_t ldc, const char* ahead,
                                                    int64_t ahead_bytes) {
  if (ahead != nullptr)
    panel_rows<NV, true>(m, pairs, a, lda, panel, last, bias, c, ldc, ahead, ahead_bytes);
  else
    panel_rows<NV, false>(m, pairs, a, lda, panel, last, bias, c, ldc, ahead, ahead_bytes);
}

}  // namespace tile_bf16

// C[:, 0, width) = A W_panel^T + bias for the m rows of A and one packed panel of width
// (<= PANEL) outputs; bias (width floats) may be null.
template <typename C>
ATTNLAB_AVX512_BF16 __attribute__((noinline)) inline void tile_bf16_panel(
    int64_t m, int64_t k, const uint16_t* a, int64_t lda, const uint32_t* panel, int64_t width,
    const float* bias, C* c, int64_t ldc, const void* ahead = nullptr,
    int64_t ahead_bytes = 0) {
  const int nv = static_cast<int>((width + 15) / 16);
  const __mmask16 last = static_cast<__mmask16>((1u << (width - 16 * (nv - 1))) - 1u);
  const int64_t pairs = k / 2;
  const char* next = static_cast<const char*>(ahead);
  switch (nv) {
    case 4:
      tile_bf16::panel_rows_fetching<4>(m, pairs, a, lda, panel, last, bias, c, ldc, next,
                                        ahead_bytes);
      break;
    case 3:
      tile_bf16::panel_rows_fetching<3>(m, pairs, a, lda, panel, last, bias, c, ldc, next,
                                        ahead_bytes);
      break;
    case 2:
      tile_bf16::panel_rows_fetching<2>(m, pairs, a, lda, panel, last, bias, c, ldc, next,
                                        ahead_bytes);
      break;
    default:
      tile_bf16::panel_rows_fetching<1>(m, pairs, a, lda, panel, last, bias, c, ldc, next,
                                        ahead_bytes);
      break;
  }
}

}  // namespace attnlab

#endif

#if !defined(ATTNLAB_X86)
namespace attnlab {
namespace tile_bf16 {
inline void pack_pairs(const uint16_t*, int64_t, int64_t, int64_t, uint32_t*) {}
}  // namespace tile_bf16
template <typename C>
inline void tile_bf16_panel(int64_t, int64_t, const uint16_t*, int64_t, const uint32_t*, int64_t,
                            const float*, C*, int64_t, const void* = nullptr, int64_t = 0) {}
}  // namespace attnlab
#endif
