// The small operations of decoding one sequence, each one call instead of several.
//
// decode_step: one decoding step of one attention layer, fused: rotate the new token's query
// and key (RoPE, half-split), write its key and value into the KV cache, attend
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
// The new token sits at position `pos` of the cache; it sees keys
// max(0, pos - window + 1) .. pos (window 0: all of them). Returns (B, 1, Hq * D).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

#include "row_product.h"
#include "tile_gemm.h"
#include "tile_math.h"

namespace attnlab {
namespace {

ATTNLAB_CLONES static float dot(const float* a, const float* b, int64_t n) {
  f8 acc{};
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) acc += load8(a + j) * load8(b + j);
  float out = sum8(acc);
  for (; j < n; ++j) out += a[j] * b[j];
  return out;
}

// y += a * x
ATTNLAB_CLONES static void axpy(float* y, const float* x, float a, int64_t n) {
  for (int64_t j = 0; j < n; ++j) y[j] += a * x[j];
}

// dst = x * cos + roll(x, n / 2) * sin (sin signed as rope.py keeps it); dst != x.
static void rotate(float* dst, const float* x, const float* cos, const float* sin, int64_t n) {
  const int64_t half = n / 2;
  for (int64_t i = 0; i < n; ++i) dst[i] = x[i] * cos[i] + x[(i + half) % n] * sin[i];
}

at::Tensor decode_step(const at::Tensor& qkv, const c10::optional<at::Tensor>& cos_table,
                       const c10::optional<at::Tensor>& sin_table, at::Tensor& k_cache,
                       at::Tensor& v_cache, int64_t pos, int64_t window, int64_t num_heads,
                       int64_t num_kv_heads, double scale) {
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
  const int64_t G = Hq / Hkv, row = qkv.stride(0);
  const int64_t lo = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0, n = pos + 1 - lo;
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
  // One work item per (sequence, kv head): its G query heads read each cached key
  // and value row once, while the row is in cache. Small problems stay on one
  // thread: waking the other costs more than it saves.
  const int64_t grain = B * Hq * n * D < (int64_t{1} << 17) ? B * Hkv : 1;
  at::parallel_for(0, B * Hkv, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> q(G * D), s(G * n);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / Hkv, hk = item % Hkv;
      for (int64_t g = 0; g < G; ++g) {  // the group's queries, rotated and scaled
        const float* qs = src + b * row + (hk * G + g) * D;
        if (rope) {
          rotate(q.data() + g * D, qs, cos, sin, D);
        } else {
          std::copy(qs, qs + D, q.data() + g * D);
        }
        scale_row(q.data() + g * D, D, float(scale));
      }
      const float* keys = kc + ((b * Hkv + hk) * Lmax + lo) * D;
      const float* vals = vc + ((b * Hkv + hk) * Lmax + lo) * D;
      for (int64_t j = 0; j < n; ++j) {
        for (int64_t g = 0; g < G; ++g) s[g * n + j] = dot(q.data() + g * D, keys + j * D, D);
      }
      float* od = o + b * Hq * D + hk * G * D;  // the group's G heads lie side by side
      std::fill(od, od + G * D, 0.0f);
      std::vector<float> inv(G);
      for (int64_t g = 0; g < G; ++g) {
        float* sg = s.data() + g * n;
        inv[g] = 1.0f / exp_shift_sum(sg, n, row_max(sg, n));
      }
      for (int64_t j = 0; j < n; ++j) {
        for (int64_t g = 0; g < G; ++g) axpy(od + g * D, vals + j * D, s[g * n + j], D);
      }
      for (int64_t g = 0; g < G; ++g) scale_row(od + g * D, D, inv[g]);
    }
  });
  return out;
}

// rms_norm: x * rsqrt(mean(x^2) + eps) * weight over the last dimension, one pass per
// row. torch's CPU rms_norm is six dispatched operations (square, mean, add,
// rsqrt, two products); at one row per call that is most of its cost.
ATTNLAB_CLONES static void rms_norm_row(float* out, const float* x, const float* w, int64_t n,
                                        float eps) {
  f8 acc{};
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const f8 v = load8(x + j);
    acc += v * v;
  }
  float sq = sum8(acc);
  for (; j < n; ++j) sq += x[j] * x[j];
  const float r = 1.0f / std::sqrt(sq / float(n) + eps);
  if (w == nullptr) {
    for (int64_t i = 0; i < n; ++i) out[i] = x[i] * r;
  } else {
    for (int64_t i = 0; i < n; ++i) out[i] = x[i] * r * w[i];
  }
}

at::Tensor rms_norm(const at::Tensor& x, const c10::optional<at::Tensor>& weight, double eps) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() >= 1,
              "attnlab rms_norm: CPU float32 only");
  const at::Tensor xc = x.contiguous();
  const int64_t n = x.size(-1), rows = n == 0 ? 0 : xc.numel() / n;
  const float* w = nullptr;
  if (weight.has_value() && weight->defined()) {
    TORCH_CHECK(weight->is_contiguous() && weight->scalar_type() == at::kFloat &&
                    weight->numel() == n,
                "attnlab rms_norm: weight (n,) float32");
    w = weight->data_ptr<float>();
  }
  at::Tensor out = at::empty_like(xc);
  const float* src = xc.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, n));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) rms_norm_row(dst + r * n, src + r * n, w, n, float(eps));
  });
  return out;
}

// silu_mul: SwiGLU's silu(gate) * up from the joint (..., 2F) product [gate | up] to
// (..., F): one pass instead of a split, a silu and a product.
ATTNLAB_CLONES static void silu_mul_row(float* out, const float* gate, const float* up,
                                        int64_t n) {
  int64_t i = 0;  // the vectorised exp of tile_math.h: a scalar std::exp per value cost 13 us
  for (; i + 8 <= n; i += 8) {
    const f8 g = load8(gate + i);
    store8(out + i, g / (1.0f + exp8(-g)) * load8(up + i));
  }
  for (; i < n; ++i) out[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.device().is_cpu() && gate_up.scalar_type() == at::kFloat &&
                  gate_up.dim() >= 1 && gate_up.size(-1) % 2 == 0,
              "attnlab silu_mul: CPU float32 (..., 2F)");
  const at::Tensor gu = gate_up.contiguous();
  const int64_t n = gu.size(-1) / 2, rows = n == 0 ? 0 : gu.numel() / (2 * n);
  std::vector<int64_t> shape(gu.sizes().begin(), gu.sizes().end());
  shape.back() = n;
  at::Tensor out = at::empty(shape, gu.options());
  const float* src = gu.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 15) / std::max<int64_t>(1, n));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) silu_mul_row(dst + r * n, src + r * 2 * n, src + r * 2 * n + n, n);
  });
  return out;
}

// One row x (numel = in) times an nn.Linear weight (out, in) stored by rows (unit
// stride along in) or by columns (unit stride along out, the packed blocks), plus
// bias (out,) and residual (numel = out), each optional: row_product.h's streamed
// product. Returns (..., out) shaped like x, or None for a layout it does not read.
std::optional<at::Tensor> one_row(const at::Tensor& x, const at::Tensor& w,
                                  const std::optional<at::Tensor>& bias,
                                  const std::optional<at::Tensor>& residual) {
  auto usable = [](const at::Tensor& t) {
    return t.scalar_type() == at::kFloat && t.device().is_cpu();
  };
  if (!usable(x) || !usable(w) || w.dim() != 2 || x.dim() < 1 || x.size(-1) != w.size(1) ||
      x.numel() != w.size(1) || !x.is_contiguous())
    return std::nullopt;
  const int64_t n_out = w.size(0), n_in = w.size(1);
  const bool by_rows = w.stride(1) == 1 && (n_out <= 1 || w.stride(0) >= n_in);
  const bool by_columns = !by_rows && w.stride(0) == 1 && (n_in <= 1 || w.stride(1) >= n_out);
  if (!by_rows && !by_columns) return std::nullopt;
  for (const auto* t : {&bias, &residual}) {
    if (t->has_value() && (!usable(**t) || (*t)->numel() != n_out || !(*t)->is_contiguous()))
      return std::nullopt;
  }
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n_out;
  at::Tensor y = at::empty(shape, x.options());
  if (n_out > 0)
    row_product(x.data_ptr<float>(), w.data_ptr<float>(), by_rows ? w.stride(0) : w.stride(1),
                by_rows, n_in, n_out, bias.has_value() ? bias->data_ptr<float>() : nullptr,
                residual.has_value() ? residual->data_ptr<float>() : nullptr,
                y.data_ptr<float>());
  return y;
}

// Up to this many rows go through the tile kernel; more, and BLAS's blocking of the
// rows pays (the tile kernel streams all of x once per 64 outputs).
constexpr int64_t FEW_ROWS = 64;

// linear (inference): x W^T + bias (+ residual) for x (..., in) and an nn.Linear weight
// (out, in): one row by one_row; a few rows (<= FEW_ROWS), W stored by columns (the
// packed blocks), by the AVX-512 tile kernel where the CPU has it, threads taking
// bands of 64 outputs; None otherwise (the caller runs F.linear).
std::optional<at::Tensor> linear(const at::Tensor& x, const at::Tensor& w,
                                 const std::optional<at::Tensor>& bias,
                                 const std::optional<at::Tensor>& residual) {
  if (x.dim() >= 1 && w.dim() == 2 && x.size(-1) == w.size(1) && x.numel() == w.size(1))
    return one_row(x, w, bias, residual);
  if (!tile_gemm_supported() || residual.has_value() || x.scalar_type() != at::kFloat ||
      w.scalar_type() != at::kFloat || !x.device().is_cpu() || !w.device().is_cpu() ||
      w.dim() != 2 || x.dim() < 1 || x.size(-1) != w.size(1) || !x.is_contiguous() ||
      w.stride(0) != 1 || w.stride(1) < w.size(0))
    return std::nullopt;
  const int64_t n_in = w.size(1), n_out = w.size(0), ld = w.stride(1);
  const int64_t rows = n_in == 0 ? 0 : x.numel() / n_in;
  if (rows > FEW_ROWS || n_in == 0) return std::nullopt;
  if (bias.has_value() && (bias->scalar_type() != at::kFloat || !bias->device().is_cpu() ||
                           bias->numel() != n_out || !bias->is_contiguous()))
    return std::nullopt;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n_out;
  at::Tensor y = at::empty(shape, x.options());
  const float* a = x.data_ptr<float>();
  const float* b = w.data_ptr<float>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* c = y.data_ptr<float>();
  const int64_t bands = (n_out + PANEL - 1) / PANEL;
  at::parallel_for(0, bands, 1, [&](int64_t begin, int64_t end) {
    const int64_t j0 = begin * PANEL, j1 = std::min(end * PANEL, n_out);
    tile_gemm(rows, j1 - j0, n_in, 1.0f, a, n_in, 1, b + j0, ld, false, c + j0, n_out);
    if (bp != nullptr)
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t j = j0; j < j1; ++j) c[r * n_out + j] += bp[j];
  });
  return y;
}

// one_row, or ATen's product where one_row does not read the layout.
at::Tensor linear_row(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias,
                      const at::Tensor& residual) {
  auto opt = [](const at::Tensor& t) {
    return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
  };
  if (auto y = one_row(x, w, opt(bias), opt(residual))) return *y;
  at::Tensor y = at::linear(x, w, opt(bias));
  return residual.defined() ? y.add_(residual.view_as(y)) : y;
}

// decode_layers: one decoded row through a run of pre-norm decoder layers, each
//   y = x + out(attend(qkv(norm1(x)))),  y + down(act(up(norm2(y)))),
// in one call: the products by one_row, the rest by the kernels above. Through
// the modules a layer is about forty Python-level calls, and decoding one token at a
// time pays each of them per layer per token, cold, between products that stream
// the weights through the caches. Per layer l, `params[18 l ...]` are weight then bias
// of: norm1, norm2, W_query, W_key, W_value, out_proj, gate (SwiGLU only), fc, proj
// (null where a layer has none). Q/K/V and gate/fc must be packed groups
// (modules/fused.py: (out, in) views with strides (1, width) of one (in, width)
// block, side by side): checked here, each group then multiplied as its block.
// norm: 0 RMSNorm, 1 LayerNorm; mlp: 0 GELU, 1 GELU (tanh), 2 ReLU, 3 SwiGLU. The new
// token takes position pos[l] of layer l's cache (k_caches[l], v_caches[l],
// (1, Hkv, Lmax, D)). x is (1, 1, d). Returns y (1, 1, d), or None, nothing written,
// where a tensor is not what this reads (checked for every layer before the first
// one runs).
constexpr size_t LAYER_PARAMS = 18;

struct Layer {
  // norm1 w, b, norm2 w, b; then the products' weights and biases, the groups joined:
  // qkv w, b, out w, b, up w, b, down w, b (p[4..11]).
  std::vector<at::Tensor> p;
  std::optional<at::Tensor> cos, sin;
  at::Tensor k, v;
  int64_t pos, window, heads, kv_heads, norm, mlp;
  double scale, eps;
};

// The packed block of a group of linears (weights w[i], biases b[i], all or none):
// (width, in) and (width,) views, or false if they no longer lie side by side.
bool join(const std::vector<at::Tensor>& w, const std::vector<at::Tensor>& b, at::Tensor& wj,
          at::Tensor& bj) {
  if (!w[0].defined() || w[0].dim() != 2 || w[0].stride(0) != 1) return false;
  const int64_t width = w[0].stride(1), n_in = w[0].size(1);
  int64_t at = 0;
  for (size_t i = 0; i < w.size(); ++i) {
    if (!w[i].defined() || w[i].dim() != 2 || w[i].size(1) != n_in || w[i].stride(0) != 1 ||
        w[i].stride(1) != width || b[i].defined() != b[0].defined() ||
        w[i].data_ptr<float>() != w[0].data_ptr<float>() + at)
      return false;
    if (b[i].defined() && (b[i].dim() != 1 || b[i].stride(0) != 1 || b[i].size(0) != w[i].size(0) ||
                           b[i].data_ptr<float>() != b[0].data_ptr<float>() + at))
      return false;
    at += w[i].size(0);
  }
  if (at != width) return false;
  wj = w[0].as_strided({width, n_in}, {1, width});
  bj = b[0].defined() ? b[0].as_strided({width}, {1}) : at::Tensor();
  return true;
}

// Fill L.p from one layer's 18 parameters (raw, in decode_layers' order) and check
// them and the layer's cache; false where they are not what this reads.
bool layer_ok(int64_t d, const std::vector<at::Tensor>& raw, Layer& L) {
  for (const at::Tensor& t : raw)
    if (t.defined() && (t.scalar_type() != at::kFloat || !t.device().is_cpu())) return false;
  const bool swiglu = L.mlp == 3;
  if (L.norm < 0 || L.norm > 1 || L.mlp < 0 || L.mlp > 3 || raw[12].defined() != swiglu ||
      !raw[10].defined() || !raw[16].defined())
    return false;
  std::vector<at::Tensor>& p = L.p;
  p.assign(12, at::Tensor());
  for (int i = 0; i < 4; ++i) p[i] = raw[i];  // the norms
  p[6] = raw[10], p[7] = raw[11], p[10] = raw[16], p[11] = raw[17];
  const std::vector<at::Tensor> up_w = swiglu ? std::vector<at::Tensor>{raw[12], raw[14]}
                                              : std::vector<at::Tensor>{raw[14]};
  const std::vector<at::Tensor> up_b = swiglu ? std::vector<at::Tensor>{raw[13], raw[15]}
                                              : std::vector<at::Tensor>{raw[15]};
  if (!join({raw[4], raw[6], raw[8]}, {raw[5], raw[7], raw[9]}, p[4], p[5]) ||
      !join(up_w, up_b, p[8], p[9]))
    return false;
  const int64_t D = L.k.dim() == 4 ? L.k.size(3) : 0;
  const int64_t f = p[8].size(0) / (swiglu ? 2 : 1);
  if (p[4].size(1) != d || p[4].size(0) != (L.heads + 2 * L.kv_heads) * D || p[6].dim() != 2 ||
      p[6].size(0) != d || p[6].size(1) != L.heads * D || p[8].size(1) != d ||
      p[10].dim() != 2 || p[10].size(0) != d || p[10].size(1) != f ||
      (swiglu && raw[12].size(0) != raw[14].size(0)))
    return false;
  const bool cache_ok = L.k.dim() == 4 && L.k.sizes() == L.v.sizes() && L.k.size(0) == 1 &&
                        L.k.size(1) == L.kv_heads && L.kv_heads > 0 &&
                        L.heads % L.kv_heads == 0 && L.k.is_contiguous() &&
                        L.v.is_contiguous() && L.k.scalar_type() == at::kFloat &&
                        L.v.scalar_type() == at::kFloat && L.k.device().is_cpu() &&
                        L.pos >= 0 && L.pos < L.k.size(2);
  if (!cache_ok || L.cos.has_value() != L.sin.has_value()) return false;
  for (const auto* t : {&L.cos, &L.sin})
    if (t->has_value() && ((*t)->dim() != 2 || (*t)->size(0) <= L.pos || (*t)->size(1) != D ||
                           !(*t)->is_contiguous() || (*t)->scalar_type() != at::kFloat || D % 2))
      return false;
  return true;
}

// One layer on the row h (1, d): L.p as layer_ok leaves it.
at::Tensor layer_run(const at::Tensor& h, const Layer& L) {
  const std::vector<at::Tensor>& p = L.p;
  const int64_t d = h.size(1);
  auto normed = [&](const at::Tensor& t, int i) {
    if (L.norm == 0)
      return rms_norm(t, p[i].defined() ? std::optional<at::Tensor>(p[i]) : std::nullopt, L.eps);
    return at::layer_norm(t, {d}, p[i], p[i + 1], L.eps);
  };
  const at::Tensor none;
  const at::Tensor qkv = linear_row(normed(h, 0), p[4], p[5], none);
  at::Tensor k = L.k, v = L.v;
  const at::Tensor heads = decode_step(qkv.view({1, 1, qkv.size(1)}), L.cos, L.sin, k, v, L.pos,
                                       L.window, L.heads, L.kv_heads, L.scale);
  // The residuals ride in the products: y = x + heads W_out^T + b, no temporary.
  const at::Tensor y = linear_row(heads.view({1, -1}), p[6], p[7], h);
  const at::Tensor up = linear_row(normed(y, 2), p[8], p[9], none);
  const at::Tensor act = L.mlp == 3   ? silu_mul(up)
                         : L.mlp == 2 ? at::relu(up)
                                      : at::gelu(up, L.mlp == 1 ? "tanh" : "none");
  return linear_row(act, p[10], p[11], y);
}

std::optional<at::Tensor> decode_layers(
    const at::Tensor& x, const c10::List<std::optional<at::Tensor>>& params,
    const c10::List<std::optional<at::Tensor>>& cos, const c10::List<std::optional<at::Tensor>>& sin,
    at::TensorList k_caches, at::TensorList v_caches, at::IntArrayRef pos, at::IntArrayRef window,
    at::IntArrayRef heads, at::IntArrayRef kv_heads, at::ArrayRef<double> scale,
    at::IntArrayRef norm, at::ArrayRef<double> eps, at::IntArrayRef mlp) {
  const size_t n = k_caches.size();
  const int64_t d = x.size(-1);
  if (x.numel() != d || x.scalar_type() != at::kFloat || !x.device().is_cpu() ||
      params.size() != LAYER_PARAMS * n || cos.size() != n || sin.size() != n || v_caches.size() != n ||
      pos.size() != n || window.size() != n || heads.size() != n || kv_heads.size() != n ||
      scale.size() != n || norm.size() != n || eps.size() != n || mlp.size() != n)
    return std::nullopt;
  std::vector<Layer> layers(n);
  std::vector<at::Tensor> raw(LAYER_PARAMS);
  for (size_t l = 0; l < n; ++l) {
    Layer& L = layers[l];
    for (size_t i = 0; i < LAYER_PARAMS; ++i) {
      const std::optional<at::Tensor> t = params.get(LAYER_PARAMS * l + i);
      raw[i] = t.has_value() ? *t : at::Tensor();
    }
    L.cos = cos.get(l), L.sin = sin.get(l);
    L.k = k_caches[l], L.v = v_caches[l];
    L.pos = pos[l], L.window = window[l], L.heads = heads[l], L.kv_heads = kv_heads[l];
    L.scale = scale[l], L.norm = norm[l], L.eps = eps[l], L.mlp = mlp[l];
    if (!layer_ok(d, raw, L)) return std::nullopt;
  }
  at::Tensor h = x.reshape({1, d}).contiguous();
  for (const Layer& L : layers) h = layer_run(h, L);
  return h.view_as(x);
}

}  // namespace
}  // namespace attnlab

TORCH_LIBRARY_FRAGMENT(attnlab_native, m) {
  m.def(
      "decode_step(Tensor qkv, Tensor? cos, Tensor? sin, Tensor(a!) k_cache, "
      "Tensor(b!) v_cache, int pos, int window, int num_heads, int num_kv_heads, "
      "float scale) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor? weight, float eps) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("linear(Tensor x, Tensor weight, Tensor? bias, Tensor? residual) -> Tensor?");
  m.def(
      "decode_layers(Tensor x, Tensor?[] params, Tensor?[] cos, Tensor?[] sin, "
      "Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, int[] pos, int[] window, int[] num_heads, "
      "int[] num_kv_heads, float[] scale, int[] norm, float[] eps, int[] mlp) -> Tensor?");
}

TORCH_LIBRARY_IMPL(attnlab_native, CPU, m) {
  m.impl("decode_step", &attnlab::decode_step);
  m.impl("rms_norm", &attnlab::rms_norm);
  m.impl("silu_mul", &attnlab::silu_mul);
  m.impl("decode_layers", &attnlab::decode_layers);
  m.impl("linear", &attnlab::linear);
}
