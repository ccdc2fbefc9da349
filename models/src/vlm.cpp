// VLM forward, loss and greedy decoding.
#include "kestrel/models/vlm.h"

#include <algorithm>

#include "kestrel/autograd/grad_mode.h"
#include "kestrel/ops/activation.h"
#include "kestrel/ops/elementwise.h"
#include "kestrel/ops/embedding.h"
#include "kestrel/ops/matmul.h"
#include "kestrel/ops/shape.h"

namespace kestrel::models {

Vlm::Vlm(const VlmConfig& config, DType dtype, Device device, uint64_t seed)
    : config_(config),
      dtype_(dtype),
      device_(device),
      vision_(config.vision_config, dtype, device, seed ^ 0x5151, "vision_tower."),
      decoder_(config.text_config, dtype, device, seed ^ 0x7e7e, "language_model.") {
  config_.validate();
  const int64_t s = config_.pixel_shuffle_factor, E = config_.vision_config.hidden_size;
  const int64_t C = config_.text_config.hidden_size;
  const int64_t Hp = config_.projector_hidden_size > 0 ? config_.projector_hidden_size : C;
  Generator gen(seed ^ 0x9090);
  for (auto& [name, t] : vision_.parameters().items()) params_.add(name, t);
  auto add = [&](const std::string& name, Tensor& t, const Shape& shape, bool weight) {
    t = make_parameter("multi_modal_projector." + name, shape, dtype_, device_);
    if (weight)
      init_normal(t, 0.02, gen);
    else
      init_constant(t, 0.0);
    params_.add(t.name(), &t);
  };
  add("linear_1.weight", proj1_w_, {Hp, E * s * s}, true);
  add("linear_1.bias", proj1_b_, {Hp}, false);
  add("linear_2.weight", proj2_w_, {C, Hp}, true);
  add("linear_2.bias", proj2_b_, {C}, false);
  for (auto& [name, t] : decoder_.parameters().items()) params_.add(name, t);
}

Tensor Vlm::image_embeddings(const Tensor& pixel_values, autograd::RecomputePolicy policy) const {
  const int64_t B = pixel_values.shape()[0], S = config_.vision_config.patches_per_side();
  const int64_t s = config_.pixel_shuffle_factor, E = config_.vision_config.hidden_size;
  // Kestrel's features: the tower's post_layernorm output; LLaVA's: hidden_states[vision_feature_layer].
  Tensor v = config_.vision_feature_layer ? vision_.hidden_state(pixel_values, config_.vision_blocks_used(), policy)
                                          : vision_.forward(pixel_values, policy);  // [B*S*S, E]
  MemoryLabelScope label("projector");  // Pixel shuffle: each s x s neighbourhood of patches becomes one token of width s*s*E.
  Tensor g = reshape(v, {B, S / s, s, S / s, s, E});
  g = permute(g, {0, 1, 3, 2, 4, 5});
  g = reshape(contiguous(g), {B * (S / s) * (S / s), s * s * E});
  const bool tanh_gelu = config_.projector_hidden_act == "gelu_pytorch_tanh";
  return linear(gelu(linear(g, proj1_w_, proj1_b_), tanh_gelu), proj2_w_, proj2_b_);
}

Tensor Vlm::hidden(const VlmBatch& batch, autograd::RecomputePolicy policy) const {
  Tensor embeds = decoder_.embed(batch.input_ids);
  if (batch.pixel_values.defined() && batch.pixel_values.numel() > 0) {
    Tensor img = image_embeddings(batch.pixel_values, policy);
    KESTREL_CHECK(batch.image_positions.numel() == img.shape()[0], "vlm", "batch has ",
                  batch.image_positions.numel(), " image-token slots for ", img.shape()[0], " image embeddings (",
                  config_.image_tokens_per_image(), " per image)");
    if (!batch.images_per_document.empty()) {
      int64_t images = 0;
      for (int64_t n : batch.images_per_document) images += n;
      KESTREL_CHECK(images == batch.pixel_values.shape()[0] &&
                        static_cast<int64_t>(batch.images_per_document.size()) + 1 == batch.layout.cu_seqlens.numel(),
                    "vlm", "batch's images per document (", batch.images_per_document.size(), " documents, ", images,
                    " images) disagree with its ", batch.layout.cu_seqlens.numel() - 1, " documents and ",
                    batch.pixel_values.shape()[0], " pixel images");
    }
    MemoryLabelScope label("splice");
    embeds = splice_rows(embeds, batch.image_positions, img);
  }
  return decoder_.forward(embeds, batch.layout, policy);
}

Tensor Vlm::loss(const VlmBatch& batch, autograd::RecomputePolicy policy, const CrossEntropyOptions& options) const {
  return decoder_.loss(hidden(batch, policy), batch.labels, options);
}

std::vector<std::vector<int64_t>> Vlm::generate_greedy(const Tensor& pixel_values,
                                                       const std::vector<std::vector<int64_t>>& prompts,
                                                       int64_t max_new_tokens, int64_t eos_id) const {
  autograd::NoGradGuard no_grad;
  const int64_t n = static_cast<int64_t>(prompts.size());
  std::vector<std::vector<int64_t>> out(n);
  std::vector<bool> done(n, false);
  // Prefill: every prompt (images spliced in) as one packed step, filling the KV cache; then one
  // token per document per step, attending over the cache.
  Tensor img = image_embeddings(pixel_values, autograd::RecomputePolicy::None);
  std::vector<int64_t> ids, lengths, img_pos;
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t t : prompts[i]) {
      if (t == config_.image_token_id) img_pos.push_back(static_cast<int64_t>(ids.size()));
      ids.push_back(t);
    }
    KESTREL_CHECK(!prompts[i].empty(), "generate", "prompt ", i, " is empty");
    lengths.push_back(static_cast<int64_t>(prompts[i].size()));
  }
  KESTREL_CHECK(static_cast<int64_t>(img_pos.size()) == img.shape()[0], "generate", "prompts hold ", img_pos.size(),
                " image tokens for ", img.shape()[0], " image embeddings");
  Tensor embeds = decoder_.embed(Tensor::from_vector(ids, {static_cast<int64_t>(ids.size())}, DType::I64, device_));
  embeds = splice_rows(embeds, Tensor::from_vector(img_pos, {static_cast<int64_t>(img_pos.size())}, DType::I64, device_),
                       img);
  KvCache cache;
  Tensor h = decoder_.forward_cached(embeds, lengths, cache);
  std::vector<int64_t> last(static_cast<size_t>(n));
  for (int64_t i = 0, end = 0; i < n; ++i) end += lengths[i], last[i] = end - 1;
  const int64_t V = config_.text_config.vocab_size;
  for (int64_t step = 0; step < max_new_tokens; ++step) {
    Tensor rows = step == 0 ? index_select_rows(h, Tensor::from_vector(last, {n}, DType::I64, device_)) : h;
    std::vector<float> logits = decoder_.logits(rows).to_float_vector();  // [n, V]
    std::vector<int64_t> next(static_cast<size_t>(n));
    bool all_done = true;
    for (int64_t i = 0; i < n; ++i) {
      const float* row = logits.data() + i * V;
      next[i] = std::max_element(row, row + V) - row;
      if (!done[i]) {
        out[i].push_back(next[i]);
        if (next[i] == eos_id) done[i] = true;
      }
      all_done = all_done && done[i];
    }
    if (all_done || step + 1 == max_new_tokens) break;
    h = decoder_.forward_cached(decoder_.embed(Tensor::from_vector(next, {n}, DType::I64, device_)),
                                std::vector<int64_t>(static_cast<size_t>(n), 1), cache);
  }
  return out;
}

}  // namespace kestrel::models
