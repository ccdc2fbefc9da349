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
// - BM_flash_attention_blockmask: one document of T tokens, bidirectional, with a random block-sparse
//   2-D mask (kestrel::BlockMask): each 128 x 128 tile pair listed with probability 1/2 (50% density),
//   a listed tile FULL with probability 0.8, else PARTIAL with half its bits set (random). FLOPs count
//   the listed tiles, PARTIAL ones fully (4 * tiles * 128 * 128 * D * H, x3.5 with the backward), so
//   a kernel that skips unlisted tiles shows the dense kernel's TFLOP/s; mask=0 rows are the dense
//   bidirectional kernel (4 * T * T * D * H) in the same run.
// - BM_flash_attention_prefix_bwd_layout: the prefix rows at T 8192, D 128 (prefixes of 1024 and 4096
//   keys), fwd+bwd, once per backward layout (FlashBwdLayout: 1 Plain, 2 Specialised).
// Timed with CUDA events; the TFLOPs counter is what bench/attention_masked_vs_torch.py prints next to
// PyTorch (flex attention for the prefix mask; the varlen and padded SDPA paths for packs).
#include <algorithm>
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
#include "kestrel/ops/attention.h"

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
  bool causal = true;
  const kestrel::BlockMask* mask = nullptr;  // CPU tensors; one document, bidirectional
  kestrel::cuda::FlashBwdLayout layout = kestrel::cuda::FlashBwdLayout::Auto;  // the backward's layout
};

// A random block mask of T x T tokens: tile pairs listed with probability `density`, FULL with
// probability 0.8, else PARTIAL with each bit set with probability 1/2 (64-bit LCG, fixed seed).
kestrel::BlockMask random_block_mask(int T, double density, uint64_t seed) {
  const int64_t B = kestrel::BlockMask::kBlock, nb = (T + B - 1) / B;
  uint64_t x = seed;
  auto next = [&] {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    return x >> 32;
  };
  auto uniform = [&] { return static_cast<double>(next()) / 4294967296.0; };
  std::vector<int32_t> ptr{0}, kblock, kind;
  std::vector<uint32_t> bits;
  for (int64_t qb = 0; qb < nb; ++qb) {
    for (int64_t kb = 0; kb < nb; ++kb) {
      if (uniform() >= density) continue;
      kblock.push_back(static_cast<int32_t>(kb));
      if (uniform() < 0.8) {
        kind.push_back(kestrel::BlockMask::kFull);
        continue;
      }
      kind.push_back(static_cast<int32_t>(bits.size() / (B * 4)));
      for (int64_t r = 0; r < B; ++r)
        for (int w = 0; w < 4; ++w) {
          uint32_t word = static_cast<uint32_t>(next());
          const int64_t valid_rows = std::min<int64_t>(B, T - qb * B), valid_cols = std::min<int64_t>(B, T - kb * B);
          const int64_t cols = std::clamp<int64_t>(valid_cols - 32 * w, 0, 32);
          word &= r >= valid_rows ? 0u : (cols >= 32 ? ~0u : (1u << cols) - 1u);
          bits.push_back(word);
        }
    }
    ptr.push_back(static_cast<int32_t>(kblock.size()));
  }
  return kestrel::make_block_mask(T, T, ptr, kblock, kind, bits);
}

// A host tensor's bytes copied into a fresh device buffer (freed by the caller); nullptr when empty.
template <typename P>
P* device_copy(const kestrel::Tensor& t, std::vector<void*>& owned) {
  if (t.numel() == 0) return nullptr;
  void* d = nullptr;
  KESTREL_CUDA_CHECK(cudaMalloc(&d, t.numel() * 4));
  KESTREL_CUDA_CHECK(cudaMemcpy(d, t.data_ptr(), t.numel() * 4, cudaMemcpyHostToDevice));
  owned.push_back(d);
  return static_cast<P*>(d);
}

void bench(benchmark::State& state, const Run& run, int D, bool backward) {
  const int docs = static_cast<int>(run.lengths.size());
  std::vector<int32_t> cu(docs + 1, 0);
  int max_len = 0;
  double scores = 0;
  for (int i = 0; i < docs; ++i) {
    const double L = run.lengths[i], P = std::min<double>(run.prefix, L);
    cu[i + 1] = cu[i] + run.lengths[i];
    max_len = std::max(max_len, run.lengths[i]);
    scores += run.causal ? 0.5 * L * L + 0.5 * P * P : L * L;
  }
  if (run.mask) scores = static_cast<double>(run.mask->nnz()) * kestrel::BlockMask::kBlock * kestrel::BlockMask::kBlock;
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
                         run.causal, AttnDType::BF16, tokens, tokens};
  p.prefix_len = d_prefix;
  p.bwd_layout = run.layout;
  std::vector<void*> mask_buffers;
  kestrel::cuda::FlashBlockMask dmask;
  if (run.mask) {
    const kestrel::BlockMask& m = *run.mask;
    dmask.q_ptr = device_copy<const int32_t>(m.q_ptr, mask_buffers);
    dmask.q_kblock = device_copy<const int32_t>(m.q_kblock, mask_buffers);
    dmask.q_kind = device_copy<const int32_t>(m.q_kind, mask_buffers);
    dmask.k_ptr = device_copy<const int32_t>(m.k_ptr, mask_buffers);
    dmask.k_qblock = device_copy<const int32_t>(m.k_qblock, mask_buffers);
    dmask.k_kind = device_copy<const int32_t>(m.k_kind, mask_buffers);
    dmask.bits = device_copy<const uint32_t>(m.bits, mask_buffers);
    dmask.bits_t = device_copy<const uint32_t>(m.bits_t, mask_buffers);
    p.block_mask = &dmask;
  }
  // Every row carries the same counters (0 without a mask): Google Benchmark's CSV reporter aborts on a
  // counter that the first row of the run lacked.
  state.counters["tiles"] = run.mask ? static_cast<double>(run.mask->nnz()) : 0.0;
  state.counters["partial"] = run.mask ? static_cast<double>(run.mask->partials()) : 0.0;
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
  const char* what = run.mask ? "block mask" : !run.causal ? "dense bidirectional" : run.prefix > 0 ? "prefix" : "varlen causal";
  state.SetLabel(std::string(what) + (backward ? " fwd+bwd" : " fwd") +
                 (run.layout == kestrel::cuda::FlashBwdLayout::Plain         ? " plain"
                  : run.layout == kestrel::cuda::FlashBwdLayout::Specialised ? " specialised"
                                                                             : ""));
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  for (void* ptr : {q, k, v, out, dout, dq, dk, dv, ws}) cudaFree(ptr);
  cudaFree(lse);
  cudaFree(d_cu);
  if (d_prefix) cudaFree(d_prefix);
  for (void* ptr : mask_buffers) cudaFree(ptr);
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

// range(2) = 1: the random 50% block mask; 0: the dense bidirectional kernel on the same shape.
void BM_flash_attention_blockmask(benchmark::State& state) {
  const int T = static_cast<int>(state.range(0));
  Run run{{T}, 0, false};
  kestrel::BlockMask mask;
  if (state.range(2) != 0) {
    mask = random_block_mask(T, 0.5, 7);
    run.mask = &mask;
  }
  bench(state, run, static_cast<int>(state.range(1)), state.range(3) != 0);
}

// The two backward layouts on BM_flash_attention_prefix's rows, fwd+bwd (layout 1 Plain, 2 Specialised).
void BM_flash_attention_prefix_bwd_layout(benchmark::State& state) {
  const int T = static_cast<int>(state.range(0));
  Run run{{T, T}, static_cast<int>(state.range(2))};
  run.layout = static_cast<kestrel::cuda::FlashBwdLayout>(state.range(3));
  bench(state, run, static_cast<int>(state.range(1)), true);
}

void blockmask_args(benchmark::internal::Benchmark* bm) {
  for (int bwd : {0, 1})
    for (int d : {64, 128})
      for (int T : {8192, 16384})
        for (int masked : {0, 1}) bm->Args({T, d, masked, bwd});
  bm->ArgNames({"T", "D", "mask", "bwd"});
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
BENCHMARK(BM_flash_attention_blockmask)->Apply(blockmask_args)->UseManualTime()->Unit(benchmark::kMillisecond)->MinTime(0.2);
void prefix_layout_args(benchmark::internal::Benchmark* bm) {
  for (int prefix : {1024, 4096})
    for (int layout : {1, 2}) bm->Args({8192, 128, prefix, layout});
  bm->ArgNames({"T", "D", "prefix", "layout"});
}
BENCHMARK(BM_flash_attention_prefix_bwd_layout)
    ->Apply(prefix_layout_args)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->MinTime(0.2);
BENCHMARK(BM_flash_attention_varlen)->Apply(varlen_args)->UseManualTime()->Unit(benchmark::kMillisecond)->MinTime(0.2);

}  // namespace

BENCHMARK_MAIN();
