// The flash forward: one work item per (b, h, query block), whose rows go a document at a
// time where there are documents (mask.h's document_run_end). It visits only the keys the
// rule leaves the rows, tile by tile: the tile's scores in one product, the online
// softmax on each row's allowed columns only (every row's keys are one interval, so only
// the boundary tiles have columns to skip), the weighted values in a second product; it
// keeps the log-sum-exp for the backward. Storage S (float, double, bf16, fp16), maths in
// A = Acc<S>: a bf16 tile is converted into float scratch as it is read.
#pragma once

#include "flash_common.h"

namespace attnlab {

template <typename A>
struct ForwardScratch {
  std::vector<A> s, m, l, q, o, kt, rows, v;
  std::vector<int64_t> lo, hi;
  HeadPack<A> keys;
  explicit ForwardScratch(const Problem& P) : s(P.bq * P.bk), m(P.bq), l(P.bq), lo(P.bq), hi(P.bq) {}
};

template <typename S, typename A = Acc<S>>
void forward_block(const Problem& P, const S* q, const Rows& qr, const S* k, const Rows& kr,
                   const S* v, const Rows& vr, S* out, A* lse, int64_t b, int64_t h, int64_t qs,
                   int64_t qe, bool tiles, ForwardScratch<A>& w) {
  constexpr A NEG = -std::numeric_limits<A>::infinity();
  const int64_t nr = qe - qs, hk = h / P.G;
  S* dst = out + ((b * P.Hq + h) * P.Lq + qs) * P.Dv;  // (nr, Dv) rows of the output
  // The accumulator: the output itself where it is stored in A, else scratch.
  A* o;
  if constexpr (std::is_same_v<S, A>) {
    o = dst;
  } else {
    if (static_cast<int64_t>(w.o.size()) < nr * P.Dv) w.o.resize(nr * P.Dv);
    o = w.o.data();
  }
  std::fill(o, o + nr * P.Dv, A(0));
  A* L = lse + (b * P.Hq + h) * P.Lq + qs;
  int64_t lo, hi;
  P.rule.block(b, qs, qe, lo, hi);
  for (int64_t r = 0; r < nr; ++r) {
    w.m[r] = NEG;
    w.l[r] = A(0);
    P.rule.bounds(b, qs + r, w.lo[r], w.hi[r]);
  }
  int64_t ldq;
  const A* qb = hi > lo ? rows_as_acc(q + qr.at(b, h, qs), qr.sl, nr, P.D, w.q, ldq) : nullptr;
  RightT<A> keys;
  // With a block mask the tiles are its blocks: they start on a block boundary (the
  // columns before lo are left out by every row's [a, e) below).
  const int64_t start = hi <= lo ? hi : P.blocks.present() ? lo - lo % P.bk : lo;
  const bool held = tiles && hi > start &&
                    w.keys.hold(b, hk, start, hi, P.Lk, k + kr.at(b, hk, 0), kr.sl, P.D);
  for (int64_t ks = start; ks < hi; ks += P.bk) {
    const int64_t nc = std::min(ks + P.bk, hi) - ks;
    const BlockMask::Kind kind = block_kind(P, b, h, qs, ks);
    if (kind == BlockMask::EMPTY) continue;
    if (held)
      w.keys.view(ks, P.D, keys);
    else
      keys.load(k + kr.at(b, hk, ks), kr.sl, nc, P.D, tiles, w.kt, w.rows);
    A* T = w.s.data();
    times_transposed<A>(nr, nc, A(P.scale), qb, ldq, keys, T, nc);
    for (int64_t r = 0; r < nr; ++r) {
      A* row = T + r * nc;
      const int64_t a = std::clamp<int64_t>(w.lo[r] - ks, 0, nc);
      const int64_t e = std::clamp<int64_t>(w.hi[r] - ks, a, nc);
      if (e > a) {
        if (P.scores.any())
          P.scores.apply(b, h, P.rule.position(b, qs + r), ks + a, row + a, e - a, (A*)nullptr);
        if (kind == BlockMask::PARTIAL) apply_block_row(P, b, h, qs + r, ks + a, row + a, e - a);
        if (P.mask != nullptr) apply_mask(P, b, h, qs + r, ks + a, row + a, e - a);
      }
      const A m_new = std::max(w.m[r], row_max(row + a, e - a));
      if (m_new == NEG) {  // nothing allowed in this row so far, or only NaN scores
        // The max skips NaN, so a row of NaN scores (a NaN query, NaN keys) lands here
        // like an empty one. Checked only on this rare path: m = l = NaN then carry
        // through every later tile (max, rescale) and the final division, so the row
        // comes out NaN (lse NaN, hence NaN gradients) instead of passing as zeros.
        if (any_nan(row + a, e - a)) w.m[r] = w.l[r] = std::numeric_limits<A>::quiet_NaN();
        std::fill(row, row + nc, A(0));
        continue;
      }
      zero_outside(row, a, e, nc);
      const A sum = exp_shift_sum(row + a, e - a, m_new);
      // Rescale what was accumulated under the old maximum (nothing yet when it was -inf).
      const A alpha = w.m[r] == NEG ? A(0) : std::exp(w.m[r] - m_new);
      if (w.m[r] != NEG && alpha != A(1)) scale_row(o + r * P.Dv, P.Dv, alpha);
      w.l[r] = w.l[r] * alpha + sum;
      w.m[r] = m_new;
      if (P.dropout_p > 0) apply_dropout(P, b, h, qs + r, ks + a, row + a, e - a);
    }
    int64_t ldv;
    const A* vb = rows_as_acc(v + vr.at(b, hk, ks), vr.sl, nc, P.Dv, w.v, ldv);
    product<A>(tiles, false, nr, P.Dv, nc, A(1), T, nc, vb, ldv, true, o, P.Dv);
  }
  const A sink = P.sinks == nullptr ? NEG : A(P.sinks[h]);
  for (int64_t r = 0; r < nr; ++r) {
    A m = w.m[r], l = w.l[r];
    if (sink != NEG) {  // the sink joins the denominator and adds no value
      const A top = std::max(m, sink);  // (NaN m stays NaN through the max and below)
      const A kept = m == NEG ? A(0) : std::exp(m - top);
      l = l * kept + std::exp(sink - top);
      if (kept != A(1)) scale_row(o + r * P.Dv, P.Dv, kept);
      m = top;
    }
    if (l == A(0)) {  // a row with nothing to attend: zeros, and lse = +inf
      // (l is NaN, not 0, for a row that met a NaN score: it stays NaN below)
      std::fill(o + r * P.Dv, o + (r + 1) * P.Dv, A(0));
      L[r] = std::numeric_limits<A>::infinity();
    } else {
      scale_row(o + r * P.Dv, P.Dv, A(1) / l);
      L[r] = m + std::log(l);
    }
  }
  if constexpr (!std::is_same_v<S, A>) from_acc(o, dst, nr * P.Dv);
}

// Every (b, h, query block) in one parallel region, a head at a time, longest first, pulled
// from a counter.
template <typename S>
void forward_impl(const Problem& P, const Tensor& q, const Tensor& k, const Tensor& v,
                  Tensor& out, Tensor& lse) {
  using A = Acc<S>;
  const int64_t nqb = P.query_blocks();
  std::vector<int64_t> cost(P.B * P.Hq * nqb);
  for (size_t item = 0; item < cost.size(); ++item) {
    const int64_t qs = static_cast<int64_t>(item % nqb) * P.bq;
    int64_t lo, hi;
    P.rule.block(static_cast<int64_t>(item) / (P.Hq * nqb), qs, std::min(qs + P.bq, P.Lq), lo, hi);
    cost[item] = hi - lo;
  }
  const Rows qr(q), kr(k), vr(v);
  const S *qp = q.data_ptr<S>(), *kp = k.data_ptr<S>(), *vp = v.data_ptr<S>();
  S* op = out.data_ptr<S>();
  A* lp = lse.data_ptr<A>();
  const bool tiles = use_tile_kernel<A>();
  const int64_t workers = std::max<int64_t>(1, at::get_num_threads());
  std::vector<std::unique_ptr<ForwardScratch<A>>> scratch(workers);
  run_items(longest_first(cost, nqb), workers, [&](int64_t worker, int64_t item) {
    if (!scratch[worker]) scratch[worker] = std::make_unique<ForwardScratch<A>>(P);
    const int64_t bh = item / nqb, b = bh / P.Hq, qe = std::min((item % nqb + 1) * P.bq, P.Lq);
    for (int64_t qs = (item % nqb) * P.bq, run; qs < qe; qs = run) {  // a document at a time
      run = P.rule.document_run_end(b, qs, qe);
      forward_block<S>(P, qp, qr, kp, kr, vp, vr, op, lp, b, bh % P.Hq, qs, run, tiles,
                       *scratch[worker]);
    }
  });
}

}  // namespace attnlab
