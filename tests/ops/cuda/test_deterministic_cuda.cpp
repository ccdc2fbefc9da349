// Run-to-run reproducibility of the GPU ops a training step uses (issue 18 item 7, train.deterministic):
// each computation runs twice (or three times, with other allocations in between so the buffers
// move) and must give the same bits.
// - the embedding backward with `deterministic` (heavily repeated ids: the case atomics reorder),
//   fresh and accumulated into an existing gradient, and against the CPU's float64 reference;
// - cuBLASLt GEMMs of the shapes most likely to get a split-K algorithm (weight gradients with
//   K = tokens, skinny K-heavy products): cuBLAS documents run-to-run bitwise results for one
//   toolkit, architecture and SM count with a user workspace, and the plan key (shapes, layouts,
//   pointer alignments, workspace) depends on shapes only (blocks are 512-byte aligned), so nothing
//   is set for determinism; this checks that claim on the device;
// - the fused linear + cross-entropy (loss, d_hidden, d_weight);
// - a small decoder's whole backward with set_deterministic(true), which needs attention's
//   fixed-order dQ (AttentionOptions::deterministic).
#include <gtest/gtest.h>

#include <cstring>
#include <nlohmann/json.hpp>
#include <vector>

#include "kestrel/autograd/tape.h"
#include "kestrel/models/decoder.h"
#include "kestrel/ops/cross_entropy.h"
#include "kestrel/ops/embedding.h"
#include "kestrel/ops/matmul.h"
#include "support/gpu.h"
#include "support/numerics.h"

namespace kestrel {
namespace {

std::vector<uint8_t> bytes(const Tensor& t) {
  Tensor c = t.contiguous().to(Device::cpu());
  const auto* p = static_cast<const uint8_t*>(c.data_ptr());
  return std::vector<uint8_t>(p, p + c.nbytes());
}

// M ids over [0, V): half of them id 0 (a padding / separator token), a quarter over 16 ids, the
// rest spread over the vocabulary.
std::vector<int64_t> skewed_ids(int64_t M, int64_t V) {
  std::vector<int64_t> ids(static_cast<size_t>(M));
  for (int64_t i = 0; i < M; ++i)
    ids[static_cast<size_t>(i)] = i % 2 == 0 ? 0 : i % 4 == 1 ? 1 + (i * 31) % 16 : (i * 7919) % V;
  return ids;
}

Tensor embedding_grad(const Tensor& w0, const Tensor& ids, const Tensor& up, int calls) {
  Tensor w = w0.clone();
  w.set_requires_grad(true);
  for (int k = 0; k < calls; ++k) {  // calls > 1: accumulation into w.grad in place
    Tensor out = embedding(w, ids, /*deterministic=*/true);
    autograd::backward({out}, {up});
  }
  return w.grad().to(Device::cpu());
}

TEST(DeterministicCuda, EmbeddingBackwardRepeatsBitwise) {
  KESTREL_REQUIRE_GPU();
  const Device gpu = Device::cuda(0);
  const int64_t V = 5003, C = 512, M = 16384;
  const std::vector<int64_t> ids = skewed_ids(M, V);
  for (DType dt : {DType::BF16, DType::F32}) {
    Tensor w = testing::randn({V, C}, dt), up = testing::randn({M, C}, dt);
    Tensor idc = Tensor::from_vector(ids, {M}, DType::I32);
    Tensor wg = w.to(gpu), upg = up.to(gpu), idg = idc.to(gpu);
    for (int calls : {1, 2}) {
      Tensor a = embedding_grad(wg, idg, upg, calls);
      Tensor spacer = Tensor::empty({12345}, DType::F32, gpu);  // the second run's buffers move
      Tensor b = embedding_grad(wg, idg, upg, calls);
      EXPECT_EQ(bytes(a), bytes(b)) << dtype_name(dt) << " calls " << calls;
      // The CPU reference sums in f64 and rounds once; the kernel sums in f32 in index order (row 0
      // takes 8192 terms, twice with calls 2: f32 rounding of ~sqrt(n) eps, 1.15e-6 seen on the H200).
      Tensor ref = embedding_grad(w, idc, up, calls);
      EXPECT_LE(testing::rel_l2(a.to(DType::F32), ref.to(DType::F32)), dt == DType::F32 ? 1e-5 : 2e-3)
          << dtype_name(dt) << " calls " << calls;
    }
  }
}

TEST(DeterministicCuda, CublasLtGemmsRepeatBitwise) {
  KESTREL_REQUIRE_GPU();
  const Device gpu = Device::cuda(0);
  struct Case {
    const char* what;
    Shape a, b;
    bool ta, tb;
    DType dt;
  };
  const Case cases[] = {
      {"weight gradient x^T dy, K = 8192 tokens", {8192, 256}, {8192, 512}, true, false, DType::BF16},
      {"weight gradient dy^T x, K = 8192 tokens", {8192, 2048}, {8192, 512}, true, false, DType::BF16},
      {"skinny K-heavy", {64, 65536}, {65536, 64}, false, false, DType::BF16},
      {"skinny K-heavy f32", {64, 65536}, {65536, 64}, false, false, DType::F32},
      {"linear x W^T", {4096, 2048}, {1024, 2048}, false, true, DType::BF16},
  };
  for (const Case& c : cases) {
    Tensor a = testing::randn(c.a, c.dt, gpu), b = testing::randn(c.b, c.dt, gpu);
    std::vector<std::vector<uint8_t>> runs;
    std::vector<Tensor> spacers;
    for (int r = 0; r < 3; ++r) {
      runs.push_back(bytes(matmul(a, b, c.ta, c.tb)));
      spacers.push_back(Tensor::empty({1000 + 777 * r}, DType::BF16, gpu));
    }
    EXPECT_EQ(runs[0], runs[1]) << c.what;
    EXPECT_EQ(runs[0], runs[2]) << c.what;
  }
}

TEST(DeterministicCuda, FusedLinearCrossEntropyRepeatsBitwise) {
  KESTREL_REQUIRE_GPU();
  const Device gpu = Device::cuda(0);
  const int64_t N = 6000, H = 256, V = 32003;  // more than one token chunk of the backward
  Tensor h0 = testing::randn({N, H}, DType::BF16, gpu), w0 = testing::randn({V, H}, DType::BF16, gpu, 0.05);
  std::vector<int64_t> labels(static_cast<size_t>(N));
  for (int64_t i = 0; i < N; ++i) labels[static_cast<size_t>(i)] = (i * 7919) % V;
  Tensor y = Tensor::from_vector(labels, {N}, DType::I64, gpu);
  auto run = [&] {
    Tensor h = h0.clone(), w = w0.clone();
    h.set_requires_grad(true);
    w.set_requires_grad(true);
    Tensor loss = fused_linear_cross_entropy(h, w, y);
    autograd::backward({loss}, {Tensor::full({}, 1.0, loss.dtype(), gpu)});
    return std::vector<std::vector<uint8_t>>{bytes(loss), bytes(h.grad()), bytes(w.grad())};
  };
  const auto a = run();
  Tensor spacer = Tensor::empty({4099}, DType::F32, gpu);
  const auto b = run();
  EXPECT_EQ(a[0], b[0]) << "loss";
  EXPECT_EQ(a[1], b[1]) << "d_hidden";
  EXPECT_EQ(a[2], b[2]) << "d_weight";
}

TEST(DeterministicCuda, DecoderBackwardRepeatsBitwise) {
  KESTREL_REQUIRE_GPU();
  const Device gpu = Device::cuda(0);
  const nlohmann::json text = {{"model_type", "llama"}, {"vocab_size", 512}, {"hidden_size", 256},
                                {"intermediate_size", 512}, {"num_hidden_layers", 2}, {"num_attention_heads", 4},
                                {"num_key_value_heads", 2}, {"max_position_embeddings", 4096},
                                {"tie_word_embeddings", true}};
  const models::TextConfig cfg = models::TextConfig::from_json(text);
  models::Decoder dec(cfg, DType::BF16, gpu, /*seed=*/7);
  dec.set_deterministic(true);
  const std::vector<int64_t> lengths = {700, 1300, 48, 2048};  // packed documents, 4096 tokens
  int64_t T = 0;
  for (int64_t n : lengths) T += n;
  std::vector<int64_t> ids = skewed_ids(T, cfg.vocab_size), next(ids.begin() + 1, ids.end());
  next.push_back(0);
  Tensor x = Tensor::from_vector(ids, {T}, DType::I64, gpu), y = Tensor::from_vector(next, {T}, DType::I64, gpu);
  const models::PackedBatch batch = models::PackedBatch::from_lengths(lengths, gpu);
  auto run = [&] {
    dec.parameters().zero_grad();
    Tensor loss = dec.loss(dec.forward(dec.embed(x), batch), y);
    autograd::backward({loss}, {Tensor::full({}, 1.0, loss.dtype(), gpu)});
    std::vector<std::vector<uint8_t>> out{bytes(loss)};
    for (auto& [name, p] : dec.parameters().items()) out.push_back(bytes(p->grad()));
    return out;
  };
  const auto a = run();
  Tensor spacer = Tensor::empty({54321}, DType::BF16, gpu);
  const auto b = run();
  ASSERT_EQ(a.size(), b.size());
  EXPECT_EQ(a[0], b[0]) << "loss";
  size_t i = 1;
  for (auto& [name, p] : dec.parameters().items()) {
    EXPECT_EQ(a[i], b[i]) << name;
    ++i;
  }
}

}  // namespace
}  // namespace kestrel
