// FlashAttention-2 for the CPU: the `flash` backend of attnlab.attention.
//
// Shapes: q (B, Hq, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv); query head h
// reads kv head h / (Hq / Hkv), so K/V are never copied (GQA/MQA). Rows may be
// strided (the last dimension has unit stride). The mask, if any, is bool
// (true = may attend) or additive in the compute type, expanded to (B, Hq, Lq, Lk)
// with zero strides where it broadcasts. Compute type: float or double.
//
// Forward: one work item per (b, h, query block); it visits only the key range the
// causal/window rules leave for the block, does each tile's scores with one GEMM,
// runs the online softmax on the allowed columns of each row only (structural
// rules give every row an interval of keys, so only boundary tiles have columns
// to skip), and keeps the log-sum-exp. Backward: one item per (b, kv head, key
// block), accumulating dK and dV for its block and dQ into a per-thread buffer
// (no atomics), probabilities recomputed from the log-sum-exp.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <atomic>
#include <numeric>
#include <string>
#include <tuple>
#include <vector>

#include "flash_common.h"
#include "tile_math.h"

namespace attnlab {
namespace {

// ------------------------------------------------------------------------ forward

template <typename T>
struct ForwardScratch {
  std::vector<T> s, m, l;
  std::vector<int64_t> lo, hi;
  explicit ForwardScratch(const Problem& P)
      : s(P.bq * P.bk), m(P.bq), l(P.bq), lo(P.bq), hi(P.bq) {}
};

// `kt` is K^T packed for the tile kernel (all kv heads, pack_keys) or null.
template <typename T>
void forward_block(const Problem& P, const T* q, const Rows& qr, const T* k, const Rows& kr,
                   const T* kt, const T* v, const Rows& vr, T* out, T* lse, int64_t b,
                   int64_t h, int64_t qs, ForwardScratch<T>& w) {
  constexpr T NEG = -std::numeric_limits<T>::infinity();
  const int64_t qe = std::min(qs + P.bq, P.Lq), nr = qe - qs, hk = h / P.G;
  T* o = out + ((b * P.Hq + h) * P.Lq + qs) * P.Dv;  // the accumulator, (nr, Dv)
  T* L = lse + (b * P.Hq + h) * P.Lq + qs;
  std::fill(o, o + nr * P.Dv, T(0));
  int64_t lo, hi;
  P.rule.block(qs, qe, lo, hi);
  for (int64_t r = 0; r < nr; ++r) {
    w.m[r] = NEG;
    w.l[r] = T(0);
    P.rule.bounds(qs + r, w.lo[r], w.hi[r]);
  }
  const T* qb = q + qr.at(b, h, qs);
  const int64_t panels = (P.Lk + PANEL - 1) / PANEL;
  const RightT<T> keys{k + kr.at(b, hk, 0), kr.sl, P.D,
                       kt == nullptr ? nullptr : kt + (b * P.Hkv + hk) * panels * P.D * PANEL};
  // Packed tiles start on a panel: the few columns before `lo` are left out by every
  // row's [a, e) below, and each tile product is then whole panels.
  const int64_t start = kt != nullptr && P.bk % PANEL == 0 ? lo - lo % PANEL : lo;
  for (int64_t ks = start; ks < hi; ks += P.bk) {
    const int64_t nc = std::min(ks + P.bk, hi) - ks;
    T* S = w.s.data();
    times_transposed<T>(nr, ks, nc, T(P.scale), qb, qr.sl, keys, S, nc);
    for (int64_t r = 0; r < nr; ++r) {
      T* row = S + r * nc;
      const int64_t a = std::clamp<int64_t>(w.lo[r] - ks, 0, nc);
      const int64_t e = std::clamp<int64_t>(w.hi[r] - ks, a, nc);
      if (P.mask != nullptr && e > a) apply_mask(P, b, h, qs + r, ks + a, row + a, e - a);
      const T m_new = std::max(w.m[r], row_max(row + a, e - a));
      if (m_new == NEG) {  // nothing allowed in this row so far, or only NaN scores
        // The max skips NaN, so a row of NaN scores (a NaN query, NaN keys) lands here
        // like an empty one. Checked only on this rare path: m = l = NaN then carry
        // through every later tile (max, rescale) and the final division, so the row
        // comes out NaN (lse NaN, hence NaN gradients) instead of passing as zeros.
        if (any_nan(row + a, e - a)) w.m[r] = w.l[r] = std::numeric_limits<T>::quiet_NaN();
        std::fill(row, row + nc, T(0));
        continue;
      }
      zero_outside(row, a, e, nc);
      const T sum = exp_shift_sum(row + a, e - a, m_new);
      // Rescale what was accumulated under the old maximum (nothing yet when it was -inf).
      const T alpha = w.m[r] == NEG ? T(0) : std::exp(w.m[r] - m_new);
      if (w.m[r] != NEG && alpha != T(1)) scale_row(o + r * P.Dv, P.Dv, alpha);
      w.l[r] = w.l[r] * alpha + sum;
      w.m[r] = m_new;
      if (P.dropout_p > 0) apply_dropout(P, b, h, qs + r, ks + a, row + a, e - a);
    }
    product<T>(kt != nullptr, false, nr, P.Dv, nc, T(1), S, nc, v + vr.at(b, hk, ks), vr.sl,
               true, o, P.Dv);
  }
  for (int64_t r = 0; r < nr; ++r) {
    if (w.l[r] == T(0)) {  // a row with nothing to attend: zeros, and lse = +inf
      // (l is NaN, not 0, for a row that met a NaN score: it stays NaN below)
      std::fill(o + r * P.Dv, o + (r + 1) * P.Dv, T(0));
      L[r] = std::numeric_limits<T>::infinity();
    } else {
      scale_row(o + r * P.Dv, P.Dv, T(1) / w.l[r]);
      L[r] = w.m[r] + std::log(w.l[r]);
    }
  }
}

// K^T of every (batch, kv head) in the tile kernel's panels, packed once: each key
// tile is then read by every query block of the G heads that share it. As much memory
// as K (rounded up to whole panels).
template <typename T>
std::vector<T> pack_keys(const Problem& P, const T* k, const Rows& kr) {
  const int64_t panels = (P.Lk + PANEL - 1) / PANEL, per_panel = P.D * PANEL;
  std::vector<T> kt(P.B * P.Hkv * panels * per_panel);
  at::parallel_for(0, P.B * P.Hkv * panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t bh = item / panels, j0 = (item % panels) * PANEL;
      pack_transposed(k + kr.at(bh / P.Hkv, bh % P.Hkv, j0), kr.sl,
                      std::min(PANEL, P.Lk - j0), P.D, kt.data() + item * per_panel);
    }
  });
  return kt;
}

template <typename T>
void forward_impl(const Problem& P, const Tensor& q, const Tensor& k, const Tensor& v,
                  Tensor& out, Tensor& lse) {
  const int64_t nqb = P.query_blocks();
  std::vector<int64_t> cost(P.B * P.Hq * nqb);
  for (size_t item = 0; item < cost.size(); ++item) {
    const int64_t qs = static_cast<int64_t>(item % nqb) * P.bq;
    int64_t lo, hi;
    P.rule.block(qs, std::min(qs + P.bq, P.Lq), lo, hi);
    cost[item] = hi - lo;
  }
  const Rows qr(q), kr(k), vr(v);
  const T *qp = q.data_ptr<T>(), *kp = k.data_ptr<T>(), *vp = v.data_ptr<T>();
  T *op = out.data_ptr<T>(), *lp = lse.data_ptr<T>();
  const std::vector<T> kt = use_tile_kernel<T>() ? pack_keys<T>(P, kp, kr) : std::vector<T>();
  const int64_t workers = std::max<int64_t>(1, at::get_num_threads());
  std::vector<std::unique_ptr<ForwardScratch<T>>> scratch(workers);
  run_items(longest_first(cost), workers, [&](int64_t worker, int64_t item) {
    if (!scratch[worker]) scratch[worker] = std::make_unique<ForwardScratch<T>>(P);
    const int64_t bh = item / nqb;
    forward_block<T>(P, qp, qr, kp, kr, kt.empty() ? nullptr : kt.data(), vp, vr, op, lp,
                     bh / P.Hq, bh % P.Hq, (item % nqb) * P.bq, *scratch[worker]);
  });
}

// ------------------------------------------------------------------------ backward

template <typename T>
struct BackwardScratch {
  std::vector<T> p, dp, kept, kt, vt;  // kt, vt: the key block's K^T, V^T for the tile kernel
  BackwardScratch(const Problem& P, bool tiles)
      : p(P.bq * P.bk), dp(P.bq * P.bk), kept(P.dropout_p > 0 ? P.bq * P.bk : 0),
        kt(tiles ? (P.bk + PANEL - 1) / PANEL * PANEL * P.D : 0),
        vt(tiles ? (P.bk + PANEL - 1) / PANEL * PANEL * P.Dv : 0) {}
};

struct BackwardArgs {
  const void *q, *k, *v, *dout, *lse, *delta;
  Rows qr, kr, vr, dr;
  void *dk, *dv;
};

template <typename T>
void backward_block(const Problem& P, const BackwardArgs& A, int64_t b, int64_t hk,
                    int64_t ks, T* dq, BackwardScratch<T>& w) {
  const int64_t nc = std::min(ks + P.bk, P.Lk) - ks;
  const T* kb = static_cast<const T*>(A.k) + A.kr.at(b, hk, ks);
  const T* vb = static_cast<const T*>(A.v) + A.vr.at(b, hk, ks);
  T* dkb = static_cast<T*>(A.dk) + ((b * P.Hkv + hk) * P.Lk + ks) * P.D;
  T* dvb = static_cast<T*>(A.dv) + ((b * P.Hkv + hk) * P.Lk + ks) * P.Dv;
  const T scale = T(P.scale);
  const bool tiles = !w.kt.empty();
  if (tiles) {  // packed once, read by every query block of the G heads
    pack_transposed(kb, A.kr.sl, nc, P.D, w.kt.data());
    pack_transposed(vb, A.vr.sl, nc, P.Dv, w.vt.data());
  }
  const RightT<T> keys{kb, A.kr.sl, P.D, tiles ? w.kt.data() : nullptr};
  const RightT<T> values{vb, A.vr.sl, P.Dv, tiles ? w.vt.data() : nullptr};
  for (int64_t h = hk * P.G; h < (hk + 1) * P.G; ++h) {
    const T* lse = static_cast<const T*>(A.lse) + (b * P.Hq + h) * P.Lq;
    const T* delta = static_cast<const T*>(A.delta) + (b * P.Hq + h) * P.Lq;
    for (int64_t qs = 0; qs < P.Lq; qs += P.bq) {
      const int64_t qe = std::min(qs + P.bq, P.Lq), nr = qe - qs;
      int64_t lo, hi;
      P.rule.block(qs, qe, lo, hi);
      if (hi <= ks || lo >= ks + nc) continue;  // this query block never sees these keys
      const T* qb = static_cast<const T*>(A.q) + A.qr.at(b, h, qs);
      const T* dob = static_cast<const T*>(A.dout) + A.dr.at(b, h, qs);
      T *S = w.p.data(), *dP = w.dp.data();
      times_transposed<T>(nr, 0, nc, scale, qb, A.qr.sl, keys, S, nc);
      bool any = false;
      for (int64_t r = 0; r < nr; ++r) {
        T* row = S + r * nc;
        int64_t rlo, rhi;
        P.rule.bounds(qs + r, rlo, rhi);
        const int64_t a = std::clamp<int64_t>(rlo - ks, 0, nc);
        const int64_t e = std::clamp<int64_t>(rhi - ks, a, nc);
        if (e == a || std::isinf(lse[qs + r])) {  // no key here, or an empty row
          std::fill(row, row + nc, T(0));
          continue;
        }
        any = true;
        if (P.mask != nullptr) apply_mask(P, b, h, qs + r, ks + a, row + a, e - a);
        zero_outside(row, a, e, nc);
        exp_shift_sum(row + a, e - a, lse[qs + r]);
      }
      if (!any) continue;
      times_transposed<T>(nr, 0, nc, T(1), dob, A.dr.sl, values, dP, nc);
      const T* used = S;  // the weights the forward multiplied V by
      if (P.dropout_p > 0) {
        std::copy(S, S + nr * nc, w.kept.data());
        for (int64_t r = 0; r < nr; ++r) {
          apply_dropout(P, b, h, qs + r, ks, w.kept.data() + r * nc, nc);
          apply_dropout(P, b, h, qs + r, ks, dP + r * nc, nc);
        }
        used = w.kept.data();
      }
      product<T>(tiles, true, nc, P.Dv, nr, T(1), used, nc, dob, A.dr.sl, true, dvb, P.Dv);
      for (int64_t r = 0; r < nr; ++r) softmax_grad_row(S + r * nc, dP + r * nc, nc, delta[qs + r]);
      product<T>(tiles, true, nc, P.D, nr, scale, S, nc, qb, A.qr.sl, true, dkb, P.D);
      product<T>(tiles, false, nr, P.D, nc, scale, S, nc, kb, A.kr.sl, true,
                 dq + ((b * P.Hq + h) * P.Lq + qs) * P.D, P.D);
    }
  }
}

template <typename T>
void backward_impl(const Problem& P, const BackwardArgs& A, Tensor& dq_parts) {
  const int64_t nkb = P.key_blocks(), nqb = P.query_blocks();
  std::vector<int64_t> per_block(nkb, 0);  // query rows x keys each key block meets
  for (int64_t qi = 0; qi < nqb; ++qi) {
    const int64_t qs = qi * P.bq, qe = std::min(qs + P.bq, P.Lq);
    int64_t lo, hi;
    P.rule.block(qs, qe, lo, hi);
    for (int64_t kb = 0; kb < nkb; ++kb) {
      const int64_t ks = kb * P.bk, ke = std::min(ks + P.bk, P.Lk);
      per_block[kb] += std::max<int64_t>(0, std::min(hi, ke) - std::max(lo, ks)) * (qe - qs);
    }
  }
  std::vector<int64_t> cost(P.B * P.Hkv * nkb);
  for (size_t item = 0; item < cost.size(); ++item) cost[item] = per_block[item % nkb];
  const int64_t workers = dq_parts.size(0);
  T* dq = dq_parts.data_ptr<T>();
  const int64_t part = P.B * P.Hq * P.Lq * P.D;
  std::vector<std::unique_ptr<BackwardScratch<T>>> scratch(workers);
  run_items_fixed(cost, workers, [&](int64_t worker, int64_t item) {
    if (!scratch[worker])
      scratch[worker] = std::make_unique<BackwardScratch<T>>(P, use_tile_kernel<T>());
    const int64_t bh = item / nkb;
    backward_block<T>(P, A, bh / P.Hkv, bh % P.Hkv, (item % nkb) * P.bk, dq + worker * part,
                      *scratch[worker]);
  });
}

// ------------------------------------------------------------------------ entry points

Problem make_problem(const Tensor& q, const Tensor& k, const Tensor& v,
                     const std::optional<Tensor>& mask, bool causal, int64_t window,
                     int64_t offset, double scale, double dropout_p, int64_t seed,
                     int64_t block_q, int64_t block_k) {
  for (const Tensor* t : {&q, &k, &v}) {
    TORCH_CHECK(t->device().is_cpu(), "attnlab flash: CPU tensors only");
    TORCH_CHECK(t->dim() == 4 && t->stride(3) == 1, "attnlab flash: 4-D rows of unit stride");
    TORCH_CHECK(t->scalar_type() == q.scalar_type(), "attnlab flash: one dtype");
  }
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kDouble,
              "attnlab flash: float32 or float64 (low precision is converted by the caller)");
  Problem P{};
  P.B = q.size(0), P.Hq = q.size(1), P.Lq = q.size(2), P.D = q.size(3);
  P.Hkv = k.size(1), P.Lk = k.size(2), P.Dv = v.size(3);
  TORCH_CHECK(P.Hkv > 0 && P.Hq % P.Hkv == 0 && P.D > 0, "attnlab flash: bad head layout");
  P.G = P.Hq / P.Hkv;
  P.rule = Rule{P.Lk, offset, causal, window};
  P.scale = scale, P.dropout_p = dropout_p;
  P.seed = static_cast<uint64_t>(seed);
  P.bq = std::max<int64_t>(1, block_q), P.bk = std::max<int64_t>(1, block_k);
  if (mask.has_value()) {
    const Tensor& m = *mask;
    TORCH_CHECK(m.dim() == 4 && m.size(0) == P.B && m.size(1) == P.Hq && m.size(2) == P.Lq &&
                    m.size(3) == P.Lk,
                "attnlab flash: mask must be expanded to (B, Hq, Lq, Lk)");
    TORCH_CHECK(m.scalar_type() == at::kBool || m.scalar_type() == q.scalar_type(),
                "attnlab flash: mask must be bool or of q's dtype");
    P.mask = m.data_ptr();
    P.mask_is_bool = m.scalar_type() == at::kBool;
    P.m_sb = m.stride(0), P.m_sh = m.stride(1), P.m_sq = m.stride(2), P.m_sk = m.stride(3);
  }
  return P;
}

std::tuple<Tensor, Tensor> flash_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                                         const std::optional<Tensor>& mask, bool causal,
                                         int64_t window, int64_t offset, double scale,
                                         double dropout_p, int64_t seed, int64_t block_q,
                                         int64_t block_k) {
  const Problem P = make_problem(q, k, v, mask, causal, window, offset, scale, dropout_p,
                                 seed, block_q, block_k);
  Tensor out = at::empty({P.B, P.Hq, P.Lq, P.Dv}, q.options());
  Tensor lse = at::empty({P.B, P.Hq, P.Lq}, q.options());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "attnlab_flash_forward",
                             [&] { forward_impl<scalar_t>(P, q, k, v, out, lse); });
  return {out, lse};
}

std::tuple<Tensor, Tensor, Tensor> flash_backward(
    const Tensor& q, const Tensor& k, const Tensor& v, const std::optional<Tensor>& mask,
    const Tensor& out, const Tensor& lse, const Tensor& grad_out, bool causal, int64_t window,
    int64_t offset, double scale, double dropout_p, int64_t seed, int64_t block_q,
    int64_t block_k) {
  const Problem P = make_problem(q, k, v, mask, causal, window, offset, scale, dropout_p,
                                 seed, block_q, block_k);
  TORCH_CHECK(grad_out.stride(3) == 1 && lse.is_contiguous(), "attnlab flash: layout");
  // D_i = rowsum(dO * O), with the dropped-out output as FlashAttention does.
  const Tensor delta = (grad_out * out).sum(-1).contiguous();
  const int64_t items = P.B * P.Hkv * P.key_blocks();
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items));
  Tensor dq_parts = at::zeros({workers, P.B, P.Hq, P.Lq, P.D}, q.options());
  Tensor dk = at::zeros({P.B, P.Hkv, P.Lk, P.D}, q.options());
  Tensor dv = at::zeros({P.B, P.Hkv, P.Lk, P.Dv}, q.options());
  const BackwardArgs A{q.data_ptr(), k.data_ptr(), v.data_ptr(), grad_out.data_ptr(),
                       lse.data_ptr(), delta.data_ptr(), Rows(q), Rows(k), Rows(v),
                       Rows(grad_out), dk.data_ptr(), dv.data_ptr()};
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "attnlab_flash_backward",
                             [&] { backward_impl<scalar_t>(P, A, dq_parts); });
  Tensor dq = workers == 1 ? dq_parts[0] : dq_parts.sum(0);
  return {dq, dk, dv};
}

// The tile products' routine, for tests: "auto", "blas" or "aten"; returns the one before.
std::string set_gemm_path(const std::string& path) {
  static const char* names[] = {"auto", "blas", "aten"};
  const std::string before = names[static_cast<int>(gemm_path())];
  for (int i = 0; i < 3; ++i)
    if (path == names[i]) gemm_path() = static_cast<GemmPath>(i);
  TORCH_CHECK(path == names[static_cast<int>(gemm_path())],
              "attnlab set_gemm_path: auto, blas or aten, got ", path);
  return before;
}

// mask.h's rule over a whole problem, for tests/test_rule.py: each query row's keys
// [lo, hi) (Lq,), each block of bq rows' keys (nqb,), and whether each bq x bk tile
// needs no mask (nqb, nkb).
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> rule_tiles(int64_t q_len, int64_t k_len,
                                                              int64_t offset, bool causal,
                                                              int64_t window, int64_t bq,
                                                              int64_t bk) {
  TORCH_CHECK(q_len >= 0 && k_len >= 0 && bq > 0 && bk > 0 && window >= 0, "rule_tiles: sizes");
  const Rule rule{k_len, offset, causal, window};
  const int64_t nqb = (q_len + bq - 1) / bq, nkb = (k_len + bk - 1) / bk;
  Tensor lo = at::empty({q_len}, at::kLong), hi = at::empty({q_len}, at::kLong);
  Tensor blo = at::empty({nqb}, at::kLong), bhi = at::empty({nqb}, at::kLong);
  Tensor full = at::empty({nqb, nkb}, at::kBool);
  for (int64_t i = 0; i < q_len; ++i) rule.bounds(i, lo.data_ptr<int64_t>()[i], hi.data_ptr<int64_t>()[i]);
  for (int64_t qb = 0; qb < nqb; ++qb) {
    const int64_t qs = qb * bq, qe = std::min(qs + bq, q_len);
    rule.block(qs, qe, blo.data_ptr<int64_t>()[qb], bhi.data_ptr<int64_t>()[qb]);
    for (int64_t kb = 0; kb < nkb; ++kb)
      full.data_ptr<bool>()[qb * nkb + kb] = rule.full(qs, qe, kb * bk, std::min(kb * bk + bk, k_len));
  }
  return {lo, hi, blo, bhi, full};
}

// Whether float tiles go through the AVX-512 tile kernel (tile_gemm.h) now.
bool tile_kernel_active() { return use_tile_kernel<float>(); }

}  // namespace
}  // namespace attnlab

TORCH_LIBRARY(attnlab_native, m) {
  m.def(
      "flash_forward(Tensor q, Tensor k, Tensor v, Tensor? mask, bool causal, int window, "
      "int offset, float scale, float dropout_p, int seed, int block_q, int block_k) -> "
      "(Tensor, Tensor)");
  m.def(
      "flash_backward(Tensor q, Tensor k, Tensor v, Tensor? mask, Tensor out, Tensor lse, "
      "Tensor grad_out, bool causal, int window, int offset, float scale, float dropout_p, "
      "int seed, int block_q, int block_k) -> (Tensor, Tensor, Tensor)");
  m.def("set_gemm_path(str path) -> str", &attnlab::set_gemm_path);
  m.def(
      "rule_tiles(int q_len, int k_len, int offset, bool causal, int window, int bq, int bk) -> "
      "(Tensor, Tensor, Tensor, Tensor, Tensor)",
      &attnlab::rule_tiles);
  m.def("tile_kernel_active() -> bool", &attnlab::tile_kernel_active);
}

TORCH_LIBRARY_IMPL(attnlab_native, CPU, m) {
  m.impl("flash_forward", &attnlab::flash_forward);
  m.impl("flash_backward", &attnlab::flash_backward);
}
