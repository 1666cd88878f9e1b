// The problem description and the helpers the flash forward and backward share: operand
// access in the accumulation type, mask and dropout on a tile row, the tile products and
// the scheduling of work items over threads (the key rule itself is mask.h's; when a
// busy machine makes a call take fewer workers, busy.h's).
// Included by flash_attention.cpp only.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <limits>
#include <numeric>
#include <utility>
#include <vector>

#include "blas.h"
#include "busy.h"
#include "convert.h"
#include "dropout.h"
#include "mask.h"
#include "rows.h"
#include "tile_gemm.h"

namespace attnlab {

using at::Tensor;

// Offsets of the rows of a (B, H, L, X) tensor whose last dimension is unit-stride.
struct Rows {
  int64_t sb = 0, sh = 0, sl = 0;
  explicit Rows(const Tensor& t)
      : sb(t.stride(0)), sh(t.stride(1)),
        // BLAS wants ld >= row width; a single row's stride is arbitrary.
        sl(t.size(2) <= 1 ? std::max<int64_t>(t.size(3), 1) : t.stride(2)) {}
  int64_t at(int64_t b, int64_t h, int64_t i) const { return b * sb + h * sh + i * sl; }
};

struct Problem {
  int64_t B, Hq, Hkv, G, Lq, Lk, D, Dv;
  Rule rule;          // which keys each query row sees (mask.h)
  Scores scores;      // softcap, ALiBi (mask.h)
  BlockMask blocks;   // a mask_mod's blocks, or none (mask.h)
  const double* sinks = nullptr;  // (Hq,) sink logits joining each row's softmax, or none
  double scale, dropout_p;
  uint64_t seed;
  int64_t bq, bk;
  const void* mask = nullptr;  // bool, or additive in the accumulation type
  bool mask_is_bool = false;
  int64_t m_sb = 0, m_sh = 0, m_sq = 0, m_sk = 0;

  int64_t query_blocks() const { return (Lq + bq - 1) / bq; }
  int64_t key_blocks() const { return (Lk + bk - 1) / bk; }
};

// The mask of row (b, h, i) on keys j0..j0+n, applied to the scores s (type A).
template <typename A>
void apply_mask(const Problem& P, int64_t b, int64_t h, int64_t i, int64_t j0, A* s, int64_t n) {
  const int64_t base = b * P.m_sb + h * P.m_sh + i * P.m_sq + j0 * P.m_sk;
  constexpr A NEG = -std::numeric_limits<A>::infinity();
  if (P.mask_is_bool) {
    const bool* m = static_cast<const bool*>(P.mask) + base;
    if (P.m_sk == 1) {  // the common layout: branch-free, so the loop vectorises
      for (int64_t c = 0; c < n; ++c) s[c] = m[c] ? s[c] : NEG;
    } else {
      for (int64_t c = 0; c < n; ++c) s[c] = m[c * P.m_sk] ? s[c] : NEG;
    }
  } else {
    const A* m = static_cast<const A*>(P.mask) + base;
    if (P.m_sk == 1) {
      for (int64_t c = 0; c < n; ++c) s[c] += m[c];
    } else {
      for (int64_t c = 0; c < n; ++c) s[c] += m[c * P.m_sk];
    }
  }
}

// A partial block's bool row on keys j0..j0+n of row i of (b, h) (block mask present).
template <typename A>
void apply_block_row(const Problem& P, int64_t b, int64_t h, int64_t i, int64_t j0, A* s,
                     int64_t n) {
  const BlockMask& M = P.blocks;
  const int64_t qb = i / M.block_q, kb = j0 / M.block_k;
  const bool* m = M.row(b, h, qb, kb, i - qb * M.block_q) + (j0 - kb * M.block_k);
  constexpr A NEG = -std::numeric_limits<A>::infinity();
  for (int64_t c = 0; c < n; ++c) s[c] = m[c] ? s[c] : NEG;
}

// The block mask's kind of the tile of rows [qs, ..) and keys [ks, ..) of (b, h): tiles are
// the mask's blocks whenever one is given. FULL where there is none.
inline BlockMask::Kind block_kind(const Problem& P, int64_t b, int64_t h, int64_t qs, int64_t ks) {
  const BlockMask& M = P.blocks;
  if (!M.present()) return BlockMask::FULL;
  return M.kind(b, h, qs / M.block_q, ks / M.block_k);
}

// Multiply the weights of keys j0..j0+n of row (b, h, i) by keep / (1 - p).
template <typename A>
void apply_dropout(const Problem& P, int64_t b, int64_t h, int64_t i, int64_t j0, A* s,
                   int64_t n) {
  const A kept = P.dropout_p >= 1.0 ? A(0) : A(1.0 / (1.0 - P.dropout_p));
  const uint64_t base = static_cast<uint64_t>(((b * P.Hq + h) * P.Lq + i) * P.Lk + j0);
  for (int64_t c = 0; c < n; ++c)
    s[c] *= dropout_keeps(P.seed, base + c, P.dropout_p) ? kept : A(0);
}

// Columns of a tile row outside the allowed [a, e) get weight 0 (no exp taken there).
template <typename A>
void zero_outside(A* row, int64_t a, int64_t e, int64_t n) {
  std::fill(row, row + a, A(0));
  std::fill(row + e, row + n, A(0));
}

// Whether the tiles of accumulation type A go through tile_gemm (else BLAS or ATen).
template <typename A>
bool use_tile_kernel() {
  return std::is_same_v<A, float> && gemm_path() == GemmPath::Auto && tile_gemm_supported();
}

// C (m x n) = alpha op(A) B (+ C when add); op(A) = A^T when ta (A then stored k x m),
// B's rows contiguous with leading dimension ldb.
template <typename A>
void product(bool tiles, bool ta, int64_t m, int64_t n, int64_t k, A alpha, const A* a,
             int64_t lda, const A* b, int64_t ldb, bool add, A* c, int64_t ldc) {
  if constexpr (std::is_same_v<A, float>) {
    if (tiles) {
      tile_gemm(m, n, k, alpha, a, ta ? 1 : lda, ta ? lda : 1, b, ldb, add, c, ldc);
      return;
    }
  }
  gemm_rm<A>(ta, false, m, n, k, alpha, a, lda, b, ldb, add ? A(1) : A(0), c, ldc);
}

// n rows of x (`width` wide, row stride x_ld) packed into buf's panels (grown as needed)
// for the tile kernel; returns buf's data.
template <typename S, typename A>
const A* pack_panels(const S* x, int64_t x_ld, int64_t n, int64_t width, std::vector<A>& buf) {
  const int64_t need = (n + PANEL - 1) / PANEL * PANEL * width;
  if (static_cast<int64_t>(buf.size()) < need) buf.resize(need);
  pack_transposed(x, x_ld, n, width, buf.data());
  return buf.data();
}

// A block of n rows X[0..n) (keys or values, `cols` wide) as the right operand X^T of a
// product: packed into panels for the tile kernel (pack_transposed), or the rows
// themselves in the accumulation type for BLAS (converted when stored otherwise).
template <typename A>
struct RightT {
  const A* rows = nullptr;    // BLAS: the rows, leading dimension ld
  int64_t ld = 0, cols = 0;
  const A* packed = nullptr;  // the tile kernel: cols x PANEL panels
  int64_t offset = 0;         // ... whose first row is column `offset` of the first panel

  template <typename S, typename Scratch>
  void load(const S* x, int64_t x_ld, int64_t n, int64_t width, bool tiles, Scratch& pack,
            Scratch& convert) {
    cols = width;
    offset = 0;
    if (tiles) {
      packed = pack_panels(x, x_ld, n, width, pack);
      rows = nullptr;
    } else {
      rows = rows_as_acc(x, x_ld, n, width, convert, ld);
      packed = nullptr;
    }
  }
};

// A worker's packing of one head's keys (rows [from, to) of head `head` of batch `b`),
// kept across its work items: the query blocks of a causal head read nested key ranges
// (T=4096 in blocks of 128: 128, 256, ..., 4096 keys), which were packed again for each
// block, 16x the keys of the head at T=4096. A range inside the held one is read from it
// (from any column of a panel); for any other, the keys from its start to the head's end
// are packed in its place where they fit, since a worker's later blocks of the head read
// later keys (a window's or a document's ranges do not nest), but never the keys before
// it (a short query at the end of 8000 keys packed the whole head: 0.4 -> 58 ms).
// Measured on the Zen 4 against SDPA, interleaved: causal forward T=1024 0.77x -> 0.74x,
// T=4096 0.92x -> 0.86x, forward+backward T=4096 0.82x -> 0.75x.
template <typename A>
struct HeadPack {
  std::vector<A> data;
  int64_t b = -1, head = -1, from = 0, to = 0;

  // Longer ranges are packed tile by tile (RightT::load), as before: a worker's pack
  // would pass 2 MB at head_dim 64.
  static constexpr int64_t MAX_KEYS = 8192;

  // Hold keys [lo, hi) of (b, head), a head of `keys` keys from x; returns false (nothing
  // held) for a range of over MAX_KEYS keys.
  template <typename S>
  bool hold(int64_t b_, int64_t head_, int64_t lo, int64_t hi, int64_t keys, const S* x,
            int64_t x_ld, int64_t width) {
    if (hi - lo > MAX_KEYS) return false;
    if (b_ == b && head_ == head && from <= lo && hi <= to) return true;
    if (keys - lo <= MAX_KEYS) hi = keys;
    pack_panels(x + lo * x_ld, x_ld, hi - lo, width, data);
    b = b_, head = head_, from = lo, to = hi;
    return true;
  }

  // Keys [ks, ...) of the held range as the right operand.
  void view(int64_t ks, int64_t width, RightT<A>& x) const {
    x.cols = width;
    x.packed = data.data() + (ks - from) / PANEL * width * PANEL;
    x.offset = (ks - from) % PANEL;
    x.rows = nullptr;
  }
};

// C (m x n) = alpha * A X^T for the loaded block X (n rows), A (m x cols) row-major with
// leading dimension lda.
template <typename A>
void times_transposed(int64_t m, int64_t n, A alpha, const A* a, int64_t lda, const RightT<A>& x,
                      A* c, int64_t ldc) {
  if constexpr (std::is_same_v<A, float>) {
    if (x.packed != nullptr) {  // one call per panel (or part of one)
      for (int64_t j = 0; j < n;) {
        const int64_t col = (x.offset + j) % PANEL, panel = (x.offset + j) / PANEL;
        const int64_t width = std::min(PANEL - col, n - j);
        tile_gemm(m, width, x.cols, alpha, a, lda, 1, x.packed + panel * x.cols * PANEL + col,
                  PANEL, false, c + j, ldc);
        j += width;
      }
      return;
    }
  }
  gemm_rm<A>(false, true, m, n, x.cols, alpha, a, lda, x.rows, x.ld, A(0), c, ldc);
}

// Run `work(worker, item)` over items in the given order, pulled by workers from a
// shared counter so that uneven items (causal) still keep every thread busy. One
// parallel region per call: a region is one more wait for a thread the OS may have
// given to another process (busy.h).
template <typename F>
void run_items(const std::vector<int64_t>& order, int64_t workers, const F& work) {
  std::atomic<int64_t> next{0};
  const int64_t n = static_cast<int64_t>(order.size());
  parallel_region(workers, [&](int64_t begin, int64_t end) {
    for (int64_t worker = begin; worker < end; ++worker)
      for (int64_t t = next.fetch_add(1); t < n; t = next.fetch_add(1)) work(worker, order[t]);
  });
}

// Item indices one group at a time (items [g * group, (g + 1) * group): the blocks of one
// (b, head)), each group's longest first. The workers then share a head's keys and
// values (or queries and output gradients) in cache while they work through it, where
// a global longest-first order went round every head before coming back (12 heads at
// T=4096: 24 MB of K and V cycled through the cache; 4-5% slower at two threads), and
// the last items of all, the short ends of the last head, still even out the finish.
inline std::vector<int64_t> longest_first(const std::vector<int64_t>& cost, int64_t group) {
  std::vector<int64_t> order(cost.size());
  std::iota(order.begin(), order.end(), 0);
  const auto n = static_cast<int64_t>(cost.size());
  for (int64_t g = 0; g < n; g += group)
    std::stable_sort(order.begin() + g, order.begin() + std::min(n, g + group),
                     [&](int64_t x, int64_t y) { return cost[x] > cost[y]; });
  return order;
}

// A fixed split of the items over workers, in longest_first's order, each to the least
// loaded one.
// Fixed rather than pulled from a counter so that each worker's dQ buffer sums its
// items in the same order on every run: the backward is bitwise reproducible.
template <typename F>
void run_items_fixed(const std::vector<int64_t>& cost, int64_t group, int64_t workers,
                     const F& work) {
  std::vector<std::vector<int64_t>> share(workers);
  std::vector<int64_t> load(workers, 0);
  for (int64_t item : longest_first(cost, group)) {
    const auto w = std::min_element(load.begin(), load.end()) - load.begin();
    share[w].push_back(item);
    load[w] += cost[item] + 1;
  }
  at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
    for (int64_t worker = begin; worker < end; ++worker)
      for (int64_t item : share[worker]) work(worker, item);
  });
}

}  // namespace attnlab
