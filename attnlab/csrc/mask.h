// THE key rule in C++: which keys [lo, hi) the query at row i may see. The twin of
// attnlab/masks.py (key_bounds, KeyRule); tests/test_rule.py holds the two equal over a
// hypothesis sweep through the rule_bounds op below. Included by every kernel that
// attends: the flash forward and backward (flash_common.h) and the decoding step.
//
// Query row i sits at position p = i + offset among the keys (offset = Lk - Lq: causal
// and window rules aligned to the end, what decoding with a KV cache needs; a block of a
// longer sequence passes its own). It sees key j when j <= p (causal) and p - W < j
// (window W; also j < p + W when not causal), 0 <= j < Lk. Every row's keys are one
// interval and both ends are non-decreasing in i, so a block of rows sees the keys from
// its first row's lo to its last row's hi, and a tile needs no mask when its last row's
// lo and its first row's hi cover it.
#pragma once

#include <algorithm>
#include <cstdint>

namespace attnlab {

struct Rule {
  int64_t Lk = 0;      // keys
  int64_t offset = 0;  // position of query row 0 among the keys
  bool causal = false;
  int64_t window = 0;  // 0: none

  // Keys [lo, hi) of query row i; hi == lo when it may see none.
  void bounds(int64_t i, int64_t& lo, int64_t& hi) const {
    const int64_t p = i + offset;
    lo = 0;
    hi = Lk;
    if (causal) hi = p + 1;
    if (window > 0) {
      lo = p - window + 1;
      if (!causal) hi = p + window;
    }
    lo = std::clamp<int64_t>(lo, 0, Lk);
    hi = std::clamp<int64_t>(hi, lo, Lk);
  }
  // Keys [lo, hi) any row of [qs, qe) may see (qe > qs).
  void block(int64_t qs, int64_t qe, int64_t& lo, int64_t& hi) const {
    int64_t unused;
    bounds(qs, lo, unused);
    bounds(qe - 1, unused, hi);
    hi = std::max(hi, lo);
  }
  // Whether every row of [qs, qe) may see every key of [ks, ke): no mask needed there.
  bool full(int64_t qs, int64_t qe, int64_t ks, int64_t ke) const {
    int64_t last_lo, first_hi, unused;
    bounds(qe - 1, last_lo, unused);
    bounds(qs, unused, first_hi);
    return last_lo <= ks && first_hi >= ke;
  }
};

}  // namespace attnlab
