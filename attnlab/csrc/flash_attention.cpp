// FlashAttention-2 for the CPU: the `flash` backend of attnlab.attention.
//
// Shapes: q (B, Hq, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv); query head h
// reads kv head h / (Hq / Hkv), so K/V are never copied (GQA/MQA). Rows may be
// strided (the last dimension has unit stride). The mask, if any, is bool
// (true = may attend) or additive in the accumulation type, expanded to (B, Hq, Lq, Lk)
// with zero strides where it broadcasts. Storage: float, double, bfloat16 or float16;
// the maths in float (double for double), tiles converted as they are read
// (convert.h); the log-sum-exp comes back in the accumulation type.
//
// The forward is flash_forward.h, the backward flash_backward.h; each is one parallel
// region. The key rule both follow is mask.h's.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <torch/library.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include <string>
#include <tuple>

#include "flash_backward.h"
#include "flash_forward.h"

namespace attnlab {
namespace {

// The accumulation dtype of inputs like t: float64 for float64, else float32.
at::ScalarType acc_type(const Tensor& t) {
  return t.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

// The rule's documents from a (3, B or 1, Lq) int64 tensor (starts, ends, offsets).
void set_documents(Rule& rule, const Tensor& doc, int64_t B, int64_t Lq) {
  TORCH_CHECK(doc.scalar_type() == at::kLong && doc.dim() == 3 && doc.size(0) == 3 &&
                  (doc.size(1) == B || doc.size(1) == 1) && doc.size(2) == Lq && doc.is_contiguous(),
              "attnlab flash: documents must be a contiguous (3, B or 1, Lq) int64 tensor");
  rule.doc = doc.data_ptr<int64_t>();
  rule.doc_sb = doc.size(1) == 1 ? 0 : Lq;
  rule.doc_plane = doc.size(1) * Lq;
}

// The variants of one call (mask.h), each None where not asked for.
struct Variants {
  double softcap;
  const std::optional<Tensor>& alibi;  // (B or 1, Hq) float64 (tiny: the kernels' own type)
  const std::optional<Tensor>& sinks;  // (Hq,) float64
  const std::optional<Tensor>& documents;
  const std::optional<Tensor>& block_kinds;    // (Bm, Hm, nq, nk) int8
  const std::optional<Tensor>& block_index;    // same shape, int64
  const std::optional<Tensor>& block_partial;  // (P, block_q, block_k) bool
};

void set_variants(Problem& P, const Variants& V) {
  TORCH_CHECK(V.softcap >= 0, "attnlab flash: softcap must be > 0 (0: none)");
  P.scores.softcap = V.softcap;
  if (V.alibi.has_value()) {
    const Tensor& a = *V.alibi;
    TORCH_CHECK(a.scalar_type() == at::kDouble && a.dim() == 2 && a.size(1) == P.Hq &&
                    (a.size(0) == P.B || a.size(0) == 1) && a.is_contiguous(),
                "attnlab flash: alibi slopes must be a contiguous (B or 1, Hq) float64 tensor");
    P.scores.alibi = a.data_ptr<double>();
    P.scores.alibi_sb = a.size(0) == 1 ? 0 : P.Hq;
  }
  if (V.sinks.has_value()) {
    const Tensor& t = *V.sinks;
    TORCH_CHECK(t.scalar_type() == at::kDouble && t.dim() == 1 && t.size(0) == P.Hq &&
                    t.is_contiguous(),
                "attnlab flash: sinks must be a contiguous (Hq,) float64 tensor");
    P.sinks = t.data_ptr<double>();
  }
  if (V.documents.has_value()) set_documents(P.rule, *V.documents, P.B, P.Lq);
  if (V.block_kinds.has_value()) {
    TORCH_CHECK(V.block_index.has_value() && V.block_partial.has_value(),
                "attnlab flash: a block mask needs kinds, index and partial");
    const Tensor &kinds = *V.block_kinds, &index = *V.block_index, &part = *V.block_partial;
    TORCH_CHECK(kinds.scalar_type() == at::kChar && kinds.dim() == 4 && kinds.is_contiguous() &&
                    index.scalar_type() == at::kLong && index.sizes() == kinds.sizes() &&
                    index.is_contiguous() && part.scalar_type() == at::kBool &&
                    part.dim() == 3 && part.is_contiguous(),
                "attnlab flash: block mask tensors of the wrong type or shape");
    BlockMask& M = P.blocks;
    M.block_q = part.size(1), M.block_k = part.size(2);
    M.nq = kinds.size(2), M.nk = kinds.size(3);
    TORCH_CHECK((kinds.size(0) == 1 || kinds.size(0) == P.B) &&
                    (kinds.size(1) == 1 || kinds.size(1) == P.Hq) &&
                    M.nq == (P.Lq + M.block_q - 1) / M.block_q &&
                    M.nk == (P.Lk + M.block_k - 1) / M.block_k && P.bq == M.block_q &&
                    P.bk == M.block_k,
                "attnlab flash: the block mask does not cover this problem in its tiles");
    M.kinds = kinds.data_ptr<int8_t>();
    M.index = index.data_ptr<int64_t>();
    M.partial = part.data_ptr<bool>();
    M.sb = kinds.size(0) == 1 ? 0 : kinds.stride(0);
    M.sh = kinds.size(1) == 1 ? 0 : kinds.stride(1);
  }
}

Problem make_problem(const Tensor& q, const Tensor& k, const Tensor& v,
                     const std::optional<Tensor>& mask, bool causal, int64_t window,
                     int64_t offset, double scale, double dropout_p, int64_t seed,
                     int64_t block_q, int64_t block_k, const Variants& variants) {
  for (const Tensor* t : {&q, &k, &v}) {
    TORCH_CHECK(t->device().is_cpu(), "attnlab flash: CPU tensors only");
    TORCH_CHECK(t->dim() == 4 && t->stride(3) == 1, "attnlab flash: 4-D rows of unit stride");
    TORCH_CHECK(t->scalar_type() == q.scalar_type(), "attnlab flash: one dtype");
  }
  const auto st = q.scalar_type();
  TORCH_CHECK(st == at::kFloat || st == at::kDouble || st == at::kBFloat16 || st == at::kHalf,
              "attnlab flash: float32, float64, bfloat16 or float16");
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
    TORCH_CHECK(m.scalar_type() == at::kBool || m.scalar_type() == acc_type(q),
                "attnlab flash: mask must be bool or of the accumulation dtype");
    P.mask = m.data_ptr();
    P.mask_is_bool = m.scalar_type() == at::kBool;
    P.m_sb = m.stride(0), P.m_sh = m.stride(1), P.m_sq = m.stride(2), P.m_sk = m.stride(3);
  }
  set_variants(P, variants);
  return P;
}

std::tuple<Tensor, Tensor> flash_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                                         const std::optional<Tensor>& mask, bool causal,
                                         int64_t window, int64_t offset, double scale,
                                         double dropout_p, int64_t seed, int64_t block_q,
                                         int64_t block_k, double softcap, const std::optional<Tensor>& alibi,
                                         const std::optional<Tensor>& sinks, const std::optional<Tensor>& documents, const std::optional<Tensor>& block_kinds,
                                         const std::optional<Tensor>& block_index, const std::optional<Tensor>& block_partial) {
  const Problem P = make_problem(q, k, v, mask, causal, window, offset, scale, dropout_p, seed,
                                 block_q, block_k,
                                 {softcap, alibi, sinks, documents, block_kinds, block_index,
                                  block_partial});
  Tensor out = at::empty({P.B, P.Hq, P.Lq, P.Dv}, q.options());
  Tensor lse = at::empty({P.B, P.Hq, P.Lq}, q.options().dtype(acc_type(q)));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(),
                                  "attnlab_flash_forward",
                                  [&] { forward_impl<scalar_t>(P, q, k, v, out, lse); });
  return {out, lse};
}

std::tuple<Tensor, Tensor, Tensor> flash_backward(
    const Tensor& q, const Tensor& k, const Tensor& v, const std::optional<Tensor>& mask,
    const Tensor& out, const Tensor& lse, const Tensor& grad_out, bool causal, int64_t window,
    int64_t offset, double scale, double dropout_p, int64_t seed, int64_t block_q,
    int64_t block_k, double softcap, const std::optional<Tensor>& alibi, const std::optional<Tensor>& sinks, const std::optional<Tensor>& documents, const std::optional<Tensor>& block_kinds,
    const std::optional<Tensor>& block_index, const std::optional<Tensor>& block_partial) {
  const Problem P = make_problem(q, k, v, mask, causal, window, offset, scale, dropout_p, seed,
                                 block_q, block_k,
                                 {softcap, alibi, sinks, documents, block_kinds, block_index,
                                  block_partial});
  TORCH_CHECK(grad_out.stride(3) == 1 && out.stride(3) == 1 && lse.is_contiguous() &&
                  lse.scalar_type() == acc_type(q) && out.scalar_type() == q.scalar_type() &&
                  grad_out.scalar_type() == q.scalar_type(),
              "attnlab flash: out, grad_out of q's dtype with rows of unit stride; lse "
              "contiguous in the accumulation dtype");
  Tensor dq = at::empty({P.B, P.Hq, P.Lq, P.D}, q.options());
  Tensor dk = at::empty({P.B, P.Hkv, P.Lk, P.D}, q.options());
  Tensor dv = at::empty({P.B, P.Hkv, P.Lk, P.Dv}, q.options());
  if (P.Lq == 0 || P.Lk == 0 || P.B == 0) return {dq.zero_(), dk.zero_(), dv.zero_()};
  const int64_t items = P.B * P.Hkv * P.key_blocks();
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(),
                                  "attnlab_flash_backward", [&] {
    const BackwardArgs<scalar_t> X{
        q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(),
        out.data_ptr<scalar_t>(), grad_out.data_ptr<scalar_t>(),
        lse.data_ptr<Acc<scalar_t>>(), Rows(q), Rows(k), Rows(v), Rows(out), Rows(grad_out),
        dq.data_ptr<scalar_t>(), dk.data_ptr<scalar_t>(), dv.data_ptr<scalar_t>()};
    backward_impl<scalar_t>(P, X, workers);
  });
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
// mask.h's rule over a whole problem (B batch elements: 1 without documents), for
// tests/test_rule.py: each query row's keys [lo, hi) (B, Lq), each block of bq rows' keys
// (B, nqb), and whether each bq x bk tile needs no mask (B, nqb, nkb).
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> rule_tiles(int64_t q_len, int64_t k_len,
                                                              int64_t offset, bool causal,
                                                              int64_t window, int64_t bq,
                                                              int64_t bk, const std::optional<Tensor>& documents) {
  TORCH_CHECK(q_len >= 0 && k_len >= 0 && bq > 0 && bk > 0 && window >= 0, "rule_tiles: sizes");
  Rule rule{k_len, offset, causal, window};
  int64_t B = 1;
  if (documents.has_value()) {
    B = documents->size(1);
    set_documents(rule, *documents, B, q_len);
  }
  const int64_t nqb = (q_len + bq - 1) / bq, nkb = (k_len + bk - 1) / bk;
  Tensor lo = at::empty({B, q_len}, at::kLong), hi = at::empty({B, q_len}, at::kLong);
  Tensor blo = at::empty({B, nqb}, at::kLong), bhi = at::empty({B, nqb}, at::kLong);
  Tensor full = at::empty({B, nqb, nkb}, at::kBool);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t i = 0; i < q_len; ++i)
      rule.bounds(b, i, lo.data_ptr<int64_t>()[b * q_len + i], hi.data_ptr<int64_t>()[b * q_len + i]);
    for (int64_t qb = 0; qb < nqb; ++qb) {
      const int64_t qs = qb * bq, qe = std::min(qs + bq, q_len);
      rule.block(b, qs, qe, blo.data_ptr<int64_t>()[b * nqb + qb], bhi.data_ptr<int64_t>()[b * nqb + qb]);
      for (int64_t kb = 0; kb < nkb; ++kb)
        full.data_ptr<bool>()[(b * nqb + qb) * nkb + kb] =
            rule.full(b, qs, qe, kb * bk, std::min(kb * bk + bk, k_len));
    }
  }
  return {lo, hi, blo, bhi, full};
}

// Whether float tiles go through the AVX-512 tile kernel (tile_gemm.h) now.
bool tile_kernel_active() { return use_tile_kernel<float>(); }

// The workers a call of `flops` takes now (busy.h's workers_for), after noting a late
// worker (busy: 1) or two workers on one core (busy: 2), or forgetting both (busy: 0),
// where asked (tests); busy -1 only asks (_native.one_thread_while_busy).
int64_t workers_now(double flops, int64_t busy) {
  if (busy == 0) {
    late_start().forget();
    shared_cores().forget();
  }
  if (busy == 1) {  // twice: workers_for acts on a second late start
    late_start().note();
    late_start().note();
  }
  if (busy == 2) shared_cores().note(1);
  return workers_for(flops);
}

// Sets the torch threads of the parallel regions begun on the calling thread, and returns
// the count now in force there; other threads keep theirs (OpenMP's count is a per-thread
// setting, which torch copies from its global one on a thread's first parallel region).
// A worker thread that runs whole pieces of work of its own (interop/minilm.py's batches)
// takes one: its products, attention and ATen ops then run inline, with no region to wait
// on, while torch.get_num_threads() elsewhere stays as the user set it. Without OpenMP
// nothing changes, and the count returned says so.
int64_t threads_here(int64_t threads) {
  TORCH_CHECK(threads >= 1, "attnlab threads_here: threads must be at least 1, got ", threads);
  // torch sets a thread's count from its global one the first time that thread enters
  // at::parallel_for, once per shared library (the flag is a thread_local of an inline
  // function: libtorch's and this extension's are two). Both first, so that neither
  // overwrites the count set here.
  at::internal::lazy_init_num_threads();
  at::get_num_threads();
#ifdef _OPENMP
  omp_set_num_threads(static_cast<int>(threads));
#endif
  return at::get_num_threads();
}

}  // namespace
}  // namespace attnlab

TORCH_LIBRARY(attnlab_native, m) {
  m.def(
      "flash_forward(Tensor q, Tensor k, Tensor v, Tensor? mask, bool causal, int window, "
      "int offset, float scale, float dropout_p, int seed, int block_q, int block_k, "
      "float softcap, Tensor? alibi, Tensor? sinks, Tensor? documents, Tensor? block_kinds, "
      "Tensor? block_index, Tensor? block_partial) -> (Tensor, Tensor)");
  m.def(
      "flash_backward(Tensor q, Tensor k, Tensor v, Tensor? mask, Tensor out, Tensor lse, "
      "Tensor grad_out, bool causal, int window, int offset, float scale, float dropout_p, "
      "int seed, int block_q, int block_k, float softcap, Tensor? alibi, Tensor? sinks, "
      "Tensor? documents, Tensor? block_kinds, Tensor? block_index, Tensor? block_partial) -> "
      "(Tensor, Tensor, Tensor)");
  m.def("set_gemm_path(str path) -> str", &attnlab::set_gemm_path);
  m.def(
      "rule_tiles(int q_len, int k_len, int offset, bool causal, int window, int bq, int bk, "
      "Tensor? documents=None) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
      &attnlab::rule_tiles);
  m.def("tile_kernel_active() -> bool", &attnlab::tile_kernel_active);
  m.def("workers_for(float flops, int busy=-1) -> int", &attnlab::workers_now);
  m.def("threads_here(int threads) -> int", &attnlab::threads_here);
}

TORCH_LIBRARY_IMPL(attnlab_native, CPU, m) {
  m.impl("flash_forward", &attnlab::flash_forward);
  m.impl("flash_backward", &attnlab::flash_backward);
}
