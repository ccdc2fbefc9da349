// Flash attention beyond the dense shapes (issue 22's masked and packed-documents evidence), bf16,
// 32 query heads (= KV heads), forward and forward+backward, the library's kernel choice:
// - BM_flash_attention_prefix: two documents of T tokens each whose first P keys every query of the
//   document sees (prefix-LM / image-prefix mask), the rest causal. FLOPs count the visible scores
//   only, T*T/2 + P*P/2 per document (FlashAttention's causal count plus the prefix's upper
//   triangle), so a kernel that visits no tile past the prefix and the diagonal shows about the
//   causal TFLOP/s, and one that ran bidirectional tiles and masked would show less.
// - BM_flash_attention_varlen: packs of 65536 tokens cut into documents with long-tailed lengths
//   (kDocLengths below, the same sequence bench/attention_masked_vs_torch.py draws), causal. FLOPs
//   4 * sum(L^2)/2 * D * H. Compares with the dense causal rows at the pack's typical lengths.
// Timed with CUDA events; the TFLOPs counter is what bench/attention_masked_vs_torch.py prints next to
// PyTorch (flex attention for the prefix mask; the varlen and padded SDPA paths for packs).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include <benchmark/benchmark.h>
#include <cuda_runtime.h>

#include "bench_common.cuh"
#include "cuda/flash_attention/flash_attention.h"
#include "kestrel/cuda/check.h"

namespace {

using kestrel::cuda::AttnDType;
using kestrel::cuda::FlashAttentionBackwardParams;
using kestrel::cuda::FlashAttentionParams;

constexpr int kHeads = 32;
constexpr int kPackTokens = 65536;

using kestrel::bench::fill_random_bf16;

// Document lengths of one pack: a Pareto tail (shape 1.1, scale 96 tokens) capped at 16384, drawn with a
// 64-bit LCG (Knuth's MMIX constants) so the Python side draws the same sequence; the last document takes
// what is left of the pack.
std::vector<int> doc_lengths(uint64_t seed, int pack_tokens) {
  std::vector<int> out;
  uint64_t x = seed;
  int used = 0;
  while (used < pack_tokens) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    const double u = (static_cast<double>(x >> 11) + 0.5) / 9007199254740992.0;  // (0, 1)
    int len = static_cast<int>(std::min(16384.0, std::floor(96.0 / std::pow(u, 1.0 / 1.1))));
    len = std::min(len, pack_tokens - used);
    out.push_back(len);
    used += len;
  }
  return out;
}

struct Run {
  std::vector<int> lengths;
  int prefix = 0;  // per document, 0 = plain causal
};

void bench(benchmark::State& state, const Run& run, int D, bool backward) {
  const int docs = static_cast<int>(run.lengths.size());
  std::vector<int32_t> cu(docs + 1, 0);
  int max_len = 0;
  double scores = 0;
  for (int i = 0; i < docs; ++i) {
    const double L = run.lengths[i], P = std::min<double>(run.prefix, L);
    cu[i + 1] = cu[i] + run.lengths[i];
    max_len = std::max(max_len, run.lengths[i]);
    scores += 0.5 * L * L + 0.5 * P * P;
  }
  const int tokens = cu[docs];
  const size_t n = static_cast<size_t>(tokens) * kHeads * D;
  void *q, *k, *v, *out, *dout, *dq, *dk, *dv, *ws = nullptr;
  float* lse;
  int32_t *d_cu, *d_prefix = nullptr;
  for (void** p : {&q, &k, &v, &out, &dout, &dq, &dk, &dv}) KESTREL_CUDA_CHECK(cudaMalloc(p, n * 2));
  KESTREL_CUDA_CHECK(cudaMalloc(&lse, static_cast<size_t>(tokens) * kHeads * sizeof(float)));
  KESTREL_CUDA_CHECK(cudaMalloc(&d_cu, cu.size() * sizeof(int32_t)));
  KESTREL_CUDA_CHECK(cudaMemcpy(d_cu, cu.data(), cu.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
  if (run.prefix > 0) {
    std::vector<int32_t> pre(docs, run.prefix);
    KESTREL_CUDA_CHECK(cudaMalloc(&d_prefix, pre.size() * sizeof(int32_t)));
    KESTREL_CUDA_CHECK(cudaMemcpy(d_prefix, pre.data(), pre.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
  }
  uint32_t seed = 1;
  for (void* p : {q, k, v, dout}) fill_random_bf16<<<1024, 256>>>(static_cast<uint16_t*>(p), n, seed++);
  KESTREL_CUDA_CHECK_LAUNCH();
  FlashAttentionParams p{q,      k,      v,       out,     lse,      d_cu,          d_cu,
                         docs,   max_len, max_len, kHeads, kHeads,   D,             1.f / std::sqrt(float(D)),
                         true,   AttnDType::BF16, tokens, tokens};
  p.prefix_len = d_prefix;
  const size_t ws_bytes = kestrel::cuda::flash_attention_backward_workspace_bytes(p);
  KESTREL_CUDA_CHECK(cudaMalloc(&ws, ws_bytes));
  FlashAttentionBackwardParams bp{p, dout, dq, dk, dv, ws, ws_bytes};
  cudaEvent_t start, stop;
  KESTREL_CUDA_CHECK(cudaEventCreate(&start));
  KESTREL_CUDA_CHECK(cudaEventCreate(&stop));
  auto step = [&] {
    kestrel::cuda::flash_attention_forward(p, nullptr);
    if (backward) kestrel::cuda::flash_attention_backward(bp, nullptr);
  };
  for (int i = 0; i < 3; ++i) step();
  KESTREL_CUDA_CHECK(cudaDeviceSynchronize());
  for (auto _ : state) {
    KESTREL_CUDA_CHECK(cudaEventRecord(start));
    step();
    KESTREL_CUDA_CHECK(cudaEventRecord(stop));
    KESTREL_CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    KESTREL_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    state.SetIterationTime(ms * 1e-3);
  }
  const double flops = 4.0 * scores * D * kHeads * (backward ? 3.5 : 1.0);
  state.counters["TFLOPs"] = benchmark::Counter(flops * 1e-12, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["docs"] = docs;
  state.counters["max_len"] = max_len;
  state.SetLabel(std::string(run.prefix > 0 ? "prefix" : "varlen causal") + (backward ? " fwd+bwd" : " fwd"));
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  for (void* ptr : {q, k, v, out, dout, dq, dk, dv, ws}) cudaFree(ptr);
  cudaFree(lse);
  cudaFree(d_cu);
  if (d_prefix) cudaFree(d_prefix);
}

void BM_flash_attention_prefix(benchmark::State& state) {
  const int T = static_cast<int>(state.range(0));
  Run run{{T, T}, static_cast<int>(state.range(2))};
  bench(state, run, static_cast<int>(state.range(1)), state.range(3) != 0);
}

void BM_flash_attention_varlen(benchmark::State& state) {
  Run run{doc_lengths(static_cast<uint64_t>(state.range(0)), kPackTokens), 0};
  bench(state, run, static_cast<int>(state.range(1)), state.range(2) != 0);
}

void prefix_args(benchmark::internal::Benchmark* bm) {
  for (int bwd : {0, 1})
    for (int d : {64, 128})
      for (int prefix : {1024, 4096}) bm->Args({8192, d, prefix, bwd});
  bm->ArgNames({"T", "D", "prefix", "bwd"});
}

void varlen_args(benchmark::internal::Benchmark* bm) {
  for (int bwd : {0, 1})
    for (int d : {64, 128})
      for (int seed : {1, 2}) bm->Args({seed, d, bwd});
  bm->ArgNames({"seed", "D", "bwd"});
}

BENCHMARK(BM_flash_attention_prefix)->Apply(prefix_args)->UseManualTime()->Unit(benchmark::kMillisecond)->MinTime(0.2);
BENCHMARK(BM_flash_attention_varlen)->Apply(varlen_args)->UseManualTime()->Unit(benchmark::kMillisecond)->MinTime(0.2);

}  // namespace

BENCHMARK_MAIN();
