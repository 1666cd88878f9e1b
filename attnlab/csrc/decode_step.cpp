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
// or undefined for no rotation; k_cache and v_cache (B, Hkv, Lmax, D), contiguous.
// The new token sits at position `pos` of the cache and sees the keys mask.h's causal
// rule leaves it (the last `window` ones; window 0: all of them). Returns (B, 1, Hq * D).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

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

// s[j] = q . keys[j] for the n rows of keys (row stride D): eight keys at a time,
// eight independent accumulators (one dot product alone is a chain of dependent adds).
ATTNLAB_PER_ISA static void scores(float* s, const float* q, const float* keys, int64_t n,
                                  int64_t D) {
  const int64_t Dv = D - D % 8;
  float tail[8 * 64];  // the last block's keys, zero-padded to eight rows of up to 64
  for (int64_t j0 = 0; j0 < n; j0 += 8) {
    const int64_t m = std::min<int64_t>(8, n - j0);
    const float* k0 = keys + j0 * D;
    if (m < 8 && Dv == D && D <= 64) {
      std::copy(k0, k0 + m * D, tail);
      std::fill(tail + m * D, tail + 8 * D, 0.0f);
      k0 = tail;
    } else if (m < 8) {  // a short last block of wider rows: plain dot products
      for (int64_t k = 0; k < m; ++k) {
        float t = 0.0f;
        for (int64_t d = 0; d < D; ++d) t += q[d] * k0[k * D + d];
        s[j0 + k] = t;
      }
      continue;
    }
    f8 acc[8] = {};
    for (int64_t d = 0; d < Dv; d += 8) {
      const f8 qv = load8(q + d);
#pragma GCC unroll 8
      for (int k = 0; k < 8; ++k) acc[k] += qv * load8(k0 + k * D + d);
    }
    float out[8];
    store8(out, lane_sums(acc));
    for (int64_t k = 0; k < m; ++k) {
      for (int64_t d = Dv; d < D; ++d) out[k] += q[d] * k0[k * D + d];
      s[j0 + k] = out[k];
    }
  }
}

// y += a * x
ATTNLAB_PER_ISA static void axpy(float* y, const float* x, float a, int64_t n) {
  for (int64_t j = 0; j < n; ++j) y[j] += a * x[j];
}

// o = sum over j of p[j] * vals[j] (n rows, stride D), o overwritten: 64 columns at a
// time held in registers across the rows.
ATTNLAB_PER_ISA static void weighted_rows(float* o, const float* p, const float* vals, int64_t n,
                                         int64_t D) {
  int64_t d0 = 0;
  for (; d0 + 64 <= D; d0 += 64) {
    f8 acc[8] = {};
    for (int64_t j = 0; j < n; ++j) {
      const f8 pj = splat8(p[j]);
#pragma GCC unroll 8
      for (int c = 0; c < 8; ++c) acc[c] += pj * load8(vals + j * D + d0 + 8 * c);
    }
    for (int c = 0; c < 8; ++c) store8(o + d0 + 8 * c, acc[c]);
  }
  for (int64_t d = d0; d < D; ++d) o[d] = 0.0f;
  for (int64_t j = 0; j < n && d0 < D; ++j)
    for (int64_t d = d0; d < D; ++d) o[d] += p[j] * vals[j * D + d];
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
                  k_cache.scalar_type() == at::kFloat && v_cache.scalar_type() == at::kFloat,
              "attnlab decode_step: contiguous float32 caches of one shape");
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
  const int64_t G = Hq / Hkv, row = qkv.stride(0);
  int64_t lo, hi;  // the keys the new token sees (mask.h): it sits last, at pos
  Rule{pos + 1, pos, true, window}.bounds(0, 0, lo, hi);
  const int64_t n = hi - lo;
  const float* src = qkv.data_ptr<float>();
  float* kc = k_cache.data_ptr<float>();
  float* vc = v_cache.data_ptr<float>();
  // The new key and value go into the cache first: the query attends to itself too.
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < Hkv; ++h) {
      const float* k = src + b * row + (Hq + h) * D;
      const float* v = src + b * row + (Hq + Hkv + h) * D;
      float* kd = kc + ((b * Hkv + h) * Lmax + pos) * D;
      if (rope) {
        rotate(kd, k, cos, sin, D);
      } else {
        std::copy(k, k + D, kd);
      }
      std::copy(v, v + D, vc + ((b * Hkv + h) * Lmax + pos) * D);
    }
  }
  at::Tensor out = at::empty({B, 1, Hq * D}, qkv.options());
  float* o = out.data_ptr<float>();
  // Work items: (sequence, kv head, chunk of keys). A (sequence, kv head)'s G query
  // heads read each cached row once, while it is in cache. The rows come from memory
  // (the weights streamed since evicted them), so both threads should pull: with
  // fewer (sequence, kv head) pairs than a multiple of the threads, the keys are cut
  // into chunks, each chunk's softmax kept unnormalised with its max and sum, and the
  // chunks merged after (flash-decoding). Small problems stay on one thread.
  const int64_t pairs = B * Hkv, threads = at::get_num_threads();
  const bool small = B * Hq * n * D < (int64_t{1} << 14);
  const int64_t chunks = small ? 1
                               : std::min<int64_t>(threads / std::gcd(pairs, threads),
                                                   std::max<int64_t>(1, n / 16));
  const int64_t items = pairs * chunks, stride = D + 2;  // per head: o (D), max, sum
  std::vector<float> part(chunks > 1 ? items * G * stride : 0);
  at::parallel_for(0, items, small ? items : 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(G * D), s(n);
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
      const float* keys = kc + ((b * Hkv + hk) * Lmax + lo + j0) * D;
      const float* vals = vc + ((b * Hkv + hk) * Lmax + lo + j0) * D;
      for (int64_t g = 0; g < G; ++g) {
        scores(s.data(), q.data() + g * D, keys, m, D);
        if (terms.any()) terms.apply(0, hk * G + g, pos, lo + j0, s.data(), m, (float*)nullptr);
        const float top = row_max(s.data(), m), sum = exp_shift_sum(s.data(), m, top);
        if (chunks == 1) {  // the group's G heads lie side by side in the output
          float* od = o + b * Hq * D + (hk * G + g) * D;
          weighted_rows(od, s.data(), vals, m, D);
          scale_row(od, D, normaliser(top, sum, sink, hk * G + g));
        } else {
          float* pd = part.data() + (item * G + g) * stride;
          weighted_rows(pd, s.data(), vals, m, D);
          pd[D] = top, pd[D + 1] = sum;
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
