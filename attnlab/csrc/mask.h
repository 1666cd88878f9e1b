// THE key rule in C++: which keys [lo, hi) the query at row i may see, and what is done to
// its scores. The twin of attnlab/masks.py (key_bounds, KeyRule, Documents);
// tests/test_rule.py holds the two equal over a hypothesis sweep through the rule_tiles op.
// Included by every kernel that attends: the flash forward and backward (flash_common.h)
// and the decoding step.
//
// Query row i sits at position p = i + offset among the keys (offset = Lk - Lq: causal
// and window rules aligned to the end, what decoding with a KV cache needs; a block of a
// longer sequence passes its own). It sees key j when j <= p (causal) and p - W < j
// (window W; also j < p + W when not causal), 0 <= j < Lk. With documents (packed
// sequences) a row sees only its document's keys [start, end) and sits at its document's
// end-aligned position instead (FlashAttention's varlen alignment). Every row's keys are
// one interval and both ends are non-decreasing in i, so a block of rows sees the keys
// from its first row's lo to its last row's hi, and a tile needs no mask when its last
// row's lo and its first row's hi cover it.
#pragma once

#include <algorithm>
#include <cstdint>

#include "rows.h"

namespace attnlab {

struct Rule {
  int64_t Lk = 0;      // keys
  int64_t offset = 0;  // position of query row 0 among the keys
  bool causal = false;
  int64_t window = 0;  // 0: none
  // Documents: three planes of one int64 (3, B, Lq) tensor, per (batch element, row) its
  // document's first key, its end, and its position minus its row; null without.
  const int64_t* doc = nullptr;
  int64_t doc_sb = 0, doc_plane = 0;  // doc_sb 0: one row of ids for every batch element

  int64_t position(int64_t b, int64_t i) const {
    return doc == nullptr ? i + offset : i + doc[2 * doc_plane + b * doc_sb + i];
  }
  // Keys [lo, hi) of query row i of batch element b; hi == lo when it may see none.
  void bounds(int64_t b, int64_t i, int64_t& lo, int64_t& hi) const {
    const int64_t p = position(b, i);
    lo = 0;
    hi = Lk;
    if (causal) hi = p + 1;
    if (window > 0) {
      lo = p - window + 1;
      if (!causal) hi = p + window;
    }
    lo = std::clamp<int64_t>(lo, 0, Lk);
    hi = std::min(hi, Lk);
    if (doc != nullptr) {
      const int64_t start = doc[b * doc_sb + i], end = doc[doc_plane + b * doc_sb + i];
      lo = std::min(std::max(lo, start), end);
      hi = std::min(hi, end);
    }
    hi = std::max(hi, lo);
  }
  // Keys [lo, hi) any row of [qs, qe) may see (qe > qs).
  void block(int64_t b, int64_t qs, int64_t qe, int64_t& lo, int64_t& hi) const {
    int64_t unused;
    bounds(b, qs, lo, unused);
    bounds(b, qe - 1, unused, hi);
    hi = std::max(hi, lo);
  }
  // The end of the run of rows from i (before e) that see one document's keys: the kernels
  // give each such run tiles of its own, so that no product is spent on the keys of the
  // documents beside it (packed sentences of 14 keys in blocks of 32 rows: 3x the
  // products). e without documents.
  int64_t document_run_end(int64_t b, int64_t i, int64_t e) const {
    if (doc == nullptr) return e;
    const int64_t* start = doc + b * doc_sb;
    const int64_t* end = start + doc_plane;
    int64_t r = i + 1;
    while (r < e && start[r] == start[i] && end[r] == end[i]) ++r;
    return r;
  }
  // Whether every row of [qs, qe) may see every key of [ks, ke): no mask needed there.
  bool full(int64_t b, int64_t qs, int64_t qe, int64_t ks, int64_t ke) const {
    int64_t last_lo, first_hi, unused;
    bounds(b, qe - 1, last_lo, unused);
    bounds(b, qs, unused, first_hi);
    return last_lo <= ks && first_hi >= ke;
  }
};

// What is done to the scaled scores of a row before the mask: Gemma 2's softcap
// cap * tanh(s / cap), then ALiBi's -slope * |p - j| (FlashAttention's convention).
struct Scores {
  double softcap = 0;            // 0: none
  const double* alibi = nullptr;  // slopes: (b, h)'s at alibi[b * alibi_sb + h]
  int64_t alibi_sb = 0;

  bool any() const { return softcap > 0 || alibi != nullptr; }
  // s[0..n): scores of keys j0.. for the row at position p of (b, h); t (or null) keeps
  // tanh(s / cap) for the backward.
  template <typename A>
  void apply(int64_t b, int64_t h, int64_t p, int64_t j0, A* s, int64_t n, A* t) const {
    if (softcap > 0) softcap_row(s, n, A(softcap), t);
    if (alibi != nullptr) alibi_row(s, n, A(alibi[b * alibi_sb + h]), p, j0);
  }
};

// A mask_mod evaluated into blocks (attnlab/blockmask.py): per (b, h, query block, key
// block) of block_q x block_k, EMPTY (skipped), FULL (no mask) or PARTIAL (its bool tile,
// partial[index], masks it). The kernels then tile by block_q x block_k.
struct BlockMask {
  enum Kind : int8_t { EMPTY = 0, PARTIAL = 1, FULL = 2 };
  const int8_t* kinds = nullptr;  // (Bm, Hm, nq, nk); Bm, Hm 1 where the mask_mod ignores them
  const int64_t* index = nullptr;  // same shape: the row of partial, -1 elsewhere
  const bool* partial = nullptr;   // (P, block_q, block_k)
  int64_t sb = 0, sh = 0, nq = 0, nk = 0, block_q = 0, block_k = 0;  // sb, sh 0: broadcast

  bool present() const { return kinds != nullptr; }
  int64_t at(int64_t b, int64_t h, int64_t qb, int64_t kb) const {
    return b * sb + h * sh + qb * nk + kb;
  }
  Kind kind(int64_t b, int64_t h, int64_t qb, int64_t kb) const {
    return static_cast<Kind>(kinds[at(b, h, qb, kb)]);
  }
  // Row r of block (qb, kb)'s bool tile (block_k wide), for a PARTIAL block.
  const bool* row(int64_t b, int64_t h, int64_t qb, int64_t kb, int64_t r) const {
    return partial + (index[at(b, h, qb, kb)] * block_q + r) * block_k;
  }
};

}  // namespace attnlab
