// DecoderRun: one decoded row through a run of pre-norm decoder layers in one call,
//   y = x + out(attend(qkv(norm1(x)))),  then  y + down(act(up(norm2(y)))),
// from the kernels of decode.cpp and decode_step.cpp (decode.h). Through the modules a
// layer is about forty Python-level calls, and decoding one token at a time pays each
// of them per layer per token, cold, between products that stream the weights through
// the caches.
//
// With post-norms (Gemma 2) each branch is normed again before it is added:
//   y = x + post_attn_norm(out(attend(...))),  y + post_mlp_norm(down(act(up(norm2(y))))).
// With q/k norms (Qwen3) each head's query and key are normed (the layer's norm kind, over
// head_dim) between the qkv product and RoPE.
//
// A run is built once for as long as its layers stay what they are (models/decoding.py
// builds one per `generate` call): `add` takes one layer's tensors and settings by name
// and checks them once, returning why it cannot take the layer ("" when it can); where
// the run ends the model, `set_head` takes its final norm and output layer the same way;
// `step` then runs the row through every layer (and the head), checking only what
// changes per token (the caches, the positions, the rotary tables). After the weights
// have streamed through the caches, each Python and torch call between them runs cold
// (the final norm alone took 270 us a token through its module, 30 us warm), so the
// head is here too. The Python side is _decode.py.
//
// Precision: each product's weight is float32 or bf16 ((out, in), by rows or columns), or
// int8 (its data and scales in int8_product.h's layout); norms and biases may be float32
// or bf16 (kept as float32 copies, a few thousand numbers a layer); the caches float32 or
// bf16. The row itself stays float32 from the first layer to the last, whatever the
// weights: it is d_model numbers against megabytes of weights, so rounding it to bf16
// between layers would save nothing measurable and cost the residual stream its
// precision. x may come in float32 or bf16; the result has x's dtype.
#include <ATen/ATen.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
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

Tensor value(const optional<Tensor>& t) { return t.has_value() ? *t : Tensor(); }

// A float32 copy of a small parameter (itself where it already is one), or undefined.
Tensor float_copy(const Tensor& t) { return t.defined() ? t.to(at::kFloat).contiguous() : t; }

// One product: y = x W^T + bias (+ residual); W float32/bf16 (out, in), or int8 (weight =
// its data, scales defined).
struct Product {
  Tensor weight, scales, bias;
  int64_t out = 0;
  // An int8 weight's pointers, read once (the tensors above hold the memory): each read
  // through a tensor checks its dtype on a TensorImpl that the weights streamed since
  // evicted, about 1% of an int8 token.
  const uint8_t* data = nullptr;
  const uint16_t* scale_bits = nullptr;
  const float* bias_data = nullptr;

  Product() = default;
  Product(Tensor w, Tensor s, Tensor b, int64_t n_out)
      : weight(std::move(w)), scales(std::move(s)), bias(std::move(b)), out(n_out) {
    if (scales.defined()) {
      data = weight.data_ptr<uint8_t>();
      scale_bits = reinterpret_cast<const uint16_t*>(scales.data_ptr<int16_t>());
      bias_data = bias.defined() ? bias.data_ptr<float>() : nullptr;
    }
  }

  Tensor operator()(const Tensor& x, const Tensor& residual) const {
    if (scales.defined()) {
      // The weight was checked when the layer was added; the run's rows are float32.
      if (plain_float(x) && (!residual.defined() || plain_float(residual)))
        return int8_linear_checked(x, data, scale_bits, out, bias_data, residual);
      return int8_linear(x, weight, scales, out, bias.defined() ? optional<Tensor>(bias) : std::nullopt,
                         residual.defined() ? optional<Tensor>(residual) : std::nullopt);
    }
    return linear_row(x, weight, bias, residual);
  }

  static bool plain_float(const Tensor& t) {
    return t.scalar_type() == at::kFloat && t.is_contiguous();
  }
};

bool gated(Mlp m) { return m == Mlp::SwiGLU || m == Mlp::GeGLU; }

struct Layer {
  Norm norm;
  Mlp mlp;
  double eps, scale, softcap;
  // Norms' parameters as float32 copies (rmsnorm_plus_one's weights stored as 1 + weight);
  // undefined where none. The post-norms (Gemma 2) norm each branch again before it is added.
  Tensor norm1_weight, norm1_bias, norm2_weight, norm2_bias;
  Tensor post_attn_weight, post_attn_bias, post_mlp_weight, post_mlp_bias;
  Tensor q_norm_weight, q_norm_bias, k_norm_weight, k_norm_bias;  // (head_dim,), Qwen3
  optional<Tensor> alibi, sinks;  // (num_heads,) float64, or none
  // q|k|v joined, the output projection, the MLP's up ([gate | up] joined when gated), down.
  Product qkv, out, up, down;
  int64_t heads, kv_heads, head_dim, window;
  bool rope, post_norms, qk_norms;
};

// The product of a weight (out, in), its scales (int8) and bias, or why linear_row and
// int8_linear cannot read it.
std::string make_product(const char* name, const Tensor& w, const Tensor& scales, const Tensor& b,
                         int64_t out, int64_t in, Product& p) {
  const std::string shape = "(" + std::to_string(out) + ", " + std::to_string(in) + ")";
  if (scales.defined()) {
    const std::string why = w.defined() ? int8_problem(w, scales, out, in) : "no int8 data";
    if (!why.empty()) return std::string(name) + ": " + why;
  } else if (!w.defined() || !floating(w) || w.dim() != 2 || w.size(0) != out ||
             w.size(1) != in) {
    return std::string(name) + " weight is not a " + shape + " float32 or bf16 CPU tensor";
  }
  if (b.defined() && (!floating(b) || b.dim() != 1 || b.size(0) != out))
    return std::string(name) + " bias is not a (" + std::to_string(out) +
           ",) float32 or bf16 CPU tensor";
  p = Product{w, scales, float_copy(b), out};
  return "";
}

std::string norm_problem(const char* name, const Tensor& w, const Tensor& b, Norm norm,
                         int64_t d) {
  for (const Tensor* t : {&w, &b})
    if (t->defined() && (!floating(*t) || t->dim() != 1 || t->size(0) != d))
      return std::string(name) + " parameters are not (" + std::to_string(d) +
             ",) float32 or bf16 CPU tensors";
  if (norm == Norm::RMS && b.defined()) return std::string(name) + ": RMSNorm has no bias";
  return "";
}

// A norm's weight as the run keeps it: a float32 copy, and Gemma's 1 + weight stored once
// (the run lasts as long as the weights do; adding 1 to a bf16 weight would round it).
Tensor norm_weight(const Tensor& w, const std::string& norm) {
  const Tensor t = float_copy(w);
  return t.defined() && norm == "rmsnorm_plus_one" ? t + 1.0 : t;
}

// The model's final norm and output layer, after the run's last layer.
struct Head {
  Norm norm;
  double eps;
  Tensor weight, bias;
  Product product;
};

// The model's token embedding where it is a plain row lookup: a float32 or bf16 table
// (vocab, d), or int8 data and scales (a table tied to an int8 output layer); each row
// rounded to bf16 where the model's activations are (as GPT.embed does).
struct Embedding {
  Tensor table, scales;
  int64_t vocab;
  bool bf16_rows;

  Tensor operator()(int64_t id, int64_t d) const {
    const Tensor row = scales.defined()
        ? int8_rows(table, scales, at::full({1}, id, at::kLong), vocab, d)
        : table.select(0, id).reshape({1, d});  // a table tied to columns: a strided row
    return bf16_rows ? row.to(at::kBFloat16) : row;
  }
};

// The token sample_next picks at temperature 0: the first index of the largest logit
// (NumPy's argmax); where a logit is NaN, the first largest after torch.nan_to_num(nan=
// -inf), which also brings +-inf to the largest finite floats, so a NaN ranks below -inf.
int64_t first_argmax(const Tensor& logits) {
  const float* l = logits.data_ptr<float>();
  const int64_t n = logits.numel();
  int64_t best = 0;
  bool nan = std::isnan(l[0]);
  for (int64_t i = 1; i < n; ++i) {
    nan |= std::isnan(l[i]);
    if (l[i] > l[best]) best = i;
  }
  if (!nan) return best;
  const auto key = [](float v) {
    return std::isnan(v) ? -INFINITY : std::clamp(v, -FLT_MAX, FLT_MAX);
  };
  best = 0;
  for (int64_t i = 1; i < n; ++i)
    if (key(l[i]) > key(l[best])) best = i;
  return best;
}

struct DecoderRun : torch::CustomClassHolder {
  std::vector<Layer> layers;
  optional<Head> head;
  optional<Embedding> embedding;
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
                  bool rope, double scale, const optional<Tensor>& qkv_scales,
                  const optional<Tensor>& out_scales, const optional<Tensor>& up_scales,
                  const optional<Tensor>& down_scales, int64_t model_dim, int64_t up_out,
                  double softcap, const optional<Tensor>& alibi, const optional<Tensor>& sinks,
                  const optional<Tensor>& post_attn_norm_weight,
                  const optional<Tensor>& post_attn_norm_bias,
                  const optional<Tensor>& post_mlp_norm_weight,
                  const optional<Tensor>& post_mlp_norm_bias,
                  const optional<Tensor>& q_norm_weight, const optional<Tensor>& q_norm_bias,
                  const optional<Tensor>& k_norm_weight, const optional<Tensor>& k_norm_bias) {
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
    if (post && !(post_attn_norm_weight.has_value() && post_mlp_norm_weight.has_value()))
      return "post-norms come in pairs (after attention and after the MLP)";
    const bool qk = q_norm_weight.has_value() || k_norm_weight.has_value() ||
                    q_norm_bias.has_value() || k_norm_bias.has_value();
    if (qk && !(q_norm_weight.has_value() && k_norm_weight.has_value()))
      return "q/k norms come in pairs, each with its weight";
    Layer L{*n, *m, eps, scale, softcap, value(norm1_weight), value(norm1_bias),
            value(norm2_weight), value(norm2_bias), value(post_attn_norm_weight),
            value(post_attn_norm_bias), value(post_mlp_norm_weight), value(post_mlp_norm_bias),
            value(q_norm_weight), value(q_norm_bias), value(k_norm_weight), value(k_norm_bias),
            alibi, sinks, {}, {}, {}, {}, num_heads, num_kv_heads, head_dim, window, rope, post,
            qk};
    // The widths are given (an int8 weight's padded shape does not say them); every
    // product's shape is checked against them.
    const int64_t d = model_dim;
    if (d <= 0 || (d_model >= 0 && d != d_model)) return "d_model differs between layers";
    const int64_t ff = gated(L.mlp) ? up_out / 2 : up_out;
    if (ff <= 0 || (gated(L.mlp) && up_out % 2)) return "bad MLP width";
    for (const std::string& why :
         {norm_problem("norm1", L.norm1_weight, L.norm1_bias, L.norm, d),
          norm_problem("norm2", L.norm2_weight, L.norm2_bias, L.norm, d),
          norm_problem("post_attn_norm", L.post_attn_weight, L.post_attn_bias, L.norm, d),
          norm_problem("post_mlp_norm", L.post_mlp_weight, L.post_mlp_bias, L.norm, d),
          norm_problem("q_norm", L.q_norm_weight, L.q_norm_bias, L.norm, head_dim),
          norm_problem("k_norm", L.k_norm_weight, L.k_norm_bias, L.norm, head_dim),
          make_product("qkv", qkv_weight, value(qkv_scales), value(qkv_bias),
                       (num_heads + 2 * num_kv_heads) * head_dim, d, L.qkv),
          make_product("out", out_weight, value(out_scales), value(out_bias), d,
                       num_heads * head_dim, L.out),
          make_product("up", up_weight, value(up_scales), value(up_bias), up_out, d, L.up),
          make_product("down", down_weight, value(down_scales), value(down_bias), d, ff, L.down)})
      if (!why.empty()) return why;
    for (Tensor* t : {&L.norm1_weight, &L.norm2_weight, &L.post_attn_weight, &L.post_mlp_weight,
                      &L.q_norm_weight, &L.k_norm_weight})
      *t = norm_weight(*t, norm);
    for (Tensor* t : {&L.norm1_bias, &L.norm2_bias, &L.post_attn_bias, &L.post_mlp_bias,
                      &L.q_norm_bias, &L.k_norm_bias})
      *t = float_copy(*t);
    d_model = d;
    layers.push_back(std::move(L));
    return "";
  }

  int64_t size() const { return static_cast<int64_t>(layers.size()); }

  // Check the final norm and the output layer (vocab outputs) and keep them: step() then
  // returns the logits. Returns why it cannot take them ("" when it did).
  std::string set_head(const std::string& norm, double eps, const optional<Tensor>& norm_weight_,
                       const optional<Tensor>& norm_bias, const Tensor& weight,
                       const optional<Tensor>& bias, const optional<Tensor>& scales,
                       int64_t vocab) {
    const optional<Norm> n = norm_kind(norm);
    if (!n) return "norm " + norm + " is not one the fused layer runs";
    if (layers.empty()) return "a head follows the layers";
    Head H{*n, eps, value(norm_weight_), value(norm_bias), {}};
    for (const std::string& why :
         {norm_problem("norm", H.weight, H.bias, H.norm, d_model),
          make_product("lm_head", weight, value(scales), value(bias), vocab, d_model, H.product)})
      if (!why.empty()) return why;
    H.weight = norm_weight(H.weight, norm);
    H.bias = float_copy(H.bias);
    head = std::move(H);
    return "";
  }

  // Keep the model's token table (see Embedding; `scales` for int8 data) for greedy();
  // returns why it cannot take it ("" when it did).
  std::string set_embedding(const Tensor& table, const optional<Tensor>& scales, int64_t vocab,
                            bool bf16_rows) {
    if (!head) return "an embedding comes with a head";
    if (vocab != head->product.out) return "the embedding's vocabulary is not the head's";
    if (scales.has_value()) {
      const std::string why = int8_problem(table, *scales, vocab, d_model);
      if (!why.empty()) return "embedding: " + why;
    } else if (!floating(table) || table.dim() != 2 || table.size(0) != vocab ||
               table.size(1) != d_model) {
      return "embedding: a (vocab, d_model) float32 or bf16 table";
    }
    embedding = Embedding{table, value(scales), vocab, bf16_rows};
    return "";
  }

  // Greedy decoding in one call: `count` tokens at most, each the argmax of the logits of
  // a step fed the token before it (`first` for the first), at positions pos[l], pos[l] +
  // 1, ... of each cache; it ends after a token in `stops`. Returns the tokens, or None,
  // nothing written, where the inputs are not what step() reads at the first and the last
  // position (every position between is then valid too, so the tokens skip step_ok).
  // Python between tokens ran cold after every token's weights (about 0.5 ms a token, 8%
  // of an int8 one: models/decoding.py).
  optional<Tensor> greedy(int64_t first, int64_t count, const std::vector<int64_t>& stops,
                          std::vector<Tensor> k_caches, std::vector<Tensor> v_caches,
                          std::vector<int64_t> pos, const c10::List<optional<Tensor>>& cos,
                          const c10::List<optional<Tensor>>& sin) const {
    if (!head || !embedding || count < 1 || first < 0 || first >= embedding->vocab)
      return std::nullopt;
    const Tensor x0 = (*embedding)(first, d_model);
    std::vector<int64_t> last = pos;
    for (int64_t& p : last) p += count - 1;
    if (!step_ok(x0, k_caches, v_caches, pos, cos, sin) ||
        !step_ok(x0, k_caches, v_caches, last, cos, sin))
      return std::nullopt;
    Tensor tokens = at::empty({count}, at::kLong);
    int64_t* out = tokens.data_ptr<int64_t>();
    int64_t n = 0, token = first;
    for (Tensor x = x0; n < count;) {
      token = out[n++] = first_argmax(forward(x, k_caches, v_caches, pos, cos, sin));
      if (std::find(stops.begin(), stops.end(), token) != stops.end()) break;
      for (int64_t& p : pos) ++p;
      if (n < count) x = (*embedding)(token, d_model);
    }
    return tokens.narrow(0, 0, n);
  }

  // Whether this token's caches, positions and rotary tables are what step() reads.
  bool step_ok(const Tensor& x, const std::vector<Tensor>& k_caches,
               const std::vector<Tensor>& v_caches, const std::vector<int64_t>& pos,
               const c10::List<optional<Tensor>>& cos, const c10::List<optional<Tensor>>& sin) const {
    const size_t n = layers.size();
    if (x.numel() != d_model || !floating(x) || k_caches.size() != n || v_caches.size() != n ||
        pos.size() != n || cos.size() != n || sin.size() != n)
      return false;
    for (size_t l = 0; l < n; ++l) {
      const Layer& L = layers[l];
      const Tensor &k = k_caches[l], &v = v_caches[l];
      if (k.dim() != 4 || k.sizes() != v.sizes() || k.size(0) != 1 || k.size(1) != L.kv_heads ||
          k.size(3) != L.head_dim || !k.is_contiguous() || !v.is_contiguous() || !floating(k) ||
          k.scalar_type() != v.scalar_type() || !v.device().is_cpu() || pos[l] < 0 ||
          pos[l] >= k.size(2))
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
  // cache ((1, Hkv, Lmax, D)); cos/sin the layer's rotary tables (or none). Returns the
  // row (1, 1, d) in x's dtype, or with a head the logits (1, 1, vocab) float32; None,
  // nothing written, where the inputs are not what this reads.
  optional<Tensor> step(const Tensor& x, std::vector<Tensor> k_caches, std::vector<Tensor> v_caches,
                        const std::vector<int64_t>& pos, const c10::List<optional<Tensor>>& cos,
                        const c10::List<optional<Tensor>>& sin) const {
    if (!step_ok(x, k_caches, v_caches, pos, cos, sin)) return std::nullopt;
    return forward(x, k_caches, v_caches, pos, cos, sin);
  }

 private:
  // step() for inputs step_ok() accepts.
  Tensor forward(const Tensor& x, std::vector<Tensor>& k_caches, std::vector<Tensor>& v_caches,
                 const std::vector<int64_t>& pos, const c10::List<optional<Tensor>>& cos,
                 const c10::List<optional<Tensor>>& sin) const {
    Tensor h = x.reshape({1, d_model}).to(at::kFloat).contiguous();
    for (size_t l = 0; l < layers.size(); ++l)
      h = run_layer(h, layers[l], k_caches[l], v_caches[l], pos[l], cos.get(l), sin.get(l));
    if (head)  // the logits, float32 (as the model's own output layer gives them)
      return head->product(normed(h, head->norm, head->eps, head->weight, head->bias), Tensor())
          .view({1, 1, -1});
    return h.to(x.scalar_type()).view_as(x);
  }

  static Tensor normed(const Tensor& t, Norm norm, double eps, const Tensor& w, const Tensor& b) {
    if (norm == Norm::RMS) return rms_norm(t, w.defined() ? optional<Tensor>(w) : std::nullopt, eps);
    return at::layer_norm(t, {t.size(1)}, w, b, eps);
  }

  static Tensor normed(const Tensor& t, const Layer& L, const Tensor& w, const Tensor& b) {
    return normed(t, L.norm, L.eps, w, b);
  }

  static Tensor run_layer(const Tensor& h, const Layer& L, Tensor& k, Tensor& v, int64_t pos,
                          const optional<Tensor>& cos, const optional<Tensor>& sin) {
    const Tensor none;
    Tensor qkv = L.qkv(normed(h, L, L.norm1_weight, L.norm1_bias), none);
    if (L.qk_norms) {  // each head's query and key normed over head_dim, the values kept
      const Tensor rows = qkv.view({L.heads + 2 * L.kv_heads, L.head_dim});
      qkv = at::cat({normed(rows.narrow(0, 0, L.heads), L, L.q_norm_weight, L.q_norm_bias),
                     normed(rows.narrow(0, L.heads, L.kv_heads), L, L.k_norm_weight,
                            L.k_norm_bias),
                     rows.narrow(0, L.heads + L.kv_heads, L.kv_heads)})
                .view({1, -1});
    }
    const Tensor heads = decode_step(qkv.view({1, 1, qkv.size(1)}), cos, sin, k, v, pos,
                                     L.window, L.heads, L.kv_heads, L.scale, L.softcap,
                                     L.alibi, L.sinks);
    // The residuals ride in the products (y = x + heads W_out^T + b, no temporary), except
    // where a post-norm comes between the product and the sum.
    Tensor y = L.out(heads.view({1, -1}), L.post_norms ? none : h);
    if (L.post_norms) y = h + normed(y, L, L.post_attn_weight, L.post_attn_bias);
    const Tensor up = L.up(normed(y, L, L.norm2_weight, L.norm2_bias), none);
    const Tensor act = L.mlp == Mlp::SwiGLU  ? silu_mul(up)
                       : L.mlp == Mlp::GeGLU ? gelu_mul(up)
                       : L.mlp == Mlp::Relu  ? at::relu(up)
                                             : at::gelu(up, L.mlp == Mlp::GeluTanh ? "tanh" : "none");
    if (!L.post_norms) return L.down(act, y);
    return y + normed(L.down(act, none), L, L.post_mlp_weight, L.post_mlp_bias);
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
            torch::arg("qkv_scales"), torch::arg("out_scales"), torch::arg("up_scales"),
            torch::arg("down_scales"), torch::arg("d_model"), torch::arg("up_out"),
            torch::arg("softcap") = 0.0, torch::arg("alibi") = c10::IValue(),
            torch::arg("sinks") = c10::IValue(),
            torch::arg("post_attn_norm_weight") = c10::IValue(),
            torch::arg("post_attn_norm_bias") = c10::IValue(),
            torch::arg("post_mlp_norm_weight") = c10::IValue(),
            torch::arg("post_mlp_norm_bias") = c10::IValue(),
            torch::arg("q_norm_weight") = c10::IValue(),
            torch::arg("q_norm_bias") = c10::IValue(),
            torch::arg("k_norm_weight") = c10::IValue(),
            torch::arg("k_norm_bias") = c10::IValue()})
      .def("set_head", &attnlab::DecoderRun::set_head, "",
           {torch::arg("norm"), torch::arg("eps"), torch::arg("norm_weight"),
            torch::arg("norm_bias"), torch::arg("weight"), torch::arg("bias"),
            torch::arg("scales"), torch::arg("vocab")})
      .def("set_embedding", &attnlab::DecoderRun::set_embedding)
      .def("size", &attnlab::DecoderRun::size)
      .def("step", &attnlab::DecoderRun::step)
      .def("greedy", &attnlab::DecoderRun::greedy);
}
