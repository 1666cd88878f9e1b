// decode_layers: one decoded row through a run of pre-norm decoder layers in one
// call, from the kernels of decode.cpp and decode_step.cpp (decode.h). The Python
// side is _decode.layers; models/decoding.py decides which blocks it may stand in for.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <optional>
#include <vector>

#include "decode.h"

namespace attnlab {
namespace {

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
// one runs). Should a layer still raise, the layers before it have written their
// new key and value at pos, which the caller's crop puts back beyond seq_len.
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
    if (t.defined() && !usable(t)) return false;
  const bool swiglu = L.mlp == 3;
  if (L.norm < 0 || L.norm > 1 || L.mlp < 0 || L.mlp > 3 || raw[12].defined() != swiglu ||
      !raw[10].defined() || !raw[16].defined())
    return false;
  for (int i = 0; i < 4; ++i)  // the norms' weights and biases: (d,) contiguous or none
    if (raw[i].defined() && (raw[i].dim() != 1 || raw[i].size(0) != d || !raw[i].is_contiguous()))
      return false;
  if (L.norm == 0 && (raw[1].defined() || raw[3].defined())) return false;  // RMSNorm: no bias
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
                        L.v.is_contiguous() && usable(L.k) && usable(L.v) &&
                        L.pos >= 0 && L.pos < L.k.size(2);
  if (!cache_ok || L.cos.has_value() != L.sin.has_value()) return false;
  for (const auto* t : {&L.cos, &L.sin})
    if (t->has_value() && ((*t)->dim() != 2 || (*t)->size(0) <= L.pos || (*t)->size(1) != D ||
                           !(*t)->is_contiguous() || !usable(**t) || D % 2))
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
  if (x.numel() != d || !usable(x) ||
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
      "decode_layers(Tensor x, Tensor?[] params, Tensor?[] cos, Tensor?[] sin, "
      "Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, int[] pos, int[] window, int[] num_heads, "
      "int[] num_kv_heads, float[] scale, int[] norm, float[] eps, int[] mlp) -> Tensor?");
}

TORCH_LIBRARY_IMPL(attnlab_native, CPU, m) {
  m.impl("decode_layers", &attnlab::decode_layers);
}
