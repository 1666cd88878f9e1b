// The flash forward: one work item per (b, h, query block), whose rows go a document at a
// time where there are documents (mask.h's document_run_end). It visits only the keys the
// rule leaves the rows, tile by tile: the tile's scores in one product, the online
// softmax on each row's allowed columns only (every row's keys are one interval, so only
// the boundary tiles have columns to skip), the weighted values in a second product; it
// keeps the log-sum-exp for the backward. Storage S (float, double, bf16, fp16), maths in
// A = Acc<S>: a bf16 tile is converted into float scratch as it is read. A run of rows
// whose keys number at most SHORT_KEYS (a packed sentence, a short sequence) takes
// forward_short instead, where its scores have no term beyond the rule (short_runs).
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

// The most keys forward_short takes: two vectors of 16 scores a row.
constexpr int64_t SHORT_KEYS = 32;

#if defined(ATTNLAB_X86)
// Rows [0, nr) of a query run whose keys all lie among n <= SHORT_KEYS keys (short packed
// documents: the MiniLM encoder's sentences of about 13 tokens), row r seeing keys
// [a[r], e[r]). On the tiles such a run went mostly to set-up around products a dozen
// columns wide, and each row's softmax was a chain of dependent steps (about 1 us a
// sentence and head, a tenth of the FMA peak). Here 16 rows are the lanes of a vector: a
// key's scores for them are one vector, the softmax's max and sum are lane-wise, and the
// output rows are sums of value rows. The queries are transposed in registers (16 x 16
// blocks): through memory, the vector loads of what scalar stores had just written
// waited for them to retire, and gathers took a fifth of the time.
// scratch: (D + SHORT_KEYS) * 16 floats. Empty rows come out as forward_block's, and so
// does NaN in what a row reads; a NaN or infinity among the keys or values a row may not
// see never reaches it here, where on the tiles it can (their products span the tile:
// README, "Data a row may not read may or may not reach it").
ATTNLAB_AVX512 static void forward_short(const float* q, int64_t q_ld, int64_t nr,
                                         const float* k, int64_t k_ld, const float* v,
                                         int64_t v_ld, int64_t n, int64_t D, int64_t Dv,
                                         float scale, const int64_t* a, const int64_t* e,
                                         float* scratch, float* out, float* lse) {
  constexpr float NEG = -std::numeric_limits<float>::infinity();
  float* qt = scratch;         // (D, 16): the rows' queries, by column
  float* st = qt + D * 16;     // (n, 16): scores, then weights, by key
  for (int64_t r0 = 0; r0 < nr; r0 += 16) {
    const int64_t rows = std::min<int64_t>(16, nr - r0);
    i16v from{}, to{};  // lanes past the rows see nothing
    for (int64_t r = 0; r < rows; ++r) {
      from[r] = static_cast<int32_t>(a[r0 + r]);
      to[r] = static_cast<int32_t>(e[r0 + r]);
    }
    const float* qr = q + r0 * q_ld;
    for (int64_t d0 = 0; d0 < D; d0 += 16) {  // qt[d] = column d of the rows
      const __mmask16 cols =
          D - d0 >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (D - d0)) - 1u);
      __m512 x[16];
      for (int r = 0; r < 16; ++r)
        x[r] = r < rows ? _mm512_maskz_loadu_ps(cols, qr + r * q_ld + d0) : _mm512_setzero_ps();
      transpose16(x);
      for (int64_t d = d0; d < std::min<int64_t>(D, d0 + 16); ++d)
        _mm512_storeu_ps(qt + d * 16, x[d - d0]);
    }
    f16v m = f16v{} + NEG;
    for (int64_t j = 0; j < n; ++j) {
      const float* kj = k + j * k_ld;
      f16v s{}, t{};  // even and odd d: two chains of FMAs
      int64_t d = 0;
      for (; d + 2 <= D; d += 2) {
        s += kj[d] * load16(qt + d * 16);
        t += kj[d + 1] * load16(qt + (d + 1) * 16);
      }
      if (d < D) s += kj[d] * load16(qt + d * 16);
      const i16v col = i16v{} + static_cast<int32_t>(j);
      s = col >= from && col < to ? (s + t) * scale : NEG;
      store16(st + j * 16, s);
      m = s > m ? s : m;  // (skips NaN)
    }
    // A row with nothing allowed (m = -inf) takes weights exp(-inf - 0) = 0, so l = 0; one
    // whose allowed scores are all NaN gets NaN weights, so l = NaN.
    const f16v shift = m == NEG ? f16v{} : m;
    f16v l{};
    for (int64_t j = 0; j < n; ++j) {
      const f16v p = exp16(load16(st + j * 16) - shift);
      store16(st + j * 16, p);
      l += p;
    }
    for (int64_t r = 0; r < rows; ++r) {
      float* o = out + (r0 + r) * Dv;
      if (l[r] == 0.0f) {  // nothing to attend: zeros, lse +inf
        std::fill(o, o + Dv, 0.0f);
        lse[r0 + r] = std::numeric_limits<float>::infinity();
        continue;
      }
      const float inv = 1.0f / l[r];
      const float* p = st + r;  // row r's weight of key j: p[16 * j]
      int64_t c = 0;
      for (; c + 16 <= Dv; c += 16) {
        f16v acc{}, odd{};
        int64_t j = a[r0 + r];
        for (; j + 2 <= e[r0 + r]; j += 2) {
          acc += p[16 * j] * load16(v + j * v_ld + c);
          odd += p[16 * (j + 1)] * load16(v + (j + 1) * v_ld + c);
        }
        if (j < e[r0 + r]) acc += p[16 * j] * load16(v + j * v_ld + c);
        store16(o + c, (acc + odd) * inv);
      }
      for (; c < Dv; ++c) {
        float acc = 0.0f;
        for (int64_t j = a[r0 + r]; j < e[r0 + r]; ++j) acc += p[16 * j] * v[j * v_ld + c];
        o[c] = acc * inv;
      }
      lse[r0 + r] = m[r] + std::log(l[r]);  // (NaN stays NaN)
    }
  }
}
#endif

// Whether forward_short takes the problem's short runs: the tile kernel's CPUs (AVX-512),
// float32 and a plain softmax (no mask tensor, score terms, block mask, dropout or sinks:
// those go through the tiles).
template <typename S>
bool short_runs(const Problem& P, bool tiles) {
#if defined(ATTNLAB_X86)
  return tiles && std::is_same_v<S, float> && P.mask == nullptr && !P.scores.any() &&
         !P.blocks.present() && P.dropout_p == 0 && P.sinks == nullptr;
#else
  (void)P, (void)tiles;
  return false;
#endif
}

// forward_block for a run [qs, qe) of (b, h) whose keys [lo, hi) number 1..SHORT_KEYS, by
// forward_short (short_runs holds).
template <typename S, typename A = Acc<S>>
void short_block(const Problem& P, const S* q, const Rows& qr, const S* k, const Rows& kr,
                 const S* v, const Rows& vr, S* out, A* lse, int64_t b, int64_t h, int64_t qs,
                 int64_t qe, int64_t lo, int64_t hi, ForwardScratch<A>& w) {
#if defined(ATTNLAB_X86)
  if constexpr (std::is_same_v<S, float>) {
    const int64_t nr = qe - qs, hk = h / P.G, n = hi - lo;
    for (int64_t r = 0; r < nr; ++r) {
      int64_t a, e;
      P.rule.bounds(b, qs + r, a, e);
      w.lo[r] = std::clamp<int64_t>(a - lo, 0, n);
      w.hi[r] = std::clamp<int64_t>(e - lo, w.lo[r], n);
    }
    const int64_t need = (P.D + SHORT_KEYS) * 16;
    if (static_cast<int64_t>(w.kt.size()) < need) w.kt.resize(need);
    forward_short(q + qr.at(b, h, qs), qr.sl, nr, k + kr.at(b, hk, lo), kr.sl,
                  v + vr.at(b, hk, lo), vr.sl, n, P.D, P.Dv, static_cast<float>(P.scale),
                  w.lo.data(), w.hi.data(), w.kt.data(),
                  out + ((b * P.Hq + h) * P.Lq + qs) * P.Dv, lse + (b * P.Hq + h) * P.Lq + qs);
  }
#endif
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
  const bool tiles = use_tile_kernel<A>(), shorts = short_runs<S>(P, tiles);
  // (each item's keys times its rows, times both products: the work, for workers_for)
  double flops = 0;
  for (size_t item = 0; item < cost.size(); ++item)
    flops += double(cost[item]) * std::min(P.bq, P.Lq - int64_t(item % nqb) * P.bq);
  const int64_t workers = workers_for(flops * 2.0 * double(P.D + P.Dv));
  std::vector<std::unique_ptr<ForwardScratch<A>>> scratch(workers);
  run_items(longest_first(cost, nqb), workers, [&](int64_t worker, int64_t item) {
    if (!scratch[worker]) scratch[worker] = std::make_unique<ForwardScratch<A>>(P);
    const int64_t bh = item / nqb, b = bh / P.Hq, qe = std::min((item % nqb + 1) * P.bq, P.Lq);
    for (int64_t qs = (item % nqb) * P.bq, run; qs < qe; qs = run) {  // a document at a time
      run = P.rule.document_run_end(b, qs, qe);
      int64_t lo = 0, hi = 0;
      if (shorts) P.rule.block(b, qs, run, lo, hi);
      if (shorts && hi > lo && hi - lo <= SHORT_KEYS) {
        short_block<S>(P, qp, qr, kp, kr, vp, vr, op, lp, b, bh % P.Hq, qs, run, lo, hi,
                       *scratch[worker]);
        continue;
      }
      forward_block<S>(P, qp, qr, kp, kr, vp, vr, op, lp, b, bh % P.Hq, qs, run, tiles,
                       *scratch[worker]);
    }
  });
}

}  // namespace attnlab
