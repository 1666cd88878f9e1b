// decode_step: one decoding step of one attention layer, fused: rotate the new token's
// query and key (RoPE, half-split), write its key and value into the KV cache, attend
// from the query to every cached key the window leaves.
//
// Decoding one sequence costs a weight read per matrix and, for the rest, the
// number of small operations per layer: done as PyTorch ops the step above is
// about fifteen of them (views, roll, two products for RoPE, four cache slices
// and copies, SDPA, the output reshape), each a dispatch of a few microseconds
// on 64 numbers per head. Here it is one call.
//
// Shapes: qkv (B, 1, (Hq + 2 Hkv) * D), the packed projection of the new token
// (queries, then keys, then values, head by head); cos and sin the rotary tables
// (P, D) in rope.py's convention (sin signed: rot(x) = x cos + roll(x, D/2) sin),
// or undefined for no rotation; k_cache and v_cache (B, Hkv, Lmax, D), contiguous, float32
// or bf16 (the kernel is a template on the cache's storage type, convert.h: cached rows
// are widened as they are read and the new key and value rounded as they are written;
// the attention itself is float32).
// The new token sits at position `pos` of the cache and sees the keys mask.h's causal
// rule leaves it (the last `window` ones; window 0: all of them). Returns (B, 1, Hq * D).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "busy.h"
#include "convert.h"
#include "decode.h"
#include "mask.h"
#include "rows.h"

namespace attnlab {
namespace {

// The eight lane sums of eight vectors, in order: out[k] = sum of a[k]'s lanes. A
// transpose tree (three rounds of pairwise shuffles and adds) instead of eight
// serial horizontal sums, whose dependent adds cost more than the products.
#if defined(__clang__)
#define ATTNLAB_SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define ATTNLAB_SHUFFLE(a, b, ...) __builtin_shuffle(a, b, i8{__VA_ARGS__})
#endif
ATTNLAB_INLINE f8 pair_sums(f8 a, f8 b, int round) {
  // round 0: lanes (a0+a1, b0+b1, a2+a3, b2+b3, ...); 1: pairs of those; 2: halves.
  if (round == 0)
    return ATTNLAB_SHUFFLE(a, b, 0, 8, 2, 10, 4, 12, 6, 14) +
           ATTNLAB_SHUFFLE(a, b, 1, 9, 3, 11, 5, 13, 7, 15);
  if (round == 1)
    return ATTNLAB_SHUFFLE(a, b, 0, 1, 8, 9, 4, 5, 12, 13) +
           ATTNLAB_SHUFFLE(a, b, 2, 3, 10, 11, 6, 7, 14, 15);
  return ATTNLAB_SHUFFLE(a, b, 0, 1, 2, 3, 8, 9, 10, 11) +
         ATTNLAB_SHUFFLE(a, b, 4, 5, 6, 7, 12, 13, 14, 15);
}
ATTNLAB_INLINE f8 lane_sums(const f8* a) {
  const f8 r0 = pair_sums(a[0], a[1], 0), r1 = pair_sums(a[2], a[3], 0),
           r2 = pair_sums(a[4], a[5], 0), r3 = pair_sums(a[6], a[7], 0);
  return pair_sums(pair_sums(r0, r1, 1), pair_sums(r2, r3, 1), 2);
}

// The query heads of a kv head's group that one pass over its cached rows serves: each
// key and value is loaded (and, from bf16, widened) once for all of them, in registers
// (three heads' accumulators fill 28 of AVX-512's 32 vector registers in `scores`).
constexpr int64_t HEADS_A_PASS = 3;  // group_scores and group_weighted dispatch 3, 2, 1

// s[g * ls + j] = q[g] . keys[j] for the GH heads g of q (GH rows of D) and the n rows of
// keys (row stride D): eight keys at a time, sixteen dimensions a vector, one accumulator
// per (head, key) (one dot product alone is a chain of dependent adds), the eight sums of
// a head found by a transpose tree; a last short block and the last D % 16 dimensions
// one by one.
template <int GH, typename T>
ATTNLAB_INLINE void scores(float* s, int64_t ls, const float* q, const T* keys, int64_t n,
                           int64_t D) {
  const int64_t Dv = D - D % 16, n8 = n - n % 8;
  for (int64_t j0 = 0; j0 < n8; j0 += 8) {
    const T* k0 = keys + j0 * D;
    {  // the rows four blocks on, fetched now: the cache comes from memory (see attend_new)
      const char* ahead = reinterpret_cast<const char*>(keys + std::min(j0 + 32, n) * D);
      const char* stop = reinterpret_cast<const char*>(keys + std::min(j0 + 40, n) * D);
      for (; ahead < stop; ahead += 64) __builtin_prefetch(ahead);
    }
    f16v acc[GH][8] = {};
    for (int64_t d = 0; d < Dv; d += 16) {
      f16v qv[GH];
      for (int g = 0; g < GH; ++g) qv[g] = load16(q + g * D + d);
#pragma GCC unroll 8
      for (int k = 0; k < 8; ++k) {
        const f16v kv = load16(k0 + k * D + d);
        for (int g = 0; g < GH; ++g) acc[g][k] += qv[g] * kv;
      }
    }
    for (int g = 0; g < GH; ++g) {
      f8 halves[8];
      for (int k = 0; k < 8; ++k) halves[k] = fold16(acc[g][k]);
      float out[8];
      store8(out, lane_sums(halves));
      for (int k = 0; k < 8; ++k) {
        for (int64_t d = Dv; d < D; ++d) out[k] += q[g * D + d] * float(k0[k * D + d]);
        s[g * ls + j0 + k] = out[k];
      }
    }
  }
  for (int64_t j = n8; j < n; ++j)
    for (int g = 0; g < GH; ++g) {
      float t = 0.0f;
      for (int64_t d = 0; d < D; ++d) t += q[g * D + d] * float(keys[j * D + d]);
      s[g * ls + j] = t;
    }
}

// o[g * lo + d] = sum over j of p[g * lp + j] * vals[j][d] for the GH heads g (o
// overwritten; n rows of vals, stride D): NV vectors of 16 columns at a time held in
// registers across the rows, each row's vectors loaded once for every head.
template <int GH, int NV, typename T>
ATTNLAB_INLINE void weighted_columns(float* o, int64_t lo, const float* p, int64_t lp,
                                     const T* vals, int64_t n, int64_t D, int64_t d0) {
  f16v acc[GH][NV] = {};
  for (int64_t j = 0; j < n; ++j) {
    if (d0 == 0 && j + 32 < n)  // the row 32 on, fetched now (see attend_new)
      for (int64_t b = 0; b < D * int64_t(sizeof(T)); b += 64)
        __builtin_prefetch(reinterpret_cast<const char*>(vals + (j + 32) * D) + b);
    f16v v[NV];
    for (int c = 0; c < NV; ++c) v[c] = load16(vals + j * D + d0 + 16 * c);
    for (int g = 0; g < GH; ++g) {
      const f16v pj = f16v{} + p[g * lp + j];
      for (int c = 0; c < NV; ++c) acc[g][c] += pj * v[c];
    }
  }
  for (int g = 0; g < GH; ++g)
    for (int c = 0; c < NV; ++c) store16(o + g * lo + d0 + 16 * c, acc[g][c]);
}

template <int GH, typename T>
ATTNLAB_INLINE void weighted_rows(float* o, int64_t lo, const float* p, int64_t lp,
                                  const T* vals, int64_t n, int64_t D) {
  int64_t d0 = 0;
  for (; d0 + 64 <= D; d0 += 64) weighted_columns<GH, 4>(o, lo, p, lp, vals, n, D, d0);
  for (; d0 + 16 <= D; d0 += 16) weighted_columns<GH, 1>(o, lo, p, lp, vals, n, D, d0);
  for (int g = 0; g < GH; ++g)
    for (int64_t d = d0; d < D; ++d) {
      float t = 0.0f;
      for (int64_t j = 0; j < n; ++j) t += p[g * lp + j] * float(vals[j * D + d]);
      o[g * lo + d] = t;
    }
}

// Scores, then (after the softmax between) weighted rows, for `heads` query heads of one
// group, HEADS_A_PASS at a time: compiled once per instruction set.
static_assert(HEADS_A_PASS == 3, "group_scores and group_weighted take 3, 2 or 1 heads");
template <typename T>
ATTNLAB_PER_ISA static void group_scores(float* s, int64_t ls, const float* q, const T* keys,
                                         int64_t n, int64_t D, int64_t heads) {
  for (int64_t g = 0; g < heads; g += HEADS_A_PASS) {
    const int64_t left = heads - g;
    if (left >= 3) scores<3>(s + g * ls, ls, q + g * D, keys, n, D);
    else if (left == 2) scores<2>(s + g * ls, ls, q + g * D, keys, n, D);
    else scores<1>(s + g * ls, ls, q + g * D, keys, n, D);
  }
}
template <typename T>
ATTNLAB_PER_ISA static void group_weighted(float* o, int64_t lo, const float* p, int64_t lp,
                                           const T* vals, int64_t n, int64_t D, int64_t heads) {
  for (int64_t g = 0; g < heads; g += HEADS_A_PASS) {
    const int64_t left = heads - g;
    float* og = o + g * lo;
    const float* pg = p + g * lp;
    if (left >= 3) weighted_rows<3>(og, lo, pg, lp, vals, n, D);
    else if (left == 2) weighted_rows<2>(og, lo, pg, lp, vals, n, D);
    else weighted_rows<1>(og, lo, pg, lp, vals, n, D);
  }
}

// y += a * x
ATTNLAB_PER_ISA static void axpy(float* y, const float* x, float a, int64_t n) {
  for (int64_t j = 0; j < n; ++j) y[j] += a * x[j];
}

// dst = x * cos + roll(x, n / 2) * sin (sin signed as rope.py keeps it); n even, dst != x.
static void rotate(float* dst, const float* x, const float* cos, const float* sin, int64_t n) {
  const int64_t half = n / 2;
  for (int64_t i = 0; i < half; ++i) dst[i] = x[i] * cos[i] + x[i + half] * sin[i];
  for (int64_t i = half; i < n; ++i) dst[i] = x[i] * cos[i] + x[i - half] * sin[i];
}

// The factor that normalises a head's output accumulated under the maximum `top` with
// the sum `sum` of its weights: 1 / sum, or with a sink logit (which joins the
// denominator and adds no value) exp(top - M) / (sum exp(top - M) + exp(sink - M)),
// M = max(top, sink).
float normaliser(float top, float sum, const double* sink, int64_t h) {
  if (sink == nullptr) return 1.0f / sum;
  const float s = static_cast<float>(sink[h]), M = std::max(top, s);
  const float kept = std::exp(top - M);
  return kept / (sum * kept + std::exp(s - M));
}

// The step after its checks, on caches of storage type T (float or bf16): the new key
// (rotated) and value written at pos, then the query heads attended with the score
// terms (softcap, ALiBi) and sink logits; o (B, Hq * D).
template <typename T>
void attend_new(const at::Tensor& qkv, const float* cos, const float* sin, T* kc, T* vc,
                int64_t B, int64_t Hkv, int64_t Lmax, int64_t D, int64_t Hq, int64_t pos,
                int64_t window, double scale, const Scores& terms, const double* sink,
                float* o) {
  const bool rope = cos != nullptr;
  const int64_t G = Hq / Hkv, row = qkv.stride(0);
  int64_t lo, hi;  // the keys the new token sees (mask.h): it sits last, at pos
  Rule{pos + 1, pos, true, window}.bounds(0, 0, lo, hi);
  const int64_t n = hi - lo;
  const float* src = qkv.data_ptr<float>();
  // The new key and value go into the cache first: the query attends to itself too.
  std::vector<float> rotated(D);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < Hkv; ++h) {
      const float* k = src + b * row + (Hq + h) * D;
      const float* v = src + b * row + (Hq + Hkv + h) * D;
      if (rope) {
        rotate(rotated.data(), k, cos, sin, D);
        k = rotated.data();
      }
      from_acc(k, kc + ((b * Hkv + h) * Lmax + pos) * D, D);
      from_acc(v, vc + ((b * Hkv + h) * Lmax + pos) * D, D);
    }
  }
  // Work items: (sequence, kv head, chunk of keys). A (sequence, kv head)'s G query
  // heads read each cached row once, while it is in cache. The rows come from memory
  // (the weights streamed since evicted them), so both threads should pull: with
  // fewer (sequence, kv head) pairs than a multiple of the threads, the keys are cut
  // into chunks, each chunk's softmax kept unnormalised with its max and sum, and the
  // chunks merged after (flash-decoding). Small problems stay on one thread, and every
  // step while the machine is seen busy (busy.h) runs its chunks one after another: they
  // are cut for torch's thread count whatever the machine does, so the bits are too.
  const bool small = B * Hq * n * D < (int64_t{1} << 14);
  const int64_t pairs = B * Hkv, threads = at::get_num_threads();
  const bool serial = small || workers_for(4.0 * double(B * Hq * n * D)) == 1;
  const int64_t chunks = small ? 1
                               : std::min<int64_t>(threads / std::gcd(pairs, threads),
                                                   std::max<int64_t>(1, n / 16));
  const int64_t items = pairs * chunks, stride = D + 2;  // per head: o (D), max, sum
  std::vector<float> part(chunks > 1 ? items * G * stride : 0);
  at::parallel_for(0, items, serial ? items : 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(G * D), s(G * n), top(G), sum(G);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t pair = item / chunks, c = item % chunks, b = pair / Hkv, hk = pair % Hkv;
      const int64_t j0 = n * c / chunks, m = n * (c + 1) / chunks - j0;
      for (int64_t g = 0; g < G; ++g) {  // the group's queries, rotated and scaled
        const float* qs = src + b * row + (hk * G + g) * D;
        if (rope) {
          rotate(q.data() + g * D, qs, cos, sin, D);
        } else {
          std::copy(qs, qs + D, q.data() + g * D);
        }
        scale_row(q.data() + g * D, D, float(scale));
      }
      const T* keys = kc + ((b * Hkv + hk) * Lmax + lo + j0) * D;
      const T* vals = vc + ((b * Hkv + hk) * Lmax + lo + j0) * D;
      // The cached rows come from memory (the weights streamed since evicted them), in
      // runs too short for the hardware's prefetcher to reach speed: the loops fetch 32
      // rows ahead, and the first 32 of keys and values are asked for here (SmolLM-135M's
      // shape, one Zen 5 core, a cold layer: f32 at 4000 positions 411 -> 227 us, bf16 at
      // 96 positions 21 -> 13 us).
      for (const T* rows : {keys, vals}) {
        const char* p = reinterpret_cast<const char*>(rows);
        for (int64_t at = 0; at < std::min<int64_t>(m, 32) * D * int64_t(sizeof(T)); at += 64)
          __builtin_prefetch(p + at);
      }
      group_scores(s.data(), m, q.data(), keys, m, D, G);  // s: (G, m)
      for (int64_t g = 0; g < G; ++g) {
        float* sg = s.data() + g * m;
        if (terms.any()) terms.apply(0, hk * G + g, pos, lo + j0, sg, m, (float*)nullptr);
        top[g] = row_max(sg, m);
        sum[g] = exp_shift_sum(sg, m, top[g]);
      }
      if (chunks == 1) {  // the group's G heads lie side by side in the output
        float* od = o + b * Hq * D + hk * G * D;
        group_weighted(od, D, s.data(), m, vals, m, D, G);
        for (int64_t g = 0; g < G; ++g)
          scale_row(od + g * D, D, normaliser(top[g], sum[g], sink, hk * G + g));
      } else {
        float* pd = part.data() + item * G * stride;
        group_weighted(pd, stride, s.data(), m, vals, m, D, G);
        for (int64_t g = 0; g < G; ++g) {
          pd[g * stride + D] = top[g];
          pd[g * stride + D + 1] = sum[g];
        }
      }
    }
  });
  for (int64_t pair = 0; chunks > 1 && pair < pairs; ++pair) {
    for (int64_t g = 0; g < G; ++g) {
      const int64_t b = pair / Hkv, hk = pair % Hkv;
      float* od = o + b * Hq * D + (hk * G + g) * D;
      auto piece = [&](int64_t c) { return part.data() + ((pair * chunks + c) * G + g) * stride; };
      float top = piece(0)[D];
      for (int64_t c = 1; c < chunks; ++c) top = std::max(top, piece(c)[D]);
      float sum = 0.0f;
      std::fill(od, od + D, 0.0f);
      for (int64_t c = 0; c < chunks; ++c) {
        const float w = std::exp(piece(c)[D] - top);
        sum += w * piece(c)[D + 1];
        axpy(od, piece(c), w, D);
      }
      scale_row(od, D, normaliser(top, sum, sink, hk * G + g));
    }
  }
}

}  // namespace

at::Tensor decode_step(const at::Tensor& qkv, const c10::optional<at::Tensor>& cos_table,
                       const c10::optional<at::Tensor>& sin_table, at::Tensor& k_cache,
                       at::Tensor& v_cache, int64_t pos, int64_t window, int64_t num_heads,
                       int64_t num_kv_heads, double scale, double softcap,
                       const c10::optional<at::Tensor>& alibi,
                       const c10::optional<at::Tensor>& sinks) {
  TORCH_CHECK(qkv.device().is_cpu() && qkv.scalar_type() == at::kFloat,
              "attnlab decode_step: CPU float32 only");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 4 &&
                  k_cache.sizes() == v_cache.sizes() &&
                  k_cache.scalar_type() == v_cache.scalar_type() &&
                  (k_cache.scalar_type() == at::kFloat || k_cache.scalar_type() == at::kBFloat16),
              "attnlab decode_step: contiguous float32 or bf16 caches of one shape and dtype");
  const int64_t B = k_cache.size(0), Hkv = k_cache.size(1), Lmax = k_cache.size(2),
                D = k_cache.size(3), Hq = num_heads;
  TORCH_CHECK(Hkv == num_kv_heads && Hkv > 0 && Hq % Hkv == 0 && D > 0,
              "attnlab decode_step: bad head layout");
  TORCH_CHECK(qkv.dim() == 3 && qkv.size(0) == B && qkv.size(1) == 1 &&
                  qkv.size(2) == (Hq + 2 * Hkv) * D && qkv.stride(2) == 1,
              "attnlab decode_step: qkv must be (B, 1, (Hq + 2 Hkv) * D)");
  TORCH_CHECK(pos >= 0 && pos < Lmax, "attnlab decode_step: position outside the cache");
  const bool rope = cos_table.has_value() && cos_table->defined();
  const float* cos = nullptr;
  const float* sin = nullptr;
  if (rope) {
    for (const at::Tensor* t : {&*cos_table, &*sin_table}) {
      TORCH_CHECK(t->is_contiguous() && t->scalar_type() == at::kFloat && t->dim() == 2 &&
                      t->size(0) > pos && t->size(1) == D && D % 2 == 0,
                  "attnlab decode_step: rotary tables (P > pos, D) float32");
    }
    cos = cos_table->data_ptr<float>() + pos * D;
    sin = sin_table->data_ptr<float>() + pos * D;
  }
  for (const auto* t : {&alibi, &sinks})
    TORCH_CHECK(!t->has_value() || ((*t)->scalar_type() == at::kDouble && (*t)->dim() == 1 &&
                                    (*t)->size(0) == Hq && (*t)->is_contiguous()),
                "attnlab decode_step: alibi slopes and sinks are (num_heads,) float64");
  TORCH_CHECK(softcap >= 0, "attnlab decode_step: softcap must be > 0 (0: none)");
  // What mask.h does to the scores (softcap, ALiBi), and each head's sink logit.
  const Scores terms{softcap, alibi.has_value() ? alibi->data_ptr<double>() : nullptr, 0};
  const double* sink = sinks.has_value() ? sinks->data_ptr<double>() : nullptr;
  at::Tensor out = at::empty({B, 1, Hq * D}, qkv.options());
  if (k_cache.scalar_type() == at::kFloat)
    attend_new(qkv, cos, sin, k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), B, Hkv, Lmax,
               D, Hq, pos, window, scale, terms, sink, out.data_ptr<float>());
  else
    attend_new(qkv, cos, sin, k_cache.data_ptr<c10::BFloat16>(),
               v_cache.data_ptr<c10::BFloat16>(), B, Hkv, Lmax, D, Hq, pos, window, scale, terms,
               sink, out.data_ptr<float>());
  return out;
}
}  // namespace attnlab

TORCH_LIBRARY_FRAGMENT(attnlab_native, m) {
  m.def(
      "decode_step(Tensor qkv, Tensor? cos, Tensor? sin, Tensor(a!) k_cache, "
      "Tensor(b!) v_cache, int pos, int window, int num_heads, int num_kv_heads, "
      "float scale, float softcap=0., Tensor? alibi=None, Tensor? sinks=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(attnlab_native, CPU, m) {
  m.impl("decode_step", &attnlab::decode_step);
}
