// Models: HF-named parameters, safetensors round trips, gradients against finite differences in
// float64, and recompute/offload policies leaving gradients unchanged.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>

#include "kestrel/autograd/grad_mode.h"
#include "kestrel/autograd/tape.h"
#include "kestrel/models/config.h"
#include "kestrel/models/decoder.h"
#include "kestrel/models/safetensors.h"
#include "kestrel/models/vlm.h"
#include "kestrel/ops/elementwise.h"
#include "kestrel/ops/embedding.h"
#include "kestrel/ops/reduce.h"
#include "support/numerics.h"

namespace kestrel::models {
namespace {
namespace ag = autograd;
namespace fs = std::filesystem;

TextConfig tiny_text(const std::string& type) {
  TextConfig c = TextConfig::defaults_for(type);
  c.vocab_size = 37;
  c.hidden_size = 16;
  c.intermediate_size = 24;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 4;
  c.tie_word_embeddings = type == "qwen2";
  return c;
}

VlmConfig tiny_vlm() {
  VlmConfig v;
  v.text_config = tiny_text("qwen2");
  v.vision_config.hidden_size = 8;
  v.vision_config.intermediate_size = 12;
  v.vision_config.num_hidden_layers = 1;
  v.vision_config.num_attention_heads = 2;
  v.vision_config.image_size = 8;
  v.vision_config.patch_size = 2;
  v.pixel_shuffle_factor = 2;
  v.projector_hidden_size = 10;
  v.image_token_id = 36;
  return v;
}

std::string tmpdir(const std::string& name) {
  fs::path p = fs::temp_directory_path() / ("kestrel_models_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(p);
  return p.string();
}

TEST(Decoder, HfNamesAndBiasRules) {
  Decoder q(tiny_text("qwen2"), DType::F32, Device::cpu(), 1);
  EXPECT_NE(q.parameters().find("model.layers.1.self_attn.q_proj.bias"), nullptr);
  EXPECT_EQ(q.parameters().find("model.layers.1.self_attn.o_proj.bias"), nullptr);
  EXPECT_EQ(q.parameters().find("lm_head.weight"), nullptr);  // tied
  Decoder l(tiny_text("llama"), DType::F32, Device::cpu(), 1);
  EXPECT_EQ(l.parameters().find("model.layers.0.self_attn.q_proj.bias"), nullptr);
  EXPECT_NE(l.parameters().find("lm_head.weight"), nullptr);
  EXPECT_EQ(l.parameters().get("model.layers.0.mlp.down_proj.weight").shape(), (Shape{16, 24}));
}

TEST(Decoder, SaveLoadRoundTripIsBitExact) {
  for (DType dt : {DType::F32, DType::BF16}) {
    Decoder a(tiny_text("llama"), dt, Device::cpu(), 3), b(tiny_text("llama"), dt, Device::cpu(), 4);
    std::string dir = tmpdir("rt");
    save_safetensors(a.parameters(), dir);
    LoadReport r = load_safetensors(b.parameters(), dir);
    EXPECT_TRUE(r.missing.empty());
    EXPECT_TRUE(r.unexpected.empty());
    for (auto& [name, t] : a.parameters().items())
      EXPECT_EQ(t->to_float_vector(), b.parameters().get(name).to_float_vector()) << name;
    // A missing tensor is an error naming it.
    SafetensorsReader full = SafetensorsReader::open(dir);
    std::vector<SafetensorsWriteEntry> partial;
    std::vector<Tensor> keep;
    for (auto& [name, t] : a.parameters().items()) {
      if (name == "model.norm.weight") continue;
      keep.push_back(t->contiguous());
      partial.push_back({name, t->dtype(), t->shape(), keep.back().data_ptr()});
    }
    write_safetensors(dir + "/model.safetensors", partial);
    try {
      load_safetensors(b.parameters(), dir);
      ADD_FAILURE() << "expected an error";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("model.norm.weight"), std::string::npos) << e.what();
    }
    fs::remove_all(dir);
  }
}

// Loss of a tiny decoder on packed documents, as a function of chosen parameters, in float64.
TEST(Decoder, GradientsMatchFiniteDifferences) {
  Decoder m(tiny_text("qwen2"), DType::F64, Device::cpu(), 5);
  PackedBatch batch = PackedBatch::from_lengths({5, 1, 3}, Device::cpu());
  Tensor ids = Tensor::from_vector(std::vector<int64_t>{1, 5, 9, 2, 30, 7, 7, 11, 3}, {9});
  Tensor labels = Tensor::from_vector(std::vector<int64_t>{5, 9, 2, 30, -100, -100, 11, 3, -100}, {9});
  // Perturb biases/norms away from their trivial init so their gradients are generic.
  Generator g(9);
  for (auto& [name, t] : m.parameters().items()) t->copy_(add(t->detach(), normal(t->shape(), 0, 0.1, DType::F64, Device::cpu(), g)));
  std::vector<std::string> names = {"model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.v_proj.bias",
                                    "model.layers.0.post_attention_layernorm.weight", "model.norm.weight"};
  std::vector<Tensor> inputs;
  for (auto& n : names) inputs.push_back(m.parameters().get(n).detach());
  EXPECT_TRUE(testing::gradcheck(
      [&](const std::vector<Tensor>& in) {
        for (size_t i = 0; i < names.size(); ++i) {
          Tensor& p = m.parameters().get(names[i]);
          p = in[i];  // route the checker's leaf into the model
        }
        return m.loss(m.forward(m.embed(ids), batch), labels);
      },
      inputs, {.eps = 1e-6, .atol = 1e-8, .rtol = 1e-5}));
}

TEST(Vlm, RecomputeAndOffloadKeepGradients) {
  Vlm m(tiny_vlm(), DType::F32, Device::cpu(), 11);
  const int64_t ti = m.config().image_tokens_per_image();  // (8/2/2)^2 = 4
  ASSERT_EQ(ti, 4);
  std::vector<int64_t> ids, labels, pos;
  for (int doc = 0; doc < 2; ++doc) {
    for (int64_t i = 0; i < ti; ++i) pos.push_back(static_cast<int64_t>(ids.size())), ids.push_back(36), labels.push_back(-100);
    for (int64_t t : {3, 4, 5}) ids.push_back(t), labels.push_back(t + 1);
  }
  VlmBatch b;
  b.input_ids = Tensor::from_vector(ids, {static_cast<int64_t>(ids.size())});
  b.labels = Tensor::from_vector(labels, {static_cast<int64_t>(labels.size())});
  b.image_positions = Tensor::from_vector(pos, {static_cast<int64_t>(pos.size())});
  b.pixel_values = testing::randn({2, 3, 8, 8});
  b.layout = PackedBatch::from_lengths({ti + 3, ti + 3}, Device::cpu());
  std::vector<std::vector<float>> ref;
  for (auto policy : {ag::RecomputePolicy::None, ag::RecomputePolicy::Keep, ag::RecomputePolicy::Offload}) {
    m.parameters().zero_grad();
    Tensor loss = m.loss(b, policy);
    ag::backward(loss);
    std::vector<std::vector<float>> grads;
    for (auto& [name, t] : m.parameters().items()) {
      ASSERT_TRUE(t->grad().defined()) << name;
      grads.push_back(t->grad().to_float_vector());
    }
    if (ref.empty()) ref = grads;
    else EXPECT_EQ(ref, grads) << ag::policy_name(policy);
  }
}

}  // namespace
}  // namespace kestrel::models

namespace kestrel::models {
namespace {

// Incremental decoding with the KV cache gives the hidden states of a full forward, token by token.
TEST(Decoder, KvCacheMatchesFullForward) {
  Decoder m(tiny_text("llama"), DType::F32, Device::cpu(), 21);
  ag::NoGradGuard no_grad;
  std::vector<int64_t> a = {3, 14, 15, 9, 2, 6}, b = {5, 35, 8, 9};
  std::vector<int64_t> all(a);
  all.insert(all.end(), b.begin(), b.end());
  Tensor full = m.forward(m.embed(Tensor::from_vector(all, {10})), PackedBatch::from_lengths({6, 4}, Device::cpu()));
  std::vector<float> want = full.to_float_vector();
  const int64_t C = 16;
  // Prefill 3 + 2 tokens, then the rest one token per document per step (b stops after 4).
  KvCache cache;
  std::vector<int64_t> pre = {a[0], a[1], a[2], b[0], b[1]};
  Tensor h = m.forward_cached(m.embed(Tensor::from_vector(pre, {5})), {3, 2}, cache);
  auto expect_row = [&](const Tensor& got, int64_t got_row, int64_t want_row) {
    std::vector<float> g = got.to_float_vector();
    for (int64_t c = 0; c < C; ++c)
      EXPECT_NEAR(g[got_row * C + c], want[want_row * C + c], 1e-5 * (1 + std::abs(want[want_row * C + c])))
          << "row " << want_row << " col " << c;
  };
  expect_row(h, 2, 2);  // a's third token
  expect_row(h, 4, 7);  // b's second token
  for (int step = 0; step < 3; ++step) {
    std::vector<int64_t> ids = {a[3 + step]};
    std::vector<int64_t> lens = {1, 0};
    if (2 + step < 4) ids.push_back(b[2 + step]), lens[1] = 1;
    Tensor hs = m.forward_cached(m.embed(Tensor::from_vector(ids, {static_cast<int64_t>(ids.size())})), lens, cache);
    expect_row(hs, 0, 3 + step);
    if (lens[1]) expect_row(hs, 1, 6 + 2 + step);
  }
  EXPECT_EQ(cache.lengths, (std::vector<int64_t>{6, 4}));
}

// Greedy decoding with the cache equals greedy decoding by re-running the whole prefix.
TEST(Vlm, CachedGreedyEqualsRecomputedGreedy) {
  Vlm m(tiny_vlm(), DType::F32, Device::cpu(), 13);
  ag::NoGradGuard no_grad;
  // Larger weights than the 0.02 init, so that attention (and so the cache) decides the tokens.
  for (auto& [name, t] : m.parameters().items()) t->copy_(scale(t->detach(), 20.0));
  const int64_t ti = m.config().image_tokens_per_image();
  Tensor px = testing::randn({2, 3, 8, 8});
  std::vector<std::vector<int64_t>> prompts(2, std::vector<int64_t>(static_cast<size_t>(ti), 36));
  prompts[0].push_back(1);
  prompts[1].push_back(2), prompts[1].push_back(3);
  auto got = m.generate_greedy(px, prompts, 6, /*eos_id=*/-1);
  Tensor img = m.image_embeddings(px, ag::RecomputePolicy::None);
  std::vector<std::vector<int64_t>> seqs = prompts;
  for (int step = 0; step < 6; ++step) {
    std::vector<int64_t> ids, lens, pos, last;
    for (auto& s : seqs) {
      for (int64_t t : s) {
        if (t == 36) pos.push_back(static_cast<int64_t>(ids.size()));
        ids.push_back(t);
      }
      lens.push_back(static_cast<int64_t>(s.size()));
      last.push_back(static_cast<int64_t>(ids.size()) - 1);
    }
    Tensor e = splice_rows(m.decoder().embed(Tensor::from_vector(ids, {static_cast<int64_t>(ids.size())})),
                           Tensor::from_vector(pos, {static_cast<int64_t>(pos.size())}), img);
    Tensor h = m.decoder().forward(e, PackedBatch::from_lengths(lens, Device::cpu()));
    std::vector<float> lg = m.decoder().logits(index_select_rows(h, Tensor::from_vector(last, {2}))).to_float_vector();
    for (int i = 0; i < 2; ++i) {
      const float* row = lg.data() + i * 37;
      seqs[i].push_back(std::max_element(row, row + 37) - row);
    }
  }
  for (int i = 0; i < 2; ++i)
    EXPECT_EQ(got[i], std::vector<int64_t>(seqs[i].end() - 6, seqs[i].end())) << "prompt " << i;
}

}  // namespace
}  // namespace kestrel::models
