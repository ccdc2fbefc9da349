// Decoder-sized op outputs for the PyTorch side-by-side check (bench/ops_parity_torch.py).
//
// Runs only when KESTREL_TORCH_PARITY_OUT names a .safetensors file (skips otherwise): draws fresh
// random inputs on the device at Llama-8B widths (8192 tokens x 4096 hidden, 14336 intermediate,
// 32 heads x 128), runs rms_norm (fwd + bwd), layer_norm (fwd + bwd), softmax (fwd + bwd), swiglu
// (fwd + bwd), rope, embedding backward (deterministic), one AdamW step with a bf16 copy, the
// column sum and flash attention (fwd + bwd over packed documents: causal GQA at head dims 128 and 64,
// a sliding window, bidirectional at the narrow head dim 72) through Kestrel, and writes inputs and
// outputs as "<op>.<name>" tensors (hyperparameters in the metadata; per attention case its
// documents' lengths, causal flag and window). The script recomputes every output with PyTorch from
// the same inputs and fails when Kestrel's error against an f32 reference exceeds twice PyTorch's own
// bf16 error (or a floor; attention: FlashAttention's max-abs rule against float64).
#include <gtest/gtest.h>

#include <cstdlib>
#include <map>

#include "kestrel/autograd/tape.h"
#include "kestrel/models/safetensors.h"
#include "kestrel/ops/activation.h"
#include "kestrel/ops/attention.h"
#include "kestrel/ops/embedding.h"
#include "kestrel/ops/norm.h"
#include "kestrel/ops/optim.h"
#include "kestrel/ops/reduce.h"
#include "kestrel/ops/rope.h"
#include "kestrel/ops/softmax.h"
#include "ops/attention_case_util.h"
#include "support/gpu.h"
#include "support/numerics.h"

namespace kestrel {
namespace {

constexpr int64_t kTokens = 8192, kHidden = 4096, kInter = 14336, kHeads = 32, kHeadDim = 128;

TEST(CudaTorchParity, DumpDecoderShapes) {
  KESTREL_REQUIRE_GPU();
  const char* path = std::getenv("KESTREL_TORCH_PARITY_OUT");
  if (path == nullptr || *path == '\0') GTEST_SKIP() << "set KESTREL_TORCH_PARITY_OUT to write the dump";
  const Device gpu = Device::cuda(0);
  const DType bf = DType::BF16;
  std::vector<std::pair<std::string, Tensor>> named;  // host copies, kept alive until written
  auto put = [&](const std::string& name, const Tensor& t) {
    ASSERT_TRUE(t.defined()) << name;
    named.emplace_back(name, t.detach().contiguous().to(Device::cpu()));
  };
  auto leaf = [](Tensor t) {
    t.set_requires_grad(true);
    return t;
  };

  {  // rms_norm forward + backward
    Tensor x = leaf(testing::randn({kTokens, kHidden}, bf, gpu));
    Tensor w = leaf(testing::randu({kHidden}, 0.5, 1.5, bf, gpu));
    Tensor dy = testing::randn({kTokens, kHidden}, bf, gpu);
    Tensor y = rms_norm(x, w, 1e-5);
    autograd::backward({y}, {dy});
    put("rms_norm.x", x), put("rms_norm.w", w), put("rms_norm.dy", dy);
    put("rms_norm.y", y), put("rms_norm.dx", x.grad()), put("rms_norm.dw", w.grad());
  }
  {  // layer_norm forward + backward
    Tensor x = leaf(testing::randn({kTokens, kHidden}, bf, gpu));
    Tensor w = leaf(testing::randu({kHidden}, 0.5, 1.5, bf, gpu)), b = leaf(testing::randn({kHidden}, bf, gpu));
    Tensor dy = testing::randn({kTokens, kHidden}, bf, gpu);
    Tensor y = layer_norm(x, w, b, 1e-5);
    autograd::backward({y}, {dy});
    put("layer_norm.x", x), put("layer_norm.w", w), put("layer_norm.b", b), put("layer_norm.dy", dy);
    put("layer_norm.y", y), put("layer_norm.dx", x.grad()), put("layer_norm.dw", w.grad());
    put("layer_norm.db", b.grad());
  }
  {  // softmax forward + backward [4096, 8192]
    Tensor x = leaf(testing::randn({kTokens / 2, 8192}, bf, gpu, 2.0));
    Tensor dy = testing::randn({kTokens / 2, 8192}, bf, gpu);
    Tensor y = softmax(x, -1);
    autograd::backward({y}, {dy});
    put("softmax.x", x), put("softmax.dy", dy), put("softmax.y", y), put("softmax.dx", x.grad());
  }
  {  // swiglu forward + backward [2048, 14336]
    Tensor g = leaf(testing::randn({kTokens / 4, kInter}, bf, gpu)), u = leaf(testing::randn({kTokens / 4, kInter}, bf, gpu));
    Tensor dy = testing::randn({kTokens / 4, kInter}, bf, gpu);
    Tensor y = swiglu(g, u);
    autograd::backward({y}, {dy});
    put("swiglu.g", g), put("swiglu.u", u), put("swiglu.dy", dy), put("swiglu.y", y);
    put("swiglu.dg", g.grad()), put("swiglu.du", u.grad());
  }
  {  // rope on packed documents of 2048 tokens (positions restart per document)
    Tensor q = testing::randn({kTokens, kHeads, kHeadDim}, bf, gpu);
    std::vector<int64_t> pos(kTokens);
    for (int64_t i = 0; i < kTokens; ++i) pos[i] = i % 2048;
    Tensor p = Tensor::from_vector(pos, {kTokens}).to(gpu);
    put("rope.q", q), put("rope.pos", p), put("rope.y", rope(q, p, 500000.0));
  }
  {  // embedding backward, deterministic, heavily repeated ids
    constexpr int64_t kVocab = 16000;
    std::vector<int64_t> ids(kTokens);
    for (int64_t i = 0; i < kTokens; ++i) ids[i] = (i * 7919 + (i % 13) * 104729) % (i % 3 == 0 ? 97 : kVocab);
    Tensor id = Tensor::from_vector(ids, {kTokens}).to(gpu);
    Tensor w = leaf(testing::randn({kVocab, kHidden}, bf, gpu));
    Tensor dy = testing::randn({kTokens, kHidden}, bf, gpu);
    autograd::backward({embedding(w, id, true)}, {dy});
    put("embedding.ids", id), put("embedding.dy", dy), put("embedding.dw", w.grad());
  }
  {  // one AdamW step (step 3) on f32 masters with a bf16 copy
    constexpr int64_t n = 2048 * kHidden;
    Tensor p = testing::randn({n}, DType::F32, gpu), g = testing::randn({n}, bf, gpu);
    Tensor m = testing::randn({n}, DType::F32, gpu, 0.01), v = testing::randu({n}, 0.0, 1e-4, DType::F32, gpu);
    put("adamw.p", p), put("adamw.g", g), put("adamw.m", m), put("adamw.v", v);
    Tensor copy = Tensor::empty({n}, bf, gpu);
    AdamWOptions o;
    o.lr = 1e-3, o.beta1 = 0.9, o.beta2 = 0.95, o.eps = 1e-8, o.weight_decay = 0.1;
    adamw_step(p, g, m, v, 3, o, copy);
    put("adamw.p_out", p), put("adamw.m_out", m), put("adamw.v_out", v), put("adamw.copy", copy);
  }
  {  // column sums (bias / weight gradients): bf16 [16384, 4096] and f32 [8192, 4096]
    Tensor xb = testing::randn({2 * kTokens, kHidden}, bf, gpu), xf = testing::randn({kTokens, kHidden}, DType::F32, gpu);
    put("colsum_bf16.x", xb), put("colsum_bf16.y", sum(xb, {0}));
    put("colsum_f32.x", xf), put("colsum_f32.y", sum(xf, {0}));
  }
  // Flash attention forward + backward over packed documents (the issue-22 test rule: the script
  // compares Kestrel's and PyTorch's own bf16 errors against a float64 reference).
  struct AttnCase {
    std::string name;
    std::vector<int64_t> lens;
    int64_t hq, hkv, d;
    bool causal;
    int64_t window;
  };
  const std::vector<AttnCase> attn_cases{
      {"attn_causal_d128", {1536, 2560}, 32, 8, 128, true, 0},
      {"attn_causal_d64", {3000, 1096}, 32, 8, 64, true, 0},
      {"attn_window_d128", {4096}, 16, 4, 128, true, 1024},
      {"attn_bidir_d72", {729, 729, 729, 729}, 16, 16, 72, false, 0},
  };
  std::map<std::string, std::string> meta;
  for (const AttnCase& c : attn_cases) {
    const int64_t t = testing::sum_of(c.lens);
    Tensor q = leaf(testing::randn({t, c.hq, c.d}, bf, gpu)), k = leaf(testing::randn({t, c.hkv, c.d}, bf, gpu));
    Tensor v = leaf(testing::randn({t, c.hkv, c.d}, bf, gpu));
    Tensor dout = testing::randn({t, c.hq, c.d}, bf, gpu);
    const Tensor cu = testing::cu_from(c.lens).to(gpu);
    AttentionOptions o;
    o.causal = c.causal;
    o.window = c.window;
    o.backend = AttentionBackend::Kestrel;
    const AttentionOutput r = attention(q, k, v, cu, cu, testing::max_of(c.lens), testing::max_of(c.lens), o);
    autograd::backward({r.out}, {dout});
    put(c.name + ".q", q), put(c.name + ".k", k), put(c.name + ".v", v), put(c.name + ".dout", dout);
    put(c.name + ".out", r.out), put(c.name + ".lse", r.lse);
    put(c.name + ".dq", q.grad()), put(c.name + ".dk", k.grad()), put(c.name + ".dv", v.grad());
    std::string lens;
    for (int64_t l : c.lens) lens += (lens.empty() ? "" : ",") + std::to_string(l);
    meta[c.name + ".lens"] = lens;
    meta[c.name + ".causal"] = c.causal ? "1" : "0";
    meta[c.name + ".window"] = std::to_string(c.window);
  }
  std::vector<models::SafetensorsWriteEntry> entries;
  for (const auto& [name, t] : named) entries.push_back({name, t.dtype(), t.shape(), t.data_ptr()});
  meta.insert({{"eps", "1e-5"},
               {"rope_theta", "500000"},
               {"adamw_lr", "1e-3"},
               {"adamw_beta1", "0.9"},
               {"adamw_beta2", "0.95"},
               {"adamw_eps", "1e-8"},
               {"adamw_wd", "0.1"},
               {"adamw_step", "3"}});
  models::write_safetensors(path, entries, meta);
  std::printf("[torch parity dump] %zu tensors -> %s\n", entries.size(), path);
}

}  // namespace
}  // namespace kestrel
