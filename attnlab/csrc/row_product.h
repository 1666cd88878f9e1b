// One row times a weight matrix, streamed: the products of decoding one sequence.
//
// Decoding one token reads every weight once, so each product is a stream of the
// matrix through memory with two FMAs per float loaded. The BLAS torch links
// (MKL) reaches 20-30 GB/s on these one-row products on the 2-core Zen 5 this
// was tuned on; a plain two-thread read of memory, 50 GB/s. The loops here read
// the matrix in order, each thread a contiguous band of it, and reach 45-55 GB/s.
//
// y (n_out) = residual + bias + W x, with W given as the (n_out, n_in) weight of
// an nn.Linear in either storage:
//   - rows:    W[o][i] at w[o * ld + i] (the usual layout, and modules/fused.py's packed
//              bf16 blocks): a thread takes a band of outputs, one dot product after
//              another (bf16 on vdpbf16ps: dot_bf16.h);
//   - columns: W[o][i] at w[i * ld + o] (modules/fused.py's packed (in, out) blocks):
//              a thread takes a band of inputs and sums x[i] * W[i, :] over it, one row
//              after another, into its own partial output; the partials are added.
// The weights are float32 or bf16 (S): the loops are templates on S, reading through
// convert.h's load16. A bf16 product multiplies bf16 by bf16 (x is rounded to bf16
// first, as vdpbf16ps does) and sums in float32; on a CPU with the bf16 dot product
// (vec.h's Avx512Dot) it runs dot_bf16.h's vdpbf16ps loops, elsewhere these.
// The loops are compiled per instruction set (ATTNLAB_PER_ISA) and picked at load time.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#include "busy.h"
#include "convert.h"
#include "dot_bf16.h"
#include "rows.h"

namespace attnlab {

// Bias and residual added to a finished output element (either may be null).
ATTNLAB_INLINE float plus(float s, const float* bias, const float* residual, int64_t o) {
  return s + (bias ? bias[o] : 0.0f) + (residual ? residual[o] : 0.0f);
}

// y[o] = W[o, :] . x (+ bias, residual) for o in [o0, o1), W stored by rows: one row of W
// after another, four chains of sums a row. The rows of a matrix follow one another in
// memory, so the product reads one stream; four rows side by side (four streams, 2.3 KB
// apart for a 576-wide row) streamed SmolLM-135M's float32 matrices at 60% of a plain read
// of them on one Zen 4 core, one row at a time at about 80%, and float32 decoding ran
// 1.19x-1.20x the tokens/s (interleaved in one process, one thread; neutral at two). The
// non-temporal hint of dot_bf16.h's loop cost 9-13% of that here (vec.h).
template <typename S>
ATTNLAB_PER_ISA static void dots(const S* w, int64_t ld, const float* x, int64_t n_in,
                                int64_t o0, int64_t o1, const float* bias,
                                const float* residual, float* y) {
  for (int64_t o = o0; o < o1; ++o) {
    const S* wo = w + o * ld;
    f16v a0{}, a1{}, a2{}, a3{};
    int64_t i = 0;
    for (; i + 64 <= n_in; i += 64) {
      a0 += load16(wo + i) * load16(x + i);
      a1 += load16(wo + i + 16) * load16(x + i + 16);
      a2 += load16(wo + i + 32) * load16(x + i + 32);
      a3 += load16(wo + i + 48) * load16(x + i + 48);
    }
    for (; i + 16 <= n_in; i += 16) a0 += load16(wo + i) * load16(x + i);
    float s = sum16((a0 + a1) + (a2 + a3));
    for (; i < n_in; ++i) s += float(wo[i]) * x[i];
    y[o] = plus(s, bias, residual, o);
  }
}

// y[r * ldy + o] = W[o, :] . x_r (+ bias) for o in [o0, o1) and the R rows x_r (at
// x + r * ldx), W float32 stored by rows: each load of W serves the R rows, one chain of
// sums a row (a batch being decoded: the rows after the first R read W from cache).
template <int R>
ATTNLAB_PER_ISA static void dots_rows(const float* w, int64_t ld, const float* x, int64_t ldx,
                                     int64_t n_in, int64_t o0, int64_t o1, const float* bias,
                                     float* y, int64_t ldy) {
  for (int64_t o = o0; o < o1; ++o) {
    const float* wo = w + o * ld;
    f16v a[R] = {};
    int64_t i = 0;
    for (; i + 16 <= n_in; i += 16) {
      const f16v wv = load16(wo + i);
      for (int r = 0; r < R; ++r) a[r] += wv * load16(x + r * ldx + i);
    }
    for (int r = 0; r < R; ++r) {
      float s = sum16(a[r]);
      for (int64_t j = i; j < n_in; ++j) s += wo[j] * x[r * ldx + j];
      y[r * ldy + o] = plus(s, bias, nullptr, o);
    }
  }
}

// acc[0, n_out) += sum over i in [i0, i1) of x[i] * W[i, :], W stored by columns (rows of
// the (in, out) block): one row of the block after another, one stream (as dots).
template <typename S>
ATTNLAB_PER_ISA static void axpys(const S* w, int64_t ld, const float* x, int64_t n_out,
                                 int64_t i0, int64_t i1, float* acc) {
  for (int64_t i = i0; i < i1; ++i) {
    const S* wi = w + i * ld;
    const float xi = x[i];
    int64_t j = 0;
    for (; j + 64 <= n_out; j += 64) {
      store16(acc + j, load16(acc + j) + load16(wi + j) * xi);
      store16(acc + j + 16, load16(acc + j + 16) + load16(wi + j + 16) * xi);
      store16(acc + j + 32, load16(acc + j + 32) + load16(wi + j + 32) * xi);
      store16(acc + j + 48, load16(acc + j + 48) + load16(wi + j + 48) * xi);
    }
    for (; j + 16 <= n_out; j += 16) store16(acc + j, load16(acc + j) + load16(wi + j) * xi);
    for (; j < n_out; ++j) acc[j] += float(wi[j]) * xi;
  }
}

// y = residual + the sum of the count partial outputs + bias (residual, bias may be
// null; y may alias residual): vector loops, one pass per term.
ATTNLAB_PER_ISA static void add_parts(float* y, const float* const* parts, int64_t count,
                                     int64_t n, const float* bias, const float* residual) {
  if (count == 0) {
    for (int64_t j = 0; j < n; ++j) y[j] = residual ? residual[j] : 0.0f;
  } else if (residual != nullptr) {
    for (int64_t j = 0; j < n; ++j) y[j] = residual[j] + parts[0][j];
  } else {
    std::memcpy(y, parts[0], n * sizeof(float));
  }
  for (int64_t t = 1; t < count; ++t)
    for (int64_t j = 0; j < n; ++j) y[j] += parts[t][j];
  if (bias != nullptr)
    for (int64_t j = 0; j < n; ++j) y[j] += bias[j];
}

// Below this many weights one thread streams the matrix before a second one wakes.
constexpr int64_t ROW_PRODUCT_PARALLEL_MIN = int64_t{1} << 15;

// Pieces a product is cut into, taken by the threads from a counter as each finishes
// the last: an even split in halves left one thread waiting for the other at the end
// of most products (two vCPUs that do not stream equally fast).
constexpr int64_t ROW_PRODUCT_PIECES = 16;

// Threads for a product of `weights` weights (rows times the matrix's): 1 below
// ROW_PRODUCT_PARALLEL_MIN, else up to 8, fewer while the machine is seen busy (busy.h's
// workers_for: a token's hundred-odd products each end at a barrier, and beside a busy
// process per core two threads decoded SmolLM2-135M greedily at 6-19 tokens/s where one
// made 30-35, 64 tokens after 32).
inline int64_t product_threads(int64_t weights) {
  return weights < ROW_PRODUCT_PARALLEL_MIN
             ? 1
             : std::min<int64_t>(workers_for(2.0 * double(weights)), 8);
}

// Pieces a product of `weights` weights is cut into: by its shape and torch's thread
// count, never by the threads that take them (fewer on a busy machine, and in any order),
// so neither are the bits of a product by columns, whose pieces' partials are added in
// piece order (threads that each summed the pieces they pulled had given 41 distinct
// results in 300 calls at two threads). At one torch thread one piece: its single partial
// stays in the first-level cache (16 pieces cost 2-7% of a token there).
inline int64_t product_pieces(int64_t weights) {
  return weights < ROW_PRODUCT_PARALLEL_MIN || at::get_num_threads() == 1 ? 1
                                                                          : ROW_PRODUCT_PIECES;
}

// The bf16 product's x: rounded to bf16 (the loops above), or as bf16 pairs (dot_bf16.h).
struct Bf16Row {
  std::vector<float> rounded;
  std::vector<uint32_t> pairs;
};

// y = residual + bias + W x (residual, bias may be null; y may alias residual); W float32
// or bf16 (S).
template <typename S>
void row_product(const float* x, const S* w, int64_t ld, bool by_rows, int64_t n_in,
                 int64_t n_out, const float* bias, const float* residual, float* y) {
  constexpr bool bf16 = std::is_same_v<S, c10::BFloat16>;
  const bool dot = bf16 && bf16_dot_active();
  Bf16Row row;
  if constexpr (bf16) {
    if (dot) {
      row.pairs = bf16_pairs(x, n_in);
    } else {
      row.rounded.resize(n_in);
      for (int64_t i = 0; i < n_in; ++i) row.rounded[i] = bf16_rounded(x[i]);
      x = row.rounded.data();
    }
  }
  const int64_t threads = product_threads(n_in * n_out);
  const int64_t pieces = product_pieces(n_in * n_out);
  std::atomic<int64_t> next{0};
  if (by_rows) {  // a piece is a band of outputs
    parallel_region(threads, [&](int64_t, int64_t) {
      for (int64_t k = next.fetch_add(1); k < pieces; k = next.fetch_add(1)) {
        const int64_t o0 = n_out * k / pieces, o1 = n_out * (k + 1) / pieces;
        if constexpr (bf16) {
          if (dot) {
            dots_bf16_dot<1>(reinterpret_cast<const uint16_t*>(w), ld,
                             reinterpret_cast<const uint16_t*>(row.pairs.data()), 0, n_in, o0,
                             o1, bias, residual, y, 0);
            continue;
          }
        }
        dots(w, ld, x, n_in, o0, o1, bias, residual, y);
      }
    });
    return;
  }
  // A piece is a band of inputs, summed into its own partial output (owned by this call:
  // right under any threading backend, and under calls from several Python threads at
  // once); the partials are added in piece order. The dot loop takes its inputs in pairs
  // and keeps its partial in pair order (dot_bf16.h), put back in order after.
  const int64_t width = dot ? bf16_dot_width(n_out) : n_out;
  const int64_t steps = dot ? (n_in + 1) / 2 : n_in;  // a piece starts on an even input
  std::vector<float> partial(pieces * width, 0.0f);
  std::vector<const float*> parts(pieces);
  for (int64_t k = 0; k < pieces; ++k) parts[k] = partial.data() + k * width;
  parallel_region(threads, [&](int64_t, int64_t) {
    for (int64_t k = next.fetch_add(1); k < pieces; k = next.fetch_add(1)) {
      float* acc = partial.data() + k * width;
      const int64_t i0 = steps * k / pieces, i1 = steps * (k + 1) / pieces;
      if constexpr (bf16) {
        if (dot) {
          axpys_bf16_dot(reinterpret_cast<const uint16_t*>(w), ld, row.pairs.data(), n_out,
                         2 * i0, std::min(2 * i1, n_in), acc);
          continue;
        }
      }
      axpys(w, ld, x, n_out, i0, i1, acc);
    }
  });
  if (dot)
    for (int64_t k = 0; k < pieces; ++k) bf16_dot_order(partial.data() + k * width, n_out);
  add_parts(y, parts.data(), pieces, n_out, bias, residual);
}

}  // namespace attnlab
