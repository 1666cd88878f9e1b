// The float tile products of the flash kernel on CPUs with AVX-512.
//
// Why our own: the BLAS torch links (MKL) takes its AVX2 path on non-Intel CPUs,
// about 100 GFLOP/s a core on the Zen 5 this was tuned on, where 512-bit FMAs
// peak near 240. torch's own CPU attention multiplies its tiles through that same
// BLAS. The tiles are small (k = head_dim or a tile's rows), so a register-blocked
// kernel with no packing of A needs none of BLAS's machinery.
//
// One routine: C (m x n) = alpha * A (m x k) B (k x n) [+ C], where
//   - A is read element by element, A(i, p) = a[i * a_rs + p * a_cs], so A or A^T
//     of a row-major tile is the same call;
//   - B's row p is contiguous: b + p * ldb, n floats (a K^T or V^T operand is packed
//     into that form first, see pack_transposed);
//   - C is row-major with leading dimension ldc.
// The block of MR rows x NV vectors of 16 columns stays in registers over the whole
// k loop; the last vector of a row is masked, so any n works.
//
// Compiled for x86-64 (GCC or Clang) with its functions' AVX-512 target (vec.h's level
// Avx512); callers check tile_gemm_supported() at run time and otherwise use BLAS.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "vec.h"

namespace attnlab {

// Width of a packed panel: keys per row of a packed K^T (or V^T) panel.
constexpr int64_t PANEL = 64;

inline bool tile_gemm_supported() { return cpu_level() >= Level::Avx512; }

}  // namespace attnlab

#if defined(ATTNLAB_X86)
#include <immintrin.h>

#define ATTNLAB_AVX512 __attribute__((target("avx512f,avx512vl,avx512dq,avx512bw,fma")))

namespace attnlab {

namespace tile {

template <int MR, int NV, bool PF>
ATTNLAB_AVX512 __attribute__((always_inline)) inline void block(int64_t k, const float* a, int64_t a_rs,
                                                 int64_t a_cs, const float* b, int64_t ldb,
                                                 __mmask16 last, float alpha, bool add,
                                                 float* c, int64_t ldc, const float* pf,
                                                 int pf_nv, int64_t pf_row, int64_t pf_step) {
  __m512 acc[MR][NV];
#pragma GCC unroll 32
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t p = 0; p < k; ++p) {
    const float* bp = b + p * ldb;
    const float* ap = a + p * a_cs;
    // One row of the next panel (see panel(), prefetched_or_not()), into L2: a panel of a
    // weight is k x 256 bytes (147 KB at k = 576), three times Zen 4's L1, so fetching it
    // into L1 (T0) evicted the panel being multiplied. 425 MB of SmolLM-shaped weights
    // by columns, cold, one thread: 32 rows 93 -> 73 ms (warm 68), 8 rows 56 -> 27 ms.
    if (PF && p == pf_row) {
      for (int j = 0; j < pf_nv; ++j)
        _mm_prefetch(reinterpret_cast<const char*>(pf + p * ldb + 16 * j), _MM_HINT_T1);
      pf_row += pf_step;
    }
    __m512 bv[NV];
#pragma GCC unroll 4
    for (int j = 0; j < NV - 1; ++j) bv[j] = _mm512_loadu_ps(bp + 16 * j);
    bv[NV - 1] = _mm512_maskz_loadu_ps(last, bp + 16 * (NV - 1));
#pragma GCC unroll 32
    for (int i = 0; i < MR; ++i) {
      const __m512 ai = _mm512_set1_ps(ap[i * a_rs]);
#pragma GCC unroll 4
      for (int j = 0; j < NV; ++j) acc[i][j] = _mm512_fmadd_ps(ai, bv[j], acc[i][j]);
    }
  }
  const __m512 va = _mm512_set1_ps(alpha);
#pragma GCC unroll 32
  for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) {
      const __mmask16 m = j == NV - 1 ? last : __mmask16(0xFFFF);
      float* cp = c + i * ldc + 16 * j;
      const __m512 r = add ? _mm512_fmadd_ps(acc[i][j], va, _mm512_maskz_loadu_ps(m, cp))
                           : _mm512_mul_ps(acc[i][j], va);
      _mm512_mask_storeu_ps(cp, m, r);
    }
  }
}

// Rows rows (< MR) at the bottom of a panel: the same block, fewer registers.
template <int MR, int NV, bool PF>
ATTNLAB_AVX512 inline void tail(int rows, int64_t k, const float* a, int64_t a_rs, int64_t a_cs,
                 const float* b, int64_t ldb, __mmask16 last, float alpha, bool add,
                 float* c, int64_t ldc, const float* pf, int pf_nv, int64_t pf_row,
                 int64_t pf_step) {
  if constexpr (MR > 0) {
    if (rows == MR) {
      block<MR, NV, PF>(k, a, a_rs, a_cs, b, ldb, last, alpha, add, c, ldc, pf, pf_nv, pf_row,
                    pf_step);
    } else {
      tail<MR - 1, NV, PF>(rows, k, a, a_rs, a_cs, b, ldb, last, alpha, add, c, ldc, pf, pf_nv,
                       pf_row, pf_step);
    }
  }
}

// All rows of one panel of NV vectors: MR x NV accumulators plus NV B vectors and
// one broadcast fit the 32 registers (6 x 4, 8 x 3, 12 x 2, 12 x 1).
// pf: the next panel's B (or null), pf_nv its vectors of 16: the row blocks share the
// prefetch of its rows, block i taking rows i, i + blocks, ..., so the next panel
// streams in from memory while this one is multiplied.
template <int NV, bool PF>
ATTNLAB_AVX512 inline void panel(int64_t m, int64_t k, const float* a, int64_t a_rs, int64_t a_cs,
                  const float* b, int64_t ldb, __mmask16 last, float alpha, bool add,
                  float* c, int64_t ldc, const float* pf, int pf_nv) {
  constexpr int MR = NV == 4 ? 6 : NV == 3 ? 8 : 12;
  const int64_t blocks = (m + MR - 1) / MR;
  int64_t i = 0;
  for (; i + MR <= m; i += MR)
    block<MR, NV, PF>(k, a + i * a_rs, a_rs, a_cs, b, ldb, last, alpha, add, c + i * ldc, ldc, pf,
                  pf_nv, i / MR, blocks);
  if (i < m)
    tail<MR - 1, NV, PF>(static_cast<int>(m - i), k, a + i * a_rs, a_rs, a_cs, b, ldb, last, alpha,
                     add, c + i * ldc, ldc, pf, pf_nv, i / MR, blocks);
}

// panel<NV, PF> with PF = whether there is a next panel to prefetch. The prefetch is a
// template argument, not a test on pf inside the k loop: its pointers and counters
// were held through the loop even where pf is null, and the register allocator then
// spilled two of the four B vectors to the stack (12 of 24 FMAs of the 6 x 4 block
// reading memory). Without them: 3-7% off the flash forward and backward at one
// thread (A/B against the spilling build, T=256-4096).
template <int NV>
ATTNLAB_AVX512 inline void prefetched_or_not(int64_t m, int64_t k, const float* a, int64_t a_rs,
                                             int64_t a_cs, const float* b, int64_t ldb,
                                             __mmask16 last, float alpha, bool add, float* c,
                                             int64_t ldc, const float* pf, int pf_nv) {
  if (pf != nullptr)
    panel<NV, true>(m, k, a, a_rs, a_cs, b, ldb, last, alpha, add, c, ldc, pf, pf_nv);
  else
    panel<NV, false>(m, k, a, a_rs, a_cs, b, ldb, last, alpha, add, c, ldc, pf, pf_nv);
}

}  // namespace tile

// C = alpha * A B (+ C when add), the layout of the file comment.
// prefetch: B is read from memory (a weight, not a packed tile): each panel of 64
// columns fetches the next one's rows ahead (B's rows are ldb apart, too far for the
// hardware's prefetchers to follow). after, after_n: the last panel fetches these
// after_n columns (k rows, ldb apart) instead: the caller's next call reads them.
ATTNLAB_AVX512 __attribute__((noinline)) inline void tile_gemm(int64_t m, int64_t n, int64_t k, float alpha,
                                                const float* a, int64_t a_rs, int64_t a_cs,
                                                const float* b, int64_t ldb, bool add, float* c,
                                                int64_t ldc, bool prefetch = false,
                                                const float* after = nullptr,
                                                int64_t after_n = 0) {
  if (m <= 0 || n <= 0) return;
  if (k <= 0) {  // an empty sum: C = 0 (or unchanged)
    if (!add)
      for (int64_t i = 0; i < m; ++i)
        for (int64_t j = 0; j < n; ++j) c[i * ldc + j] = 0.0f;
    return;
  }
  for (int64_t j = 0; j < n; j += 64) {
    const int64_t w = n - j < 64 ? n - j : 64;
    const int nv = static_cast<int>((w + 15) / 16);
    const __mmask16 last = static_cast<__mmask16>((1u << (w - 16 * (nv - 1))) - 1u);
    const float* bj = b + j;
    const bool inside = j + 64 < n;
    const float* pf = inside ? (prefetch ? bj + 64 : nullptr) : after_n > 0 ? after : nullptr;
    const int64_t next = pf == nullptr ? 0 : std::min<int64_t>(64, inside ? n - j - 64 : after_n);
    const int pf_nv = static_cast<int>((next + 15) / 16);
    float* cj = c + j;
    switch (nv) {
      case 4:
        tile::prefetched_or_not<4>(m, k, a, a_rs, a_cs, bj, ldb, last, alpha, add, cj, ldc, pf, pf_nv);
        break;
      case 3:
        tile::prefetched_or_not<3>(m, k, a, a_rs, a_cs, bj, ldb, last, alpha, add, cj, ldc, pf, pf_nv);
        break;
      case 2:
        tile::prefetched_or_not<2>(m, k, a, a_rs, a_cs, bj, ldb, last, alpha, add, cj, ldc, pf, pf_nv);
        break;
      default:
        tile::prefetched_or_not<1>(m, k, a, a_rs, a_cs, bj, ldb, last, alpha, add, cj, ldc, pf, pf_nv);
        break;
    }
  }
}

// x[0..16) transposed in place: x[i] lane j becomes x[j] lane i.
ATTNLAB_AVX512 __attribute__((always_inline)) inline void transpose16(__m512 x[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(x[i], x[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(x[i], x[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    for (int h = 0; h < 2; ++h) {
      const __m512d a = _mm512_castps_pd(t[i + h]), b = _mm512_castps_pd(t[i + 2 + h]);
      x[i + 2 * h] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
      x[i + 2 * h + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
    }
  }
  for (int i = 0; i < 16; i += 8) {
    for (int h = 0; h < 4; ++h) {
      t[i + h] = _mm512_shuffle_f32x4(x[i + h], x[i + 4 + h], 0x88);
      t[i + 4 + h] = _mm512_shuffle_f32x4(x[i + h], x[i + 4 + h], 0xdd);
    }
  }
  for (int h = 0; h < 8; ++h) {
    x[h] = _mm512_shuffle_f32x4(t[h], t[8 + h], 0x88);
    x[8 + h] = _mm512_shuffle_f32x4(t[h], t[8 + h], 0xdd);
  }
}

// pack_transposed for float rows: 16 x 16 blocks transposed in registers, the edges (the
// last rows of a panel, the last columns) element by element.
ATTNLAB_AVX512 inline void pack_transposed_avx512(const float* src, int64_t ld, int64_t n,
                                                  int64_t cols, float* dst) {
  for (int64_t j0 = 0; j0 < n; j0 += PANEL) {
    const int64_t w = std::min(PANEL, n - j0), w16 = w / 16 * 16, c16 = cols / 16 * 16;
    float* panel = dst + (j0 / PANEL) * cols * PANEL;
    for (int64_t jj = 0; jj < w16; jj += 16) {
      const float* rows = src + (j0 + jj) * ld;
      for (int64_t d = 0; d < c16; d += 16) {
        __m512 r[16];
        for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(rows + i * ld + d);
        transpose16(r);
        for (int i = 0; i < 16; ++i) _mm512_storeu_ps(panel + (d + i) * PANEL + jj, r[i]);
      }
      for (int64_t i = 0; i < 16; ++i)
        for (int64_t d = c16; d < cols; ++d) panel[d * PANEL + jj + i] = rows[i * ld + d];
    }
    for (int64_t jj = w16; jj < w; ++jj)
      for (int64_t d = 0; d < cols; ++d) panel[d * PANEL + jj] = src[(j0 + jj) * ld + d];
  }
}

}  // namespace attnlab

#else
namespace attnlab {
inline void tile_gemm(int64_t, int64_t, int64_t, float, const float*, int64_t, int64_t,
                      const float*, int64_t, bool, float*, int64_t, bool = false,
                      const float* = nullptr, int64_t = 0) {}
inline void pack_transposed_avx512(const float*, int64_t, int64_t, int64_t, float*) {}
}  // namespace attnlab
#endif

namespace attnlab {

// dst (cols x PANEL panels) = src^T for rows [0, n) of a row-major (n x cols) block
// with row stride ld, converted to the accumulation type: panel c holds rows
// 64c..64c+63 as a (cols x PANEL) row-major matrix, so B = src^T restricted to those
// rows is read with ldb = PANEL.
template <typename S, typename A>
void pack_transposed(const S* src, int64_t ld, int64_t n, int64_t cols, A* dst) {
  if constexpr (std::is_same_v<S, float> && std::is_same_v<A, float>) {
    if (tile_gemm_supported()) return pack_transposed_avx512(src, ld, n, cols, dst);
  }
  for (int64_t j0 = 0; j0 < n; j0 += PANEL) {
    const int64_t w = n - j0 < PANEL ? n - j0 : PANEL;
    A* panel = dst + (j0 / PANEL) * cols * PANEL;
    for (int64_t jj = 0; jj < w; ++jj) {
      const S* row = src + (j0 + jj) * ld;
      for (int64_t d = 0; d < cols; ++d) panel[d * PANEL + jj] = static_cast<A>(row[d]);
    }
  }
}

}  // namespace attnlab
