// Selective recompute on the GPU: the decoder's gradients with selective regions (kept on the
// device, or offloaded to pinned host memory with the region inputs) equal those without recompute
// within the reordering of the flash-attention dq and embedding atomics, and the attention forward
// kernel runs once per layer per step (twice under full recompute).
#include <gtest/gtest.h>

#include "kernels/attention.h"  // the kernel slot, wrapped to count forward runs
#include "kestrel/autograd/tape.h"
#include "kestrel/models/decoder.h"
#include "kestrel/runtime/random.h"
#include "support/gpu.h"
#include "support/numerics.h"
#if KESTREL_WITH_CUDA
#include "kestrel/cuda/memory.h"
#endif

namespace kestrel::models {
namespace {
namespace ag = autograd;

int g_runs = 0;
kernels::AttentionForwardFn* g_cuda_attention = nullptr;

void counting_attention(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k, const Tensor& v,
                        const Tensor& cu_q, const Tensor& cu_k, const kernels::AttentionParams& p) {
  ++g_runs;
  g_cuda_attention(out, lse, q, k, v, cu_q, cu_k, p);
}

TEST(SelectiveRecomputeCuda, GradientsMatchAndAttentionRunsOncePerLayer) {
  KESTREL_REQUIRE_GPU();
  TextConfig c = TextConfig::defaults_for("llama");
  c.vocab_size = 97;
  c.hidden_size = 128;
  c.intermediate_size = 192;
  c.num_hidden_layers = 3;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 32;
  const Device d = Device::cuda(0);
  Decoder m(c, DType::BF16, d, 7);
#if KESTREL_WITH_CUDA
  cuda::install_offloader(0);
#endif
  std::vector<int64_t> lens = {70, 1, 130, 55};
  const int64_t T = 256;
  Tensor ids = randint({T}, 97).to(d), labels = randint({T}, 97).to(d);
  PackedBatch batch = PackedBatch::from_lengths(lens, d);
  g_cuda_attention = kernels::attention_forward.cuda;
  ASSERT_NE(g_cuda_attention, nullptr);
  kernels::attention_forward.cuda = &counting_attention;
  struct Restore {
    ~Restore() { kernels::attention_forward.cuda = g_cuda_attention; }
  } restore;

  struct Case {
    ag::RecomputePolicy policy;
    LayerRecompute mode;
    int runs;
    const char* name;
  };
  std::vector<Tensor> ref;
  for (Case k : {Case{ag::RecomputePolicy::None, LayerRecompute::Full, 3, "none"},
                 Case{ag::RecomputePolicy::Keep, LayerRecompute::Full, 6, "full"},
                 Case{ag::RecomputePolicy::Keep, LayerRecompute::Selective, 3, "selective"},
                 Case{ag::RecomputePolicy::Offload, LayerRecompute::Selective, 3, "selective+offload"}}) {
    m.set_layer_recompute(k.mode);
    m.parameters().zero_grad();
    g_runs = 0;
    ag::backward(m.loss(m.forward(m.embed(ids), batch, k.policy), labels));
    EXPECT_EQ(g_runs, k.runs) << k.name;
    std::vector<Tensor> g;
    for (auto& [name, t] : m.parameters().items()) g.push_back(t->grad().clone());
    if (ref.empty()) {
      ref = g;
      continue;
    }
    // Same kernels on the same values; only atomics may reorder f32 additions: a fraction of a bf16 ulp.
    for (size_t i = 0; i < g.size(); ++i)
      EXPECT_LT(testing::rel_l2(g[i], ref[i]), 4e-3) << k.name << " " << m.parameters().items()[i].first;
  }
}

}  // namespace
}  // namespace kestrel::models
