// The decoder's selective recompute (LayerRecompute::Selective): every gradient equals the one
// without recompute bit for bit (f32 and bf16, with and without region offload, untiled and tiled
// MLP), the attention kernel runs exactly once per layer per step (twice under full recompute),
// and the forward holds exactly the attention output and log-sum-exp of every layer more than
// full recompute does (what the memory planner counts).
#include <gtest/gtest.h>

#include "kernels/attention.h"  // the kernel slot, wrapped to count forward runs
#include "kestrel/autograd/grad_mode.h"
#include "kestrel/autograd/tape.h"
#include "kestrel/models/decoder.h"
#include "kestrel/runtime/memory_trace.h"
#include "kestrel/runtime/random.h"
#include "support/numerics.h"

namespace kestrel::models {
namespace {
namespace ag = autograd;

int g_attention_runs = 0;
kernels::AttentionForwardFn* g_cpu_attention = nullptr;

void counting_attention(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k, const Tensor& v,
                        const Tensor& cu_q, const Tensor& cu_k, const kernels::AttentionParams& p) {
  ++g_attention_runs;
  g_cpu_attention(out, lse, q, k, v, cu_q, cu_k, p);
}

// Counts the CPU attention forward kernel's runs while it lives.
struct AttentionCounter {
  AttentionCounter() {
    g_cpu_attention = kernels::attention_forward.cpu;
    kernels::attention_forward.cpu = &counting_attention;
    g_attention_runs = 0;
  }
  ~AttentionCounter() { kernels::attention_forward.cpu = g_cpu_attention; }
};

TextConfig small_text(const std::string& type) {
  TextConfig c = TextConfig::defaults_for(type);
  c.vocab_size = 53;
  c.hidden_size = 32;
  c.intermediate_size = 48;
  c.num_hidden_layers = 3;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 8;
  c.tie_word_embeddings = false;
  return c;
}

struct Step {
  std::vector<std::vector<float>> grads;  // every parameter, in registration order
  int attention_runs = 0;
  int64_t activation_after_forward = 0;  // Activation bytes held when backward starts
};

Step train_step(Decoder& m, const PackedBatch& batch, const Tensor& ids, const Tensor& labels,
                ag::RecomputePolicy policy, LayerRecompute mode) {
  m.set_layer_recompute(mode);
  m.parameters().zero_grad();
  AttentionCounter count;
  MemoryTrace& tr = memory_trace(Device::cpu());
  const int64_t base = tr.snapshot().tags[static_cast<int>(MemoryTag::Activation)].current;
  Step s;
  Tensor loss;
  {
    TagScope act(MemoryTag::Activation);
    loss = m.loss(m.forward(m.embed(ids), batch, policy), labels);
  }
  s.activation_after_forward = tr.snapshot().tags[static_cast<int>(MemoryTag::Activation)].current - base;
  {
    TagScope grads(MemoryTag::Gradient);
    ag::backward(loss);
  }
  for (auto& [name, t] : m.parameters().items()) {
    EXPECT_TRUE(t->grad().defined()) << name;
    s.grads.push_back(t->grad().to_float_vector());
  }
  s.attention_runs = g_attention_runs;
  return s;
}

struct Case {
  const char* type;
  DType dtype;
  int64_t mlp_tile;
};

TEST(SelectiveRecompute, GradientsEqualNoRecomputeBitForBitAndAttentionRunsOncePerLayer) {
  const std::vector<int64_t> lengths = {9, 4, 11};
  const int64_t T = 24;
  for (Case c : {Case{"llama", DType::F32, 0}, Case{"qwen2", DType::BF16, 0}, Case{"qwen3", DType::F32, 7}}) {
    SCOPED_TRACE(std::string(c.type) + " " + std::string(dtype_name(c.dtype)) + " mlp tile " + std::to_string(c.mlp_tile));
    Decoder m(small_text(c.type), c.dtype, Device::cpu(), 17);
    m.set_mlp_tile_tokens(c.mlp_tile);
    // Move norms and biases off their trivial init so every gradient is generic.
    Generator g(3);
    for (auto& [name, t] : m.parameters().items())
      t->copy_(normal(t->shape(), name.find("norm") != std::string::npos ? 1.0 : 0.0, 0.1, DType::F32, Device::cpu(), g)
                   .to(c.dtype));
    PackedBatch batch = PackedBatch::from_lengths(lengths, Device::cpu());
    std::vector<int64_t> id(T), label(T);
    for (int64_t i = 0; i < T; ++i) id[i] = (i * 7 + 3) % 53, label[i] = i % 5 == 4 ? -100 : (i * 11 + 1) % 53;
    Tensor ids = Tensor::from_vector(id, {T}), labels = Tensor::from_vector(label, {T});
    const int L = 3;

    Step none = train_step(m, batch, ids, labels, ag::RecomputePolicy::None, LayerRecompute::Full);
    Step full = train_step(m, batch, ids, labels, ag::RecomputePolicy::Keep, LayerRecompute::Full);
    Step sel = train_step(m, batch, ids, labels, ag::RecomputePolicy::Keep, LayerRecompute::Selective);
    Step sel_off = train_step(m, batch, ids, labels, ag::RecomputePolicy::Offload, LayerRecompute::Selective);
    // none: LayerRecompute has no effect without regions.
    Step none_sel = train_step(m, batch, ids, labels, ag::RecomputePolicy::None, LayerRecompute::Selective);

    EXPECT_EQ(none.attention_runs, L);
    EXPECT_EQ(full.attention_runs, 2 * L);
    EXPECT_EQ(sel.attention_runs, L);
    EXPECT_EQ(sel_off.attention_runs, L);
    EXPECT_EQ(none_sel.attention_runs, L);
    // The recomputed q, k, v, the kept out and lse, and every other value of the re-run are those of
    // the forward (the same deterministic CPU kernels on the same inputs), so each gradient is.
    for (const Step* s : {&full, &sel, &sel_off, &none_sel}) {
      ASSERT_EQ(s->grads.size(), none.grads.size());
      for (size_t i = 0; i < none.grads.size(); ++i) EXPECT_EQ(s->grads[i], none.grads[i]) << "parameter " << i;
    }
    // Kept per layer: attention out [T, Hq, D] in the model dtype and lse [T, Hq] f32.
    const int64_t kept = T * 4 * 8 * static_cast<int64_t>(dtype_size(c.dtype)) + T * 4 * 4;
    EXPECT_EQ(sel.activation_after_forward - full.activation_after_forward, L * kept);
    EXPECT_LT(sel.activation_after_forward, none.activation_after_forward);
  }
}

// The KV-cache path and evaluation under no-grad are untouched by the mode (no regions record).
TEST(SelectiveRecompute, EvaluationWithoutGradIsUnchanged) {
  Decoder m(small_text("llama"), DType::F32, Device::cpu(), 5);
  PackedBatch batch = PackedBatch::from_lengths({6, 5}, Device::cpu());
  Tensor ids = Tensor::from_vector(std::vector<int64_t>{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11}, {11});
  ag::NoGradGuard no_grad;
  Tensor ref = m.forward(m.embed(ids), batch, ag::RecomputePolicy::None);
  m.set_layer_recompute(LayerRecompute::Selective);
  AttentionCounter count;
  Tensor h = m.forward(m.embed(ids), batch, ag::RecomputePolicy::Keep);
  EXPECT_EQ(g_attention_runs, 3);
  EXPECT_EQ(h.to_float_vector(), ref.to_float_vector());
  EXPECT_STREQ(layer_recompute_name(m.layer_recompute()), "selective");
}

}  // namespace
}  // namespace kestrel::models
