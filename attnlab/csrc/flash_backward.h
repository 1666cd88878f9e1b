// The flash backward: one work item per (b, kv head, key block). It recomputes each
// tile's weights from the forward's log-sum-exp, accumulates dK and dV of its block in
// scratch (written once at the end: no other item touches them) and dQ into its worker's
// buffer (no atomics). The whole backward is one parallel region: D_i = rowsum(dO_i O_i)
// is computed where a tile needs it, and the worker finishing the last key block of a
// (b, kv head) sums that slice of dQ over the workers' buffers, in worker order (each
// buffer's sum depends only on the fixed split of the items: bitwise reproducible).
#pragma once

#include "flash_common.h"

namespace attnlab {

template <typename A>
struct BackwardScratch {
  std::vector<A> p, dp, kept, t, kt, vt, krows, vrows, q, dout, delta, dk, dv;
  BackwardScratch(const Problem& P)
      : p(P.bq * P.bk), dp(P.bq * P.bk), kept(P.dropout_p > 0 ? P.bq * P.bk : 0),
        t(P.scores.softcap > 0 ? P.bq * P.bk : 0), delta(P.bq), dk(P.bk * P.D),
        dv(P.bk * P.Dv) {}
};

template <typename S>
struct BackwardArgs {
  const S *q, *k, *v, *out, *dout;
  const Acc<S>* lse;
  Rows qr, kr, vr, orr, dr;
  S *dq, *dk, *dv;
};

// The dQ buffers of the workers, (workers, B, Hq, Lq, D) in A, zeroed slice by slice as a
// worker first touches a (b, kv head), and the count of key blocks still to come per
// (b, kv head): its last one sums the slice into dq.
template <typename A>
struct DqParts {
  std::vector<A> buf;
  std::vector<char> touched;                    // (workers, B * Hkv)
  std::unique_ptr<std::atomic<int64_t>[]> left;  // (B * Hkv)
  int64_t workers, slice;  // slice: G * Lq * D values of one (b, kv head)
};

template <typename S, typename A = Acc<S>>
void backward_block(const Problem& P, const BackwardArgs<S>& X, int64_t b, int64_t hk,
                    int64_t ks, bool tiles, A* dq, BackwardScratch<A>& w) {
  const int64_t nc = std::min(ks + P.bk, P.Lk) - ks;
  const A scale = A(P.scale);
  RightT<A> keys, values;
  keys.load(X.k + X.kr.at(b, hk, ks), X.kr.sl, nc, P.D, tiles, w.kt, w.krows);
  values.load(X.v + X.vr.at(b, hk, ks), X.vr.sl, nc, P.Dv, tiles, w.vt, w.vrows);
  int64_t ldk;  // dQ += dS K reads K's rows in A
  const A* krows = rows_as_acc(X.k + X.kr.at(b, hk, ks), X.kr.sl, nc, P.D, w.krows, ldk);
  A* dk = w.dk.data();
  A* dv = w.dv.data();
  std::fill(dk, dk + nc * P.D, A(0));
  std::fill(dv, dv + nc * P.Dv, A(0));
  for (int64_t h = hk * P.G; h < (hk + 1) * P.G; ++h) {
    const A* lse = X.lse + (b * P.Hq + h) * P.Lq;
    for (int64_t qs = 0; qs < P.Lq; qs += P.bq) {
      const int64_t qe = std::min(qs + P.bq, P.Lq), nr = qe - qs;
      int64_t lo, hi;
      P.rule.block(b, qs, qe, lo, hi);
      if (hi <= ks || lo >= ks + nc) continue;  // this query block never sees these keys
      const BlockMask::Kind kind = block_kind(P, b, h, qs, ks);
      if (kind == BlockMask::EMPTY) continue;
      int64_t ldq, ldo;
      const A* qb = rows_as_acc(X.q + X.qr.at(b, h, qs), X.qr.sl, nr, P.D, w.q, ldq);
      const A* dob = rows_as_acc(X.dout + X.dr.at(b, h, qs), X.dr.sl, nr, P.Dv, w.dout, ldo);
      A *T = w.p.data(), *dP = w.dp.data();
      times_transposed<A>(nr, nc, scale, qb, ldq, keys, T, nc);
      bool any = false;
      for (int64_t r = 0; r < nr; ++r) {
        A* row = T + r * nc;
        int64_t rlo, rhi;
        P.rule.bounds(b, qs + r, rlo, rhi);
        const int64_t a = std::clamp<int64_t>(rlo - ks, 0, nc);
        const int64_t e = std::clamp<int64_t>(rhi - ks, a, nc);
        if (e == a || std::isinf(lse[qs + r])) {  // no key here, or an empty row
          std::fill(row, row + nc, A(0));
          continue;
        }
        any = true;
        if (P.scores.any())
          P.scores.apply(b, h, P.rule.position(b, qs + r), ks + a, row + a, e - a,
                         w.t.empty() ? (A*)nullptr : w.t.data() + r * nc + a);
        if (kind == BlockMask::PARTIAL) apply_block_row(P, b, h, qs + r, ks + a, row + a, e - a);
        if (P.mask != nullptr) apply_mask(P, b, h, qs + r, ks + a, row + a, e - a);
        zero_outside(row, a, e, nc);
        exp_shift_sum(row + a, e - a, lse[qs + r]);
      }
      if (!any) continue;
      // D_i = rowsum(dO_i * O_i), with the dropped-out output as FlashAttention does.
      for (int64_t r = 0; r < nr; ++r) {
        const S* o_row = X.out + X.orr.at(b, h, qs + r);
        const A* do_row = dob + r * ldo;
        A d = A(0);
        for (int64_t c = 0; c < P.Dv; ++c) d += do_row[c] * static_cast<A>(o_row[c]);
        w.delta[r] = d;
      }
      times_transposed<A>(nr, nc, A(1), dob, ldo, values, dP, nc);
      const A* used = T;  // the weights the forward multiplied V by
      if (P.dropout_p > 0) {
        std::copy(T, T + nr * nc, w.kept.data());
        for (int64_t r = 0; r < nr; ++r) {
          apply_dropout(P, b, h, qs + r, ks, w.kept.data() + r * nc, nc);
          apply_dropout(P, b, h, qs + r, ks, dP + r * nc, nc);
        }
        used = w.kept.data();
      }
      product<A>(tiles, true, nc, P.Dv, nr, A(1), used, nc, dob, ldo, true, dv, P.Dv);
      for (int64_t r = 0; r < nr; ++r) {
        softmax_grad_row(T + r * nc, dP + r * nc, nc, w.delta[r]);
        if (!w.t.empty()) {  // through the softcap, on the row's allowed keys (0 elsewhere)
          int64_t rlo, rhi;
          P.rule.bounds(b, qs + r, rlo, rhi);
          const int64_t a = std::clamp<int64_t>(rlo - ks, 0, nc);
          const int64_t e = std::clamp<int64_t>(rhi - ks, a, nc);
          softcap_grad_row(T + r * nc + a, w.t.data() + r * nc + a, e - a);
        }
      }
      product<A>(tiles, true, nc, P.D, nr, scale, T, nc, qb, ldq, true, dk, P.D);
      product<A>(tiles, false, nr, P.D, nc, scale, T, nc, krows, ldk, true,
                 dq + ((h - hk * P.G) * P.Lq + qs) * P.D, P.D);
    }
  }
  S* dk_out = X.dk + ((b * P.Hkv + hk) * P.Lk + ks) * P.D;
  S* dv_out = X.dv + ((b * P.Hkv + hk) * P.Lk + ks) * P.Dv;
  for (int64_t j = 0; j < nc; ++j) {
    from_acc(dk + j * P.D, dk_out + j * P.D, P.D);
    from_acc(dv + j * P.Dv, dv_out + j * P.Dv, P.Dv);
  }
}

template <typename S>
void backward_impl(const Problem& P, const BackwardArgs<S>& X, int64_t workers) {
  using A = Acc<S>;
  const int64_t nkb = P.key_blocks(), nqb = P.query_blocks(), pairs = P.B * P.Hkv;
  // Query rows x keys each key block meets, per batch element (documents differ by it).
  const int64_t rule_batches = P.rule.doc == nullptr ? 1 : P.B;
  std::vector<int64_t> per_block(rule_batches * nkb, 0);
  for (int64_t b = 0; b < rule_batches; ++b) {
    for (int64_t qi = 0; qi < nqb; ++qi) {
      const int64_t qs = qi * P.bq, qe = std::min(qs + P.bq, P.Lq);
      int64_t lo, hi;
      P.rule.block(b, qs, qe, lo, hi);
      for (int64_t kb = 0; kb < nkb; ++kb) {
        const int64_t ks = kb * P.bk, ke = std::min(ks + P.bk, P.Lk);
        per_block[b * nkb + kb] +=
            std::max<int64_t>(0, std::min(hi, ke) - std::max(lo, ks)) * (qe - qs);
      }
    }
  }
  std::vector<int64_t> cost(pairs * nkb);
  for (size_t item = 0; item < cost.size(); ++item) {
    const int64_t b = rule_batches == 1 ? 0 : static_cast<int64_t>(item) / (P.Hkv * nkb);
    cost[item] = per_block[b * nkb + item % nkb];
  }
  DqParts<A> parts;
  parts.workers = workers;
  parts.slice = P.G * P.Lq * P.D;
  parts.buf.resize(workers * pairs * parts.slice);  // left uninitialised until touched
  parts.touched.assign(workers * pairs, 0);
  parts.left.reset(new std::atomic<int64_t>[pairs]);
  for (int64_t bh = 0; bh < pairs; ++bh) parts.left[bh].store(nkb);
  const bool tiles = use_tile_kernel<A>();
  std::vector<std::unique_ptr<BackwardScratch<A>>> scratch(workers);
  run_items_fixed(cost, nkb, workers, [&](int64_t worker, int64_t item) {
    if (!scratch[worker]) scratch[worker] = std::make_unique<BackwardScratch<A>>(P);
    const int64_t bh = item / nkb;
    A* mine = parts.buf.data() + (worker * pairs + bh) * parts.slice;
    if (!parts.touched[worker * pairs + bh]) {
      std::fill(mine, mine + parts.slice, A(0));
      parts.touched[worker * pairs + bh] = 1;
    }
    backward_block<S>(P, X, bh / P.Hkv, bh % P.Hkv, (item % nkb) * P.bk, tiles, mine,
                      *scratch[worker]);
    if (parts.left[bh].fetch_sub(1, std::memory_order_acq_rel) != 1) return;
    // The last key block of this (b, kv head): dQ's slice is final in every buffer.
    std::vector<A>& sum = scratch[worker]->dp;  // reused: G * Lq * D may exceed it
    if (static_cast<int64_t>(sum.size()) < P.D) sum.resize(P.D);
    S* dq = X.dq + bh * parts.slice;  // (b, heads of hk) are contiguous in (B, Hq, Lq, D)
    for (int64_t row = 0; row < P.G * P.Lq; ++row) {
      std::fill(sum.begin(), sum.begin() + P.D, A(0));
      for (int64_t t = 0; t < workers; ++t) {
        if (!parts.touched[t * pairs + bh]) continue;
        const A* part = parts.buf.data() + (t * pairs + bh) * parts.slice + row * P.D;
        for (int64_t c = 0; c < P.D; ++c) sum[c] += part[c];
      }
      from_acc(sum.data(), dq + row * P.D, P.D);
    }
  });
}

}  // namespace attnlab
