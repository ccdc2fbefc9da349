// Llama/Mistral/Qwen2/Qwen3 decoder forward; backward comes from the tape.
#include "kestrel/models/decoder.h"

#include <algorithm>
#include <cmath>
#include <tuple>

#include "kestrel/ops/activation.h"
#include "kestrel/ops/attention.h"
#include "kestrel/ops/elementwise.h"
#include "kestrel/ops/embedding.h"
#include "kestrel/ops/fp8.h"
#include "kestrel/ops/fp8_producers.h"
#include "kestrel/ops/matmul.h"
#include "kestrel/ops/mlp.h"
#include "kestrel/ops/norm.h"
#include "kestrel/ops/rope.h"
#include "kestrel/ops/shape.h"

namespace kestrel::models {

const char* layer_recompute_name(LayerRecompute r) { return r == LayerRecompute::Selective ? "selective" : "full"; }

Decoder::Decoder(const TextConfig& config, DType dtype, Device device, uint64_t seed, const std::string& prefix)
    : config_(config), dtype_(dtype), device_(device), prefix_(prefix) {
  config_.validate();
  rope_ = config_.rope_frequencies();
  const int64_t C = config_.hidden_size, V = config_.vocab_size, I = config_.intermediate_size;
  const int64_t D = config_.head_dim, Hq = config_.num_attention_heads, Hkv = config_.num_key_value_heads;
  Generator gen(seed);
  const double std = 0.02;
  auto P = [&](const std::string& name, const Shape& shape, double init) {
    Tensor t = make_parameter(prefix_ + name, shape, dtype_, device_);
    if (init < 0)
      init_normal(t, std, gen);
    else
      init_constant(t, init);
    return t;
  };
  embed_tokens_ = P("model.embed_tokens.weight", {V, C}, -1);
  params_.add(embed_tokens_.name(), &embed_tokens_);
  layers_.resize(config_.num_hidden_layers);
  for (int64_t l = 0; l < config_.num_hidden_layers; ++l) {
    DecoderLayer& L = layers_[l];
    std::string p = "model.layers." + std::to_string(l) + ".";
    L.input_layernorm = P(p + "input_layernorm.weight", {C}, 1.0);
    L.q_proj = P(p + "self_attn.q_proj.weight", {Hq * D, C}, -1);
    L.k_proj = P(p + "self_attn.k_proj.weight", {Hkv * D, C}, -1);
    L.v_proj = P(p + "self_attn.v_proj.weight", {Hkv * D, C}, -1);
    if (config_.qkv_bias()) {
      L.q_bias = P(p + "self_attn.q_proj.bias", {Hq * D}, 0.0);
      L.k_bias = P(p + "self_attn.k_proj.bias", {Hkv * D}, 0.0);
      L.v_bias = P(p + "self_attn.v_proj.bias", {Hkv * D}, 0.0);
    }
    L.o_proj = P(p + "self_attn.o_proj.weight", {C, Hq * D}, -1);
    if (config_.o_proj_bias()) L.o_bias = P(p + "self_attn.o_proj.bias", {C}, 0.0);
    if (config_.qk_norm()) {
      L.q_norm = P(p + "self_attn.q_norm.weight", {D}, 1.0);
      L.k_norm = P(p + "self_attn.k_norm.weight", {D}, 1.0);
    }
    L.post_attention_layernorm = P(p + "post_attention_layernorm.weight", {C}, 1.0);
    L.gate_proj = P(p + "mlp.gate_proj.weight", {I, C}, -1);
    L.up_proj = P(p + "mlp.up_proj.weight", {I, C}, -1);
    L.down_proj = P(p + "mlp.down_proj.weight", {C, I}, -1);
  }
  norm_ = P("model.norm.weight", {C}, 1.0);
  if (!config_.tie_word_embeddings) lm_head_ = P("lm_head.weight", {V, C}, -1);
  // Registration order = HF's module order.
  for (DecoderLayer& L : layers_) {
    for (Tensor* t : {&L.input_layernorm, &L.q_proj, &L.q_bias, &L.k_proj, &L.k_bias, &L.v_proj, &L.v_bias,
                      &L.o_proj, &L.o_bias, &L.q_norm, &L.k_norm, &L.post_attention_layernorm, &L.gate_proj, &L.up_proj, &L.down_proj})
      if (t->defined()) params_.add(t->name(), t);
  }
  params_.add(norm_.name(), &norm_);
  if (lm_head_.defined()) params_.add(lm_head_.name(), &lm_head_);
}

void Decoder::enable_fp8(const Fp8Recipe& recipe) {
  // A second call would replace the state a recorded tape's closures still point into.
  KESTREL_CHECK(!fp8_, "decoder", "enable_fp8 was already called on this decoder (its FP8 state may be held by a "
                "recorded tape); enable it once");
  KESTREL_CHECK(dtype_ == DType::BF16 || (dtype_ == DType::F32 && !device_.is_cuda()), "decoder",
                "fp8 needs a bf16 decoder (or f32 on the CPU, emulated), got ", dtype_name(dtype_), " on ",
                device_.str());
  // cuBLASLt's FP8 GEMMs take leading dimensions that are multiples of 16: every projection's in and
  // out features.
  const std::pair<const char*, int64_t> dims[] = {
      {"hidden_size", config_.hidden_size},
      {"num_attention_heads * head_dim", config_.num_attention_heads * config_.head_dim},
      {"num_key_value_heads * head_dim", config_.num_key_value_heads * config_.head_dim},
      {"intermediate_size", config_.intermediate_size}};
  for (const auto& [field, value] : dims)
    KESTREL_CHECK(value % 16 == 0, "decoder", "fp8 needs ", field, " to be a multiple of 16 (cuBLASLt's FP8 "
                  "leading dimensions), got ", value);
  KESTREL_CHECK(mlp_tile_tokens_ == 0, "decoder", "fp8 with the tiled MLP (mlp_tile_tokens ", mlp_tile_tokens_,
                ") is not supported: the tiled MLP's GEMMs are bf16 only; set mlp_tile_tokens to 0");
  fp8_ = std::make_shared<Fp8State>(config_.num_hidden_layers * kFp8LinearsPerLayer, recipe, device_);
}

Tensor Decoder::embed(const Tensor& ids) const {
  MemoryLabelScope label("decoder.embed");
  if (fence_) fence_({&embed_tokens_});
  return embedding(embed_tokens_, ids, deterministic_);
}

Tensor Decoder::layer_forward(int index, const Tensor& h, const PackedBatch& batch, KvCache* cache) const {
  const DecoderLayer& L = layers_[index];
  const int64_t T = h.shape()[0];
  const int64_t D = config_.head_dim, Hq = config_.num_attention_heads, Hkv = config_.num_key_value_heads;
  // A projection: linear, or linear_fp8 with this layer's j-th delayed-scaling rows (j: q k v o gate up down).
  auto proj = [&](const Tensor& in, const Tensor& w, const Tensor& b, int64_t j) {
    return fp8_ ? linear_fp8(in, w, b, *fp8_, index * kFp8LinearsPerLayer + j) : linear(in, w, b);
  };
  // FP8 input casts written by the ops producing the q/k/v, gate/up and down inputs (fp8_producers.h).
  const bool fused = fp8_ && fp8_fused_casts_;
  const int64_t base = index * kFp8LinearsPerLayer;
  Tensor attn_out;
  {
    MemoryLabelScope label("attn");  // allocation attribution for the memory profiler
    Tensor x, q, k, v;
    Fp8InputCast x8;
    if (fused) {
      Fp8Produced p = rms_norm_fp8(h, L.input_layernorm, config_.rms_norm_eps, *fp8_, base + 0,
                                   fp8_input_needs_transposed({L.q_proj, L.k_proj, L.v_proj}));
      x = p.y;
      x8 = p.x8;
    } else {
      x = rms_norm(h, L.input_layernorm, config_.rms_norm_eps);
    }
    if (fp8_) {  // x cast to FP8 once for the three projections
      std::vector<Tensor> qkv = linear_fp8(x, {L.q_proj, L.k_proj, L.v_proj}, {L.q_bias, L.k_bias, L.v_bias}, *fp8_,
                                           {base + 0, base + 1, base + 2}, &x8);
      q = qkv[0], k = qkv[1], v = qkv[2];
    } else {
      q = linear(x, L.q_proj, L.q_bias), k = linear(x, L.k_proj, L.k_bias), v = linear(x, L.v_proj, L.v_bias);
    }
    q = reshape(q, {T, Hq, D});
    k = reshape(k, {T, Hkv, D});
    v = reshape(v, {T, Hkv, D});
    if (config_.qk_norm()) {
      q = rms_norm(q, L.q_norm, config_.rms_norm_eps);
      k = rms_norm(k, L.k_norm, config_.rms_norm_eps);
    }
    q = rope(q, batch.positions, rope_);
    k = rope(k, batch.positions, rope_);
    AttentionOptions opts;
    opts.causal = true;
    opts.window = config_.attention_window(index);  // 0 = full causal; sliding layers (mistral, qwen2/3)
    opts.deterministic = deterministic_;
    Tensor a;  // [T, Hq, D]
    if (!cache) {
      opts.backend = attention_backend_;
      a = attention(q, k, v, batch.cu_seqlens, batch.max_seqlen, opts);
    } else {
      // Append this step's keys/values to each document's cache; attend over cached + new (causal,
      // bottom-right aligned: a new token sees every cached token and the new ones before it; a
      // sliding window counts back from the token's own position, so it applies unchanged).
      std::vector<Tensor> ks, vs;
      std::vector<int64_t> cu_k{0};
      int64_t off = 0, max_k = 0;
      for (size_t d = 0; d < cache->step_lengths.size(); ++d) {
        const int64_t n = cache->step_lengths[d];
        Tensor kd = narrow(k, 0, off, n), vd = narrow(v, 0, off, n);
        Tensor& ck = cache->k[index][d];
        Tensor& cv = cache->v[index][d];
        ck = ck.defined() ? concat({ck, kd}, 0) : contiguous(kd);
        cv = cv.defined() ? concat({cv, vd}, 0) : contiguous(vd);
        ks.push_back(ck);
        vs.push_back(cv);
        cu_k.push_back(cu_k.back() + ck.shape()[0]);
        max_k = std::max(max_k, ck.shape()[0]);
        off += n;
      }
      Tensor cu_k_t = Tensor::from_vector(cu_k, {static_cast<int64_t>(cu_k.size())}, DType::I32, device_);
      a = attention(q, concat(ks, 0), concat(vs, 0), batch.cu_seqlens, cu_k_t, batch.max_seqlen, max_k, opts).out;
    }
    attn_out = proj(reshape(a, {T, Hq * D}), L.o_proj, L.o_bias, 3);
  }
  MemoryLabelScope label("mlp");
  Tensor y, h2;
  Fp8InputCast y8;
  if (fused) {  // enable_fp8 refuses the tiled MLP, so the MLP below is the FP8 one
    Fp8ProducedResidual p = add_rms_norm_fp8(attn_out, h, L.post_attention_layernorm, config_.rms_norm_eps, *fp8_,
                                             base + 4, fp8_input_needs_transposed({L.gate_proj, L.up_proj}));
    y = p.y, h2 = p.h, y8 = p.x8;
  } else {
    std::tie(y, h2) = add_rms_norm(attn_out, h, L.post_attention_layernorm, config_.rms_norm_eps);
  }
  Tensor m;
  if (mlp_tile_tokens_ > 0) {
    m = swiglu_mlp_tiled(y, L.gate_proj, L.up_proj, L.down_proj, mlp_tile_tokens_);
  } else if (fused) {
    // gate/up and SwiGLU as one entry (y cast once; SwiGLU writes down's input cast; its backward
    // writes the gate/up gradients' casts without storing them in bf16).
    Fp8Produced s = swiglu_gate_up_fp8(y, L.gate_proj, L.up_proj, *fp8_, base + 4, base + 5, base + 6,
                                       fp8_input_needs_transposed({L.down_proj}), &y8);
    m = linear_fp8(s.y, L.down_proj, Tensor(), *fp8_, base + 6, &s.x8);
  } else if (fp8_) {  // y cast to FP8 once for gate and up
    std::vector<Tensor> gu = linear_fp8(y, {L.gate_proj, L.up_proj}, {}, *fp8_, {base + 4, base + 5}, &y8);
    m = proj(swiglu(gu[0], gu[1]), L.down_proj, Tensor(), 6);
  } else {
    m = linear(swiglu(linear(y, L.gate_proj), linear(y, L.up_proj)), L.down_proj);
  }
  return add(h2, m);
}

Tensor Decoder::forward(const Tensor& embeds, const PackedBatch& batch, autograd::RecomputePolicy policy) const {
  KESTREL_CHECK(embeds.dim() == 2 && embeds.shape()[1] == config_.hidden_size, "decoder", "embeddings must be [T, ",
                config_.hidden_size, "], got ", embeds.str());
  KESTREL_CHECK(batch.tokens() == embeds.shape()[0], "decoder", "batch layout has ", batch.tokens(),
                " tokens, embeddings ", embeds.shape()[0]);
  config_.check_sequence_length(batch.max_seqlen);  // positions restart at 0 per document
  Tensor h = embeds;
  for (int l = 0; l < static_cast<int>(layers_.size()); ++l) {
    if (fence_) {
      const DecoderLayer& L = layers_[static_cast<size_t>(l)];
      std::vector<const Tensor*> used;
      for (const Tensor* t : {&L.input_layernorm, &L.q_proj, &L.q_bias, &L.k_proj, &L.k_bias, &L.v_proj, &L.v_bias,
                              &L.o_proj, &L.o_bias, &L.q_norm, &L.k_norm, &L.post_attention_layernorm, &L.gate_proj,
                              &L.up_proj, &L.down_proj})
        if (t->defined()) used.push_back(t);
      fence_(used);
    }
    autograd::RecomputeOptions ro{policy, "decoder.layer." + std::to_string(l)};
    if (layer_recompute_ == LayerRecompute::Selective) ro.keep_outputs_of = {"attention"};
    h = autograd::recompute(
        [this, batch, l](const std::vector<Tensor>& in) { return std::vector<Tensor>{layer_forward(l, in[0], batch)}; },
                            {h}, ro)[0];
  }
  if (fence_) fence_({&norm_, &lm_head_weight()});
  MemoryLabelScope label("decoder.norm");
  return rms_norm(h, norm_, config_.rms_norm_eps);
}

Tensor Decoder::forward_cached(const Tensor& embeds, const std::vector<int64_t>& new_lengths, KvCache& cache) const {
  const size_t docs = new_lengths.size();
  if (cache.k.empty()) {
    cache.k.assign(layers_.size(), std::vector<Tensor>(docs));
    cache.v.assign(layers_.size(), std::vector<Tensor>(docs));
    cache.lengths.assign(docs, 0);
  }
  KESTREL_CHECK(cache.lengths.size() == docs, "decoder", "cache holds ", cache.lengths.size(), " documents, step has ",
                docs);
  // Layout of the new tokens: positions continue each document.
  std::vector<int64_t> pos, cu{0};
  int64_t max_q = 0;
  for (size_t d = 0; d < docs; ++d) config_.check_sequence_length(cache.lengths[d] + new_lengths[d]);
  for (size_t d = 0; d < docs; ++d) {
    for (int64_t i = 0; i < new_lengths[d]; ++i) pos.push_back(cache.lengths[d] + i);
    cu.push_back(cu.back() + new_lengths[d]);
    max_q = std::max(max_q, new_lengths[d]);
  }
  PackedBatch batch;
  batch.positions = Tensor::from_vector(pos, {static_cast<int64_t>(pos.size())}, DType::I64, device_);
  batch.cu_seqlens = Tensor::from_vector(cu, {static_cast<int64_t>(cu.size())}, DType::I32, device_);
  batch.max_seqlen = max_q;
  cache.step_lengths = new_lengths;
  Tensor h = embeds;
  for (int l = 0; l < static_cast<int>(layers_.size()); ++l) h = layer_forward(l, h, batch, &cache);
  for (size_t d = 0; d < docs; ++d) cache.lengths[d] += new_lengths[d];
  return rms_norm(h, norm_, config_.rms_norm_eps);
}

Tensor Decoder::loss(const Tensor& hidden, const Tensor& labels, const CrossEntropyOptions& options) const {
  MemoryLabelScope label("decoder.lm_head_loss");
  return fused_linear_cross_entropy(hidden, lm_head_weight(), labels, Tensor(), options);
}

Tensor Decoder::logits(const Tensor& hidden) const { return linear(hidden, lm_head_weight()); }

void Decoder::set_mlp_tile_tokens(int64_t tokens) {
  KESTREL_CHECK(tokens >= 0, "decoder", "mlp tile must be 0 (untiled) or a positive token count, got ", tokens);
  KESTREL_CHECK(tokens == 0 || !fp8_, "decoder", "fp8 with the tiled MLP (mlp_tile_tokens ", tokens,
                ") is not supported: the tiled MLP's GEMMs are bf16 only; set mlp_tile_tokens to 0");
  mlp_tile_tokens_ = tokens;
}

}  // namespace kestrel::models
