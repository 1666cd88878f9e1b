// DecoderRun: one decoded row through a run of pre-norm decoder layers in one call,
//   y = x + out(attend(qkv(norm1(x)))),  then  y + down(act(up(norm2(y)))),
// from the kernels of decode.cpp and decode_step.cpp (decode.h). Through the modules a
// layer is about forty Python-level calls, and decoding one token at a time pays each
// of them per layer per token, cold, between products that stream the weights through
// the caches.
//
// With post-norms (Gemma 2) each branch is normed again before it is added:
//   y = x + post_attn_norm(out(attend(...))),  y + post_mlp_norm(down(act(up(norm2(y))))).
//
// A run is built once for as long as its layers stay what they are (models/decoding.py
// builds one per `generate` call): `add` takes one layer's tensors and settings by name
// and checks them once, returning why it cannot take the layer ("" when it can); `step`
// then runs the row through every layer, checking only what changes per token (the
// caches, the positions, the rotary tables). The Python side is _decode.py.
#include <ATen/ATen.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <vector>

#include "decode.h"

namespace attnlab {
namespace {

using at::Tensor;
using std::optional;

// The kinds the fused layer runs, by the names attnlab/modules/layers.py gives them.
// rmsnorm_plus_one is Gemma's RMSNorm, x * rsqrt(mean(x^2) + eps) * (1 + weight): an
// RMSNorm whose weight add() stores as 1 + weight.
enum class Norm { RMS, Layer };
enum class Mlp { Gelu, GeluTanh, Relu, SwiGLU, GeGLU };

optional<Norm> norm_kind(const std::string& name) {
  if (name == "rmsnorm" || name == "rmsnorm_plus_one") return Norm::RMS;
  if (name == "layernorm") return Norm::Layer;
  return std::nullopt;
}

optional<Mlp> mlp_kind(const std::string& name) {
  if (name == "gelu") return Mlp::Gelu;
  if (name == "gelu_tanh") return Mlp::GeluTanh;
  if (name == "relu") return Mlp::Relu;
  if (name == "swiglu") return Mlp::SwiGLU;
  if (name == "geglu") return Mlp::GeGLU;
  return std::nullopt;
}

bool gated(Mlp m) { return m == Mlp::SwiGLU || m == Mlp::GeGLU; }

struct Layer {
  Norm norm;
  Mlp mlp;
  double eps, scale, softcap;
  Tensor norm1_weight, norm1_bias, norm2_weight, norm2_bias;  // undefined where none
  Tensor post_attn_weight, post_attn_bias, post_mlp_weight, post_mlp_bias;  // post-norms
  optional<Tensor> alibi, sinks;  // (num_heads,) float64, or none
  // The products' weights (out, in) and biases (out,) or undefined: q|k|v joined, the
  // output projection, the MLP's up ([gate | up] joined for SwiGLU) and down.
  Tensor qkv_weight, qkv_bias, out_weight, out_bias, up_weight, up_bias, down_weight, down_bias;
  int64_t heads, kv_heads, head_dim, window;
  bool rope, post_norms;
};

Tensor value(const optional<Tensor>& t) { return t.has_value() ? *t : Tensor(); }

// Why a product's weight (out, in) and bias cannot be read by linear_row, or "".
std::string product_problem(const char* name, const Tensor& w, const Tensor& b, int64_t out,
                            int64_t in) {
  if (!w.defined() || !usable(w) || w.dim() != 2 || w.size(0) != out || w.size(1) != in)
    return std::string(name) + " weight is not a (" + std::to_string(out) + ", " +
           std::to_string(in) + ") float32 CPU tensor";
  if (b.defined() && (!usable(b) || b.dim() != 1 || b.size(0) != out || !b.is_contiguous()))
    return std::string(name) + " bias is not a contiguous (" + std::to_string(out) +
           ",) float32 CPU tensor";
  return "";
}

std::string norm_problem(const char* name, const Tensor& w, const Tensor& b, Norm norm,
                         int64_t d) {
  for (const Tensor* t : {&w, &b})
    if (t->defined() && (!usable(*t) || t->dim() != 1 || t->size(0) != d || !t->is_contiguous()))
      return std::string(name) + " parameters are not contiguous (d_model,) float32 CPU tensors";
  if (norm == Norm::RMS && b.defined()) return std::string(name) + ": RMSNorm has no bias";
  return "";
}

struct DecoderRun : torch::CustomClassHolder {
  std::vector<Layer> layers;
  int64_t d_model = -1;

  // Check one layer and append it; returns why it cannot be taken ("" when it was).
  std::string add(const std::string& norm, double eps, const optional<Tensor>& norm1_weight,
                  const optional<Tensor>& norm1_bias, const optional<Tensor>& norm2_weight,
                  const optional<Tensor>& norm2_bias, const Tensor& qkv_weight,
                  const optional<Tensor>& qkv_bias, const Tensor& out_weight,
                  const optional<Tensor>& out_bias, const std::string& mlp,
                  const Tensor& up_weight, const optional<Tensor>& up_bias,
                  const Tensor& down_weight, const optional<Tensor>& down_bias,
                  int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t window,
                  bool rope, double scale, double softcap, const optional<Tensor>& alibi,
                  const optional<Tensor>& sinks, const optional<Tensor>& post_attn_norm_weight,
                  const optional<Tensor>& post_attn_norm_bias,
                  const optional<Tensor>& post_mlp_norm_weight,
                  const optional<Tensor>& post_mlp_norm_bias) {
    const optional<Norm> n = norm_kind(norm);
    const optional<Mlp> m = mlp_kind(mlp);
    if (!n) return "norm " + norm + " is not one the fused layer runs";
    if (!m) return "mlp " + mlp + " is not one the fused layer runs";
    if (num_kv_heads <= 0 || num_heads % num_kv_heads || head_dim <= 0 || window < 0 ||
        (rope && head_dim % 2) || softcap < 0)
      return "bad head layout";
    for (const optional<Tensor>* t : {&alibi, &sinks})
      if (t->has_value() && ((**t).scalar_type() != at::kDouble || (**t).dim() != 1 ||
                             (**t).size(0) != num_heads || !(**t).is_contiguous()))
        return "ALiBi slopes and sinks must be (num_heads,) float64";
    const bool post = post_attn_norm_weight.has_value() || post_mlp_norm_weight.has_value();
    // Gemma's norm: 1 + weight, stored once (the run lasts as long as the weights do).
    auto stored = [&](const optional<Tensor>& w) {
      return w.has_value() && norm == "rmsnorm_plus_one" ? *w + 1.0 : value(w);
    };
    Layer L{*n, *m, eps, scale, softcap, stored(norm1_weight), value(norm1_bias),
            stored(norm2_weight), value(norm2_bias), stored(post_attn_norm_weight),
            value(post_attn_norm_bias), stored(post_mlp_norm_weight), value(post_mlp_norm_bias),
            alibi, sinks, qkv_weight, value(qkv_bias), out_weight, value(out_bias),
            up_weight, value(up_bias), down_weight, value(down_bias), num_heads, num_kv_heads,
            head_dim, window, rope, post};
    const int64_t d = qkv_weight.dim() == 2 ? qkv_weight.size(1) : -1;
    if (d <= 0 || (d_model >= 0 && d != d_model)) return "d_model differs between layers";
    const int64_t up_out = up_weight.dim() == 2 ? up_weight.size(0) : 0;
    const int64_t ff = gated(L.mlp) ? up_out / 2 : up_out;
    if (post && !(post_attn_norm_weight.has_value() && post_mlp_norm_weight.has_value()))
      return "post-norms come in pairs (after attention and after the MLP)";
    for (const std::string& why :
         {norm_problem("norm1", L.norm1_weight, L.norm1_bias, L.norm, d),
          norm_problem("norm2", L.norm2_weight, L.norm2_bias, L.norm, d),
          norm_problem("post_attn_norm", L.post_attn_weight, L.post_attn_bias, L.norm, d),
          norm_problem("post_mlp_norm", L.post_mlp_weight, L.post_mlp_bias, L.norm, d),
          product_problem("qkv", L.qkv_weight, L.qkv_bias, (num_heads + 2 * num_kv_heads) * head_dim, d),
          product_problem("out", L.out_weight, L.out_bias, d, num_heads * head_dim),
          product_problem("up", L.up_weight, L.up_bias, up_out, d),
          product_problem("down", L.down_weight, L.down_bias, d, ff)})
      if (!why.empty()) return why;
    if (ff <= 0 || (gated(L.mlp) && up_out % 2)) return "bad MLP width";
    d_model = d;
    layers.push_back(std::move(L));
    return "";
  }

  int64_t size() const { return static_cast<int64_t>(layers.size()); }

  // Whether this token's caches, positions and rotary tables are what step() reads.
  bool step_ok(const Tensor& x, const std::vector<Tensor>& k_caches,
               const std::vector<Tensor>& v_caches, const std::vector<int64_t>& pos,
               const c10::List<optional<Tensor>>& cos, const c10::List<optional<Tensor>>& sin) const {
    const size_t n = layers.size();
    if (x.numel() != d_model || !usable(x) || k_caches.size() != n || v_caches.size() != n ||
        pos.size() != n || cos.size() != n || sin.size() != n)
      return false;
    for (size_t l = 0; l < n; ++l) {
      const Layer& L = layers[l];
      const Tensor &k = k_caches[l], &v = v_caches[l];
      if (k.dim() != 4 || k.sizes() != v.sizes() || k.size(0) != 1 || k.size(1) != L.kv_heads ||
          k.size(3) != L.head_dim || !k.is_contiguous() || !v.is_contiguous() || !usable(k) ||
          !usable(v) || pos[l] < 0 || pos[l] >= k.size(2))
        return false;
      const optional<Tensor> c = cos.get(l), s = sin.get(l);
      if (c.has_value() != L.rope || s.has_value() != L.rope) return false;
      for (const optional<Tensor>* t : {&c, &s})
        if (t->has_value() && ((**t).dim() != 2 || (**t).size(0) <= pos[l] ||
                               (**t).size(1) != L.head_dim || !(**t).is_contiguous() ||
                               !usable(**t)))
          return false;
    }
    return true;
  }

  // x (1, 1, d) through every layer, each appending its key and value at pos[l] of its
  // cache ((1, Hkv, Lmax, D)); cos/sin the layer's rotary tables (or none). None, nothing
  // written, where the inputs are not what this reads.
  optional<Tensor> step(const Tensor& x, std::vector<Tensor> k_caches, std::vector<Tensor> v_caches,
                        const std::vector<int64_t>& pos, const c10::List<optional<Tensor>>& cos,
                        const c10::List<optional<Tensor>>& sin) const {
    if (!step_ok(x, k_caches, v_caches, pos, cos, sin)) return std::nullopt;
    Tensor h = x.reshape({1, d_model}).contiguous();
    for (size_t l = 0; l < layers.size(); ++l)
      h = run_layer(h, layers[l], k_caches[l], v_caches[l], pos[l], cos.get(l), sin.get(l));
    return h.view_as(x);
  }

 private:
  static Tensor normed(const Tensor& t, const Layer& L, const Tensor& w, const Tensor& b) {
    if (L.norm == Norm::RMS) return rms_norm(t, w.defined() ? optional<Tensor>(w) : std::nullopt, L.eps);
    return at::layer_norm(t, {t.size(1)}, w, b, L.eps);
  }

  static Tensor run_layer(const Tensor& h, const Layer& L, Tensor& k, Tensor& v, int64_t pos,
                          const optional<Tensor>& cos, const optional<Tensor>& sin) {
    const Tensor none;
    const Tensor qkv = linear_row(normed(h, L, L.norm1_weight, L.norm1_bias), L.qkv_weight,
                                  L.qkv_bias, none);
    const Tensor heads = decode_step(qkv.view({1, 1, qkv.size(1)}), cos, sin, k, v, pos,
                                     L.window, L.heads, L.kv_heads, L.scale, L.softcap,
                                     L.alibi, L.sinks);
    // The residuals ride in the products (y = x + heads W_out^T + b, no temporary), except
    // where a post-norm comes between the product and the sum.
    Tensor y = linear_row(heads.view({1, -1}), L.out_weight, L.out_bias, L.post_norms ? none : h);
    if (L.post_norms) y = h + normed(y, L, L.post_attn_weight, L.post_attn_bias);
    const Tensor up = linear_row(normed(y, L, L.norm2_weight, L.norm2_bias), L.up_weight,
                                 L.up_bias, none);
    const Tensor act = L.mlp == Mlp::SwiGLU  ? silu_mul(up)
                       : L.mlp == Mlp::GeGLU ? gelu_mul(up)
                       : L.mlp == Mlp::Relu  ? at::relu(up)
                                             : at::gelu(up, L.mlp == Mlp::GeluTanh ? "tanh" : "none");
    if (!L.post_norms) return linear_row(act, L.down_weight, L.down_bias, y);
    return y + normed(linear_row(act, L.down_weight, L.down_bias, none), L, L.post_mlp_weight,
                      L.post_mlp_bias);
  }
};

}  // namespace
}  // namespace attnlab

TORCH_LIBRARY_FRAGMENT(attnlab_native, m) {
  m.class_<attnlab::DecoderRun>("DecoderRun")
      .def(torch::init<>())
      .def("add", &attnlab::DecoderRun::add, "",
           {torch::arg("norm"), torch::arg("eps"), torch::arg("norm1_weight"),
            torch::arg("norm1_bias"), torch::arg("norm2_weight"), torch::arg("norm2_bias"),
            torch::arg("qkv_weight"), torch::arg("qkv_bias"), torch::arg("out_weight"),
            torch::arg("out_bias"), torch::arg("mlp"), torch::arg("up_weight"),
            torch::arg("up_bias"), torch::arg("down_weight"), torch::arg("down_bias"),
            torch::arg("num_heads"), torch::arg("num_kv_heads"), torch::arg("head_dim"),
            torch::arg("window"), torch::arg("rope"), torch::arg("scale"),
            torch::arg("softcap") = 0.0, torch::arg("alibi") = c10::IValue(),
            torch::arg("sinks") = c10::IValue(),
            torch::arg("post_attn_norm_weight") = c10::IValue(),
            torch::arg("post_attn_norm_bias") = c10::IValue(),
            torch::arg("post_mlp_norm_weight") = c10::IValue(),
            torch::arg("post_mlp_norm_bias") = c10::IValue()})
      .def("size", &attnlab::DecoderRun::size)
      .def("step", &attnlab::DecoderRun::step);
}
