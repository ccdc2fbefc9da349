// SigLIP vision tower forward.
#include "kestrel/models/vision.h"

#include <cmath>

#include "kestrel/ops/activation.h"
#include "kestrel/ops/attention.h"
#include "kestrel/ops/elementwise.h"
#include "kestrel/ops/matmul.h"
#include "kestrel/ops/norm.h"
#include "kestrel/ops/patch.h"
#include "kestrel/ops/shape.h"

namespace kestrel::models {

VisionTower::VisionTower(const VisionConfig& config, DType dtype, Device device, uint64_t seed,
                         const std::string& prefix)
    : config_(config), dtype_(dtype), device_(device) {
  config_.validate();
  const int64_t E = config_.hidden_size, I = config_.intermediate_size, C = config_.num_channels;
  const int64_t P = config_.patch_size, N = config_.num_patches();
  Generator gen(seed);
  const std::string vp = prefix + "vision_model.";
  // Initialisation as transformers' SiglipPreTrainedModel: patch embedding lecun-normal
  // (std 1/sqrt(fan_in)), positions std 1/sqrt(E), projections and MLP xavier
  // (std sqrt(2/(fan_in+fan_out))), norms 1, biases 0. `init` < 0 means normal(0, -init).
  auto add = [&](const std::string& name, Tensor& t, const Shape& shape, double init) {
    t = make_parameter(vp + name, shape, dtype_, device_);
    if (init < 0)
      init_normal(t, -init, gen);
    else
      init_constant(t, init);
    params_.add(t.name(), &t);
  };
  const double xavier_ee = -std::sqrt(2.0 / static_cast<double>(E + E));
  const double xavier_ie = -std::sqrt(2.0 / static_cast<double>(E + I));
  add("embeddings.patch_embedding.weight", patch_w_, {E, C, P, P}, -1.0 / std::sqrt(static_cast<double>(C * P * P)));
  add("embeddings.patch_embedding.bias", patch_b_, {E}, 0.0);
  add("embeddings.position_embedding.weight", pos_emb_, {N, E}, -1.0 / std::sqrt(static_cast<double>(E)));
  blocks_.resize(config_.num_hidden_layers);
  for (int64_t l = 0; l < config_.num_hidden_layers; ++l) {
    VisionBlock& B = blocks_[l];
    std::string p = "encoder.layers." + std::to_string(l) + ".";
    add(p + "layer_norm1.weight", B.ln1_w, {E}, 1.0);
    add(p + "layer_norm1.bias", B.ln1_b, {E}, 0.0);
    add(p + "self_attn.q_proj.weight", B.q_w, {E, E}, xavier_ee);
    add(p + "self_attn.q_proj.bias", B.q_b, {E}, 0.0);
    add(p + "self_attn.k_proj.weight", B.k_w, {E, E}, xavier_ee);
    add(p + "self_attn.k_proj.bias", B.k_b, {E}, 0.0);
    add(p + "self_attn.v_proj.weight", B.v_w, {E, E}, xavier_ee);
    add(p + "self_attn.v_proj.bias", B.v_b, {E}, 0.0);
    add(p + "self_attn.out_proj.weight", B.o_w, {E, E}, xavier_ee);
    add(p + "self_attn.out_proj.bias", B.o_b, {E}, 0.0);
    add(p + "layer_norm2.weight", B.ln2_w, {E}, 1.0);
    add(p + "layer_norm2.bias", B.ln2_b, {E}, 0.0);
    add(p + "mlp.fc1.weight", B.fc1_w, {I, E}, xavier_ie);
    add(p + "mlp.fc1.bias", B.fc1_b, {I}, 0.0);
    add(p + "mlp.fc2.weight", B.fc2_w, {E, I}, xavier_ie);
    add(p + "mlp.fc2.bias", B.fc2_b, {E}, 0.0);
  }
  add("post_layernorm.weight", post_ln_w_, {E}, 1.0);
  add("post_layernorm.bias", post_ln_b_, {E}, 0.0);
}

Tensor VisionTower::block_forward(int index, const Tensor& x, const Tensor& cu_seqlens, int64_t n) const {
  const VisionBlock& B = blocks_[index];
  const int64_t T = x.shape()[0], E = config_.hidden_size, H = config_.num_attention_heads, D = config_.head_dim();
  const double eps = config_.layer_norm_eps;
  Tensor h;
  {
    MemoryLabelScope label("attn");  // allocation attribution for the memory profiler
    Tensor y = layer_norm(x, B.ln1_w, B.ln1_b, eps);
    Tensor q = reshape(linear(y, B.q_w, B.q_b), {T, H, D});
    Tensor k = reshape(linear(y, B.k_w, B.k_b), {T, H, D});
    Tensor v = reshape(linear(y, B.v_w, B.v_b), {T, H, D});
    AttentionOptions opts;
    opts.causal = false;
    opts.deterministic = deterministic_;
    Tensor a = attention(q, k, v, cu_seqlens, n, opts);
    h = add(x, linear(reshape(a, {T, E}), B.o_w, B.o_b));
  }
  MemoryLabelScope label("mlp");
  Tensor z = layer_norm(h, B.ln2_w, B.ln2_b, eps);
  z = linear(gelu(linear(z, B.fc1_w, B.fc1_b), /*tanh_approx=*/config_.hidden_act == "gelu_pytorch_tanh"), B.fc2_w,
             B.fc2_b);
  return add(h, z);
}

Tensor VisionTower::forward(const Tensor& pixel_values, autograd::RecomputePolicy policy) const {
  Tensor x = blocks_forward(pixel_values, static_cast<int64_t>(blocks_.size()), policy);
  MemoryLabelScope label("vision.post_layernorm");
  return layer_norm(x, post_ln_w_, post_ln_b_, config_.layer_norm_eps);
}

Tensor VisionTower::hidden_state(const Tensor& pixel_values, int64_t k, autograd::RecomputePolicy policy) const {
  KESTREL_CHECK(k >= 0 && k <= static_cast<int64_t>(blocks_.size()), "vision", "hidden state ", k,
                " does not exist: the tower has ", blocks_.size(), " blocks (hidden states 0..", blocks_.size(), ")");
  return blocks_forward(pixel_values, k, policy);
}

Tensor VisionTower::blocks_forward(const Tensor& pixel_values, int64_t blocks, autograd::RecomputePolicy policy) const {
  KESTREL_CHECK(pixel_values.dim() == 4 && pixel_values.shape()[1] == config_.num_channels, "vision",
                "pixel_values must be [B, ", config_.num_channels, ", H, W], got ", pixel_values.str());
  KESTREL_CHECK(pixel_values.shape()[2] == config_.image_size && pixel_values.shape()[3] == config_.image_size,
                "vision", "images must be ", config_.image_size, "x", config_.image_size, ", got ",
                pixel_values.str());
  const int64_t Bn = pixel_values.shape()[0], N = config_.num_patches(), E = config_.hidden_size;
  Tensor x;
  {
    MemoryLabelScope label("vision.embed");
    x = patch_embed(cast(pixel_values, dtype_), patch_w_, patch_b_, config_.patch_size);  // [B, N, E]
    x = add(x, pos_emb_);  // broadcast over images
    x = reshape(x, {Bn * N, E});
  }
  std::vector<int64_t> cu(Bn + 1);
  for (int64_t b = 0; b <= Bn; ++b) cu[b] = b * N;
  Tensor cu_seqlens = Tensor::from_vector(cu, {Bn + 1}, DType::I32, device_);
  for (int l = 0; l < static_cast<int>(blocks); ++l) {
    autograd::RecomputeOptions ro{policy, "vision.block." + std::to_string(l)};
    x = autograd::recompute(
        [this, cu_seqlens, N, l](const std::vector<Tensor>& in) {
          return std::vector<Tensor>{block_forward(l, in[0], cu_seqlens, N)};
        },
        {x}, ro)[0];
  }
  return x;
}

}  // namespace kestrel::models
