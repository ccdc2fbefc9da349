// Flash attention throughput (bf16, H200): 16384 tokens packed as 16384/T documents of length T,
// 32 query heads (= KV heads), T in {1k..16k}, D in {64, 72, 128}, causal and bidirectional, forward
// and forward+backward. FLOPs are counted as FlashAttention does: forward 4*T*T*D*H per document
// (halved when causal), backward 2.5x forward. Timed with CUDA events (manual time); the
// TFLOP/s counter is what bench/attention_vs_torch.py puts beside PyTorch's FA2 and cuDNN.
// The kernels are the library's choice (FlashAttentionParams::kernel = Auto); A/B runs compare builds.
// BM_flash_attention_deterministic: the same fwd+bwd with FlashAttentionParams::deterministic (the
// fixed-order dq sum), causal, D 64/128, T 4k-16k: its cost against BM_flash_attention's bwd:1 rows.
// BM_flash_attention_window: causal with a sliding window W (16384 tokens as one document and as
// 4k documents, W in {256..4096}); its FLOPs count only the visible area (W*T - W(W-1)/2 scores
// per document), so a kernel that skips the tiles outside the window shows about the TFLOP/s of
// full causal at the same T, and one that merely masked them would fall by T/W.
// D 72 (SigLIP so400m's head dim) runs the narrow Hopper kernels (kernel head dim 80); its FLOPs are
// counted at D = 72, not at the kernel's width. BM_flash_attention_padded: the same D-72 rows on
// FlashKernel::HopperPadded (the 128 kernels, the path before the narrow ones), T 8k. BM_flash_attention_so400m:
// the so400m vision tower's attention, 22 images of 729 tokens (16038 tokens), 16 heads of 72,
// bidirectional, fwd and fwd+bwd, narrow (padded:0) and padded (padded:1).
// BM_cudnn_attention: BM_flash_attention's rows (same shapes, same FLOP count) on cuDNN's fused flash
// attention (AttentionBackend::Cudnn through the attention kernel slots: cached plan, workspace from
// the caching allocator, metadata kernel included), so one binary measures both backends; the Auto
// rule in ops/cuda/attention_backend.cpp is written from these two tables.
// BM_attention_backends_step_packs: the 1.5B training step's attention replayed: 9 packs of 8192
// tokens, each 2-5 documents of 1024-8192 tokens (8 long-tailed from a fixed seed, then B 2 / S 6144,
// the bucket seen in the slow step), GQA 32/8, causal,
// fwd+bwd of every pack per iteration (so several plan buckets), Kestrel and cuDNN (with the plan
// choice First or Fastest). After the timing each pack's fwd and bwd are timed alone, and for cuDNN
// the plans built are printed (engines considered, their times, the one chosen), all to stderr.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <iterator>
#include <set>
#include <cstring>
#include <cstdio>
#include <string>
#include <vector>

#include <benchmark/benchmark.h>
#include <cuda_runtime.h>

#include "bench_common.cuh"
#include "cuda/attention_backend.h"
#include "cuda/flash_attention/flash_attention.h"
#include "kernels/attention.h"
#include "kestrel/cuda/check.h"
#include "kestrel/cuda/context.h"
#include "kestrel/ops/attention.h"
#include "kestrel/runtime/error.h"
#include "kestrel/runtime/tensor.h"

namespace {

using kestrel::cuda::AttnDType;
using kestrel::cuda::FlashAttentionBackwardParams;
using kestrel::cuda::FlashAttentionParams;
using kestrel::cuda::FlashBwdLayout;
using kestrel::cuda::FlashKernel;

constexpr int kTokens = 16384;
constexpr int kHeads = 32;

using kestrel::bench::fill_random_bf16;

struct Buffers {
  void *q, *k, *v, *out, *dout, *dq, *dk, *dv, *ws;
  float* lse;
  int32_t* cu;
  size_t ws_bytes;
};

// Documents of length T (kTokens / T of them unless docs > 0), heads query = KV heads.
void bench_attention(benchmark::State& state, int T, int D, bool causal, int window, bool backward,
                     bool deterministic = false, FlashKernel kernel = FlashKernel::Auto, int docs = 0,
                     int heads = kHeads, FlashBwdLayout layout = FlashBwdLayout::Auto) {
  if (docs == 0) docs = kTokens / T;
  const int tokens = docs * T;
  const size_t n = static_cast<size_t>(tokens) * heads * D;
  Buffers b{};
  for (void** p : {&b.q, &b.k, &b.v, &b.out, &b.dout, &b.dq, &b.dk, &b.dv})
    KESTREL_CUDA_CHECK(cudaMalloc(p, n * 2));
  KESTREL_CUDA_CHECK(cudaMalloc(&b.lse, static_cast<size_t>(tokens) * heads * sizeof(float)));
  std::vector<int32_t> cu(docs + 1);
  for (int i = 0; i <= docs; ++i) cu[i] = i * T;
  KESTREL_CUDA_CHECK(cudaMalloc(&b.cu, cu.size() * sizeof(int32_t)));
  KESTREL_CUDA_CHECK(cudaMemcpy(b.cu, cu.data(), cu.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
  uint32_t seed = 1;
  for (void* p : {b.q, b.k, b.v, b.dout}) fill_random_bf16<<<1024, 256>>>(static_cast<uint16_t*>(p), n, seed++);
  KESTREL_CUDA_CHECK_LAUNCH();

  FlashAttentionParams p{b.q, b.k, b.v, b.out, b.lse, b.cu, b.cu, docs, T, T, heads, heads, D,
                         1.f / std::sqrt(static_cast<float>(D)), causal, AttnDType::BF16, tokens, tokens};
  p.window = window;
  p.kernel = kernel;
  p.deterministic = deterministic;
  p.bwd_layout = layout;
  b.ws_bytes = kestrel::cuda::flash_attention_backward_workspace_bytes(p);
  KESTREL_CUDA_CHECK(cudaMalloc(&b.ws, b.ws_bytes));
  FlashAttentionBackwardParams bp{p, b.dout, b.dq, b.dk, b.dv, b.ws, b.ws_bytes};

  auto step = [&] {
    kestrel::cuda::flash_attention_forward(p, nullptr);
    if (backward) kestrel::cuda::flash_attention_backward(bp, nullptr);
  };
  kestrel::bench::time_with_events(state, step, nullptr, 3);  // warm-up: module load, smem attribute
  // Scores computed per document: T*T, causal T*T/2 (FlashAttention's count), windowed the visible area.
  const double w = window;
  const double scores = !causal ? 1.0 * T * T : window > 0 && window < T ? w * T - w * (w - 1) / 2 : 0.5 * T * T;
  const double fwd_flops = 4.0 * scores * D * heads * docs;
  const double flops = fwd_flops * (backward ? 3.5 : 1.0);
  state.counters["TFLOPs"] = benchmark::Counter(flops * 1e-12, benchmark::Counter::kIsIterationInvariantRate);
  state.SetLabel(std::string(causal ? "causal" : "bidir") + (window > 0 ? " window=" + std::to_string(window) : "") +
                 (backward ? " fwd+bwd" : " fwd") + (deterministic ? " deterministic" : "") +
                 (kernel == FlashKernel::HopperPadded ? " padded" : "") +
                 (layout == FlashBwdLayout::Plain         ? " plain"
                  : layout == FlashBwdLayout::Specialised ? " specialised"
                                                          : ""));
  for (void* ptr : {b.q, b.k, b.v, b.out, b.dout, b.dq, b.dk, b.dv, b.ws}) cudaFree(ptr);
  cudaFree(b.lse);
  cudaFree(b.cu);
}

void BM_flash_attention(benchmark::State& state) {
  bench_attention(state, static_cast<int>(state.range(0)), static_cast<int>(state.range(1)), state.range(2) != 0, 0,
                  state.range(3) != 0);
}

void BM_flash_attention_window(benchmark::State& state) {
  bench_attention(state, static_cast<int>(state.range(0)), static_cast<int>(state.range(1)), true,
                  static_cast<int>(state.range(2)), state.range(3) != 0);
}

// The two backward layouts side by side in one binary (layout 1 Plain, 2 Specialised).
void BM_flash_attention_bwd_layout(benchmark::State& state) {
  bench_attention(state, static_cast<int>(state.range(0)), static_cast<int>(state.range(1)), state.range(2) != 0, 0,
                  true, false, FlashKernel::Auto, 0, kHeads, static_cast<FlashBwdLayout>(state.range(3)));
}

void BM_flash_attention_deterministic(benchmark::State& state) {
  bench_attention(state, static_cast<int>(state.range(0)), static_cast<int>(state.range(1)), true, 0, true, true);
}

void BM_flash_attention_padded(benchmark::State& state) {
  bench_attention(state, static_cast<int>(state.range(0)), static_cast<int>(state.range(1)), state.range(2) != 0, 0,
                  state.range(3) != 0, false, FlashKernel::HopperPadded);
}

void BM_flash_attention_so400m(benchmark::State& state) {
  bench_attention(state, 729, 72, false, 0, state.range(0) != 0, false,
                  state.range(1) ? FlashKernel::HopperPadded : FlashKernel::Auto, 22, 16);
}

// The same documents through the Tensor-level slots on the cuDNN backend (or, for the step-shape
// rows, either backend through the same slots). kv_heads < kHeads: GQA. mix: one 8192-token pack of
// documents with the long-tailed lengths kStepMix (a training step's packed sequence) instead of
// kTokens / T documents of length T.
constexpr int kStepMix[] = {3072, 2048, 1280, 768, 512, 256, 128, 96, 32};
void bench_cudnn_attention(benchmark::State& state, int T, int D, bool causal, bool backward, int kv_heads = kHeads,
                           kestrel::AttentionBackend backend = kestrel::AttentionBackend::Cudnn, bool mix = false) {
  using namespace kestrel;
  std::vector<int> lengths = mix ? std::vector<int>(std::begin(kStepMix), std::end(kStepMix))
                                 : std::vector<int>(kTokens / T, T);
  const int docs = static_cast<int>(lengths.size());
  int tokens = 0, longest = 0;
  double scores = 0;
  for (int len : lengths) {
    tokens += len;
    longest = std::max(longest, len);
    scores += causal ? 0.5 * len * len : 1.0 * len * len;
  }
  const Device dev = Device::cuda(0);
  cudaStream_t stream = cuda::current_stream();
  uint32_t seed = 1;
  auto random = [&](int64_t heads) {
    Tensor t = Tensor::empty({tokens, heads, D}, DType::BF16, dev);
    fill_random_bf16<<<1024, 256, 0, stream>>>(t.data<uint16_t>(), static_cast<size_t>(t.numel()), seed++);
    KESTREL_CUDA_CHECK_LAUNCH();
    return t;
  };
  const Tensor q = random(kHeads), k = random(kv_heads), v = random(kv_heads), dout = random(kHeads);
  const Tensor out = Tensor::empty(q.shape(), DType::BF16, dev), lse = Tensor::empty({tokens, kHeads}, DType::F32, dev);
  const Tensor dq = Tensor::empty(q.shape(), DType::BF16, dev), dk = Tensor::empty(k.shape(), DType::BF16, dev),
               dv = Tensor::empty(v.shape(), DType::BF16, dev);
  std::vector<int64_t> cu(docs + 1, 0);
  for (int i = 0; i < docs; ++i) cu[i + 1] = cu[i] + lengths[i];
  const Tensor cu_seqlens = Tensor::from_vector(cu, {docs + 1}, DType::I32).to(dev);
  kernels::AttentionParams p;
  p.max_seqlen_q = p.max_seqlen_k = longest;
  p.softmax_scale = 1.0 / std::sqrt(static_cast<double>(D));
  p.causal = causal;
  p.backend = backend;
  auto step = [&] {
    kernels::dispatch(kernels::attention_forward, "attention", dev, out, lse, q, k, v, cu_seqlens, cu_seqlens, p);
    if (backward)
      kernels::dispatch(kernels::attention_backward, "attention_backward", dev, dq, dk, dv, dout, q, k, v, out, lse,
                        cu_seqlens, cu_seqlens, p);
  };
  try {
    kestrel::bench::time_with_events(state, step, stream, 3);  // warm-up: plan build, module load
  } catch (const Error& e) {
    state.SkipWithError(e.what());
    return;
  }
  const double flops = 4.0 * scores * D * kHeads * (backward ? 3.5 : 1.0);
  state.counters["TFLOPs"] = benchmark::Counter(flops * 1e-12, benchmark::Counter::kIsIterationInvariantRate);
  state.SetLabel(std::string(backend == AttentionBackend::Cudnn ? "cudnn " : "kestrel ") + (causal ? "causal" : "bidir") +
                 (backward ? " fwd+bwd" : " fwd") + (kv_heads != kHeads ? " gqa" : "") + (mix ? " step mix" : ""));
}

// The training step's shapes through the op slots, both backends: 32 query heads, KV heads 32 or 8,
// one 8k sequence (T 8192) or the step's document mix, causal, fwd+bwd.
void BM_attention_backends(benchmark::State& state) {
  const auto backend = state.range(3) ? kestrel::AttentionBackend::Cudnn : kestrel::AttentionBackend::Kestrel;
  bench_cudnn_attention(state, 8192, static_cast<int>(state.range(0)), true, true, static_cast<int>(state.range(1)),
                        backend, state.range(2) != 0);
}

// A training step's packs: kPackTokens tokens split into 2-5 documents of at least kMinDoc tokens,
// the split long-tailed (each document's share of what is left above kMinDoc drawn log-uniformly over
// a factor of 16), from a fixed-seed xorshift so every build replays the same packs.
constexpr int kPackTokens = 8192, kMinDoc = 1024, kPacks = 8;
std::vector<std::vector<int>> step_packs() {
  uint64_t x = 0x9E3779B97F4A7C15ull;
  auto uniform = [&] {  // [0, 1)
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    return static_cast<double>(x >> 11) / 9007199254740992.0;
  };
  std::vector<std::vector<int>> packs;
  for (int i = 0; i < kPacks; ++i) {
    const int docs = 2 + static_cast<int>(uniform() * 4);  // 2..5
    std::vector<double> w(docs);
    double sum = 0;
    for (double& v : w) sum += v = std::exp(uniform() * std::log(16.0));
    std::vector<int> lens(docs);
    int used = 0;
    for (int d = 0; d < docs; ++d) {
      lens[d] = d + 1 < docs ? kMinDoc + static_cast<int>((kPackTokens - docs * kMinDoc) * w[d] / sum)
                             : kPackTokens - used;
      used += lens[d];
    }
    packs.push_back(lens);
  }
  packs.push_back({6000, 2192});  // the bucket cuDNN's API log showed in the slow step: B 2, S 6144
  return packs;
}

void print_cudnn_plans(size_t from, const char* what) {
  const auto log = kestrel::cuda_ops::cudnn_attention_plan_log(0);
  if (log.size() <= from) return;
  std::fprintf(stderr, "[%s] cuDNN plans built:\n%s", what,
               kestrel::cuda_ops::format_cudnn_plan_log({log.begin() + static_cast<std::ptrdiff_t>(from), log.end()})
                   .c_str());
}

// One iteration: fwd + bwd of every pack (q/k/v/dout shared, each pack its own cu_seqlens and
// max_seqlen); FLOPs over the causal visible area of each document (len^2 / 2), fwd x 3.5.
void BM_attention_backends_step_packs(benchmark::State& state) {
  using namespace kestrel;
  const int D = static_cast<int>(state.range(0));
  const bool cudnn = state.range(1) != 0;
  const auto choice = state.range(2) ? cuda_ops::CudnnPlanChoice::Fastest : cuda_ops::CudnnPlanChoice::First;
  const int kv_heads = 8;
  const std::vector<std::vector<int>> packs = step_packs();
  const Device dev = Device::cuda(0);
  cudaStream_t stream = cuda::current_stream();
  uint32_t seed = 1;
  auto random = [&](int64_t heads) {
    Tensor t = Tensor::empty({kPackTokens, heads, D}, DType::BF16, dev);
    fill_random_bf16<<<1024, 256, 0, stream>>>(t.data<uint16_t>(), static_cast<size_t>(t.numel()), seed++);
    KESTREL_CUDA_CHECK_LAUNCH();
    return t;
  };
  const Tensor q = random(kHeads), k = random(kv_heads), v = random(kv_heads), dout = random(kHeads);
  const Tensor out = Tensor::empty(q.shape(), DType::BF16, dev),
               lse = Tensor::empty({kPackTokens, kHeads}, DType::F32, dev);
  const Tensor dq = Tensor::empty(q.shape(), DType::BF16, dev), dk = Tensor::empty(k.shape(), DType::BF16, dev),
               dv = Tensor::empty(v.shape(), DType::BF16, dev);
  std::vector<Tensor> cus;
  std::vector<kernels::AttentionParams> params;
  std::vector<double> pack_flops;
  double flops = 0;
  for (const auto& lens : packs) {
    std::vector<int64_t> cu(lens.size() + 1, 0);
    int longest = 0;
    double scores = 0;
    for (size_t i = 0; i < lens.size(); ++i) {
      cu[i + 1] = cu[i] + lens[i];
      longest = std::max(longest, lens[i]);
      scores += 0.5 * lens[i] * lens[i];
    }
    cus.push_back(Tensor::from_vector(cu, {static_cast<int64_t>(cu.size())}, DType::I32).to(dev));
    kernels::AttentionParams p;
    p.max_seqlen_q = p.max_seqlen_k = longest;
    p.softmax_scale = 1.0 / std::sqrt(static_cast<double>(D));
    p.causal = true;
    p.backend = cudnn ? AttentionBackend::Cudnn : AttentionBackend::Kestrel;
    params.push_back(p);
    pack_flops.push_back(4.0 * scores * D * kHeads);
    flops += 4.0 * scores * D * kHeads * 3.5;
  }
  auto fwd = [&](size_t i) {
    kernels::dispatch(kernels::attention_forward, "attention", dev, out, lse, q, k, v, cus[i], cus[i], params[i]);
  };
  auto bwd = [&](size_t i) {
    kernels::dispatch(kernels::attention_backward, "attention_backward", dev, dq, dk, dv, dout, q, k, v, out, lse,
                      cus[i], cus[i], params[i]);
  };
  auto step = [&] {
    for (size_t i = 0; i < packs.size(); ++i) {
      fwd(i);
      bwd(i);
    }
  };
  const cuda_ops::CudnnPlanChoice saved = cuda_ops::cudnn_plan_choice();
  cuda_ops::set_cudnn_plan_choice(choice);
  const size_t log_from = cuda_ops::cudnn_attention_plan_log(0).size();
  const std::string name =
      (cudnn ? std::string("cudnn ") + cuda_ops::cudnn_plan_choice_name(choice) : std::string("kestrel")) + " D " +
      std::to_string(D);
  static std::set<std::string> printed;  // google-benchmark reruns a case while it sizes the iterations
  const bool print = printed.insert(name).second;
  try {
    kestrel::bench::time_with_events(state, step, stream, 2);  // warm-up: plan builds (and timing), module load
    if (print) {  // each pack alone (mean of 3), fwd and bwd separately: which bucket is slow, if one is
      cudaEvent_t e[3];
      for (cudaEvent_t& ev : e) KESTREL_CUDA_CHECK(cudaEventCreate(&ev));
      for (size_t i = 0; i < packs.size(); ++i) {
        KESTREL_CUDA_CHECK(cudaEventRecord(e[0], stream));
        for (int r = 0; r < 3; ++r) fwd(i);
        KESTREL_CUDA_CHECK(cudaEventRecord(e[1], stream));
        for (int r = 0; r < 3; ++r) bwd(i);
        KESTREL_CUDA_CHECK(cudaEventRecord(e[2], stream));
        KESTREL_CUDA_CHECK(cudaEventSynchronize(e[2]));
        float f_ms = 0, b_ms = 0;
        KESTREL_CUDA_CHECK(cudaEventElapsedTime(&f_ms, e[0], e[1]));
        KESTREL_CUDA_CHECK(cudaEventElapsedTime(&b_ms, e[1], e[2]));
        f_ms /= 3, b_ms /= 3;
        std::string lens;
        for (size_t j = 0; j < packs[i].size(); ++j) lens += (j ? "," : "") + std::to_string(packs[i][j]);
        std::fprintf(stderr, "[%s] pack %zu [%s] max %lld: fwd %.3f ms (%.0f TFLOP/s) bwd %.3f ms (%.0f TFLOP/s)\n",
                     name.c_str(), i, lens.c_str(), static_cast<long long>(params[i].max_seqlen_q), f_ms,
                     pack_flops[i] / (f_ms * 1e-3) * 1e-12, b_ms, 2.5 * pack_flops[i] / (b_ms * 1e-3) * 1e-12);
      }
      for (cudaEvent_t& ev : e) cudaEventDestroy(ev);
    }
  } catch (const Error& err) {
    cuda_ops::set_cudnn_plan_choice(saved);
    state.SkipWithError(err.what());
    return;
  }
  cuda_ops::set_cudnn_plan_choice(saved);
  if (cudnn) print_cudnn_plans(log_from, name.c_str());  // only the run that built them has any
  state.counters["TFLOPs"] = benchmark::Counter(flops * 1e-12, benchmark::Counter::kIsIterationInvariantRate);
  state.SetLabel(name + " gqa causal fwd+bwd, " + std::to_string(packs.size()) + " packs");
}

void BM_cudnn_attention(benchmark::State& state) {
  bench_cudnn_attention(state, static_cast<int>(state.range(0)), static_cast<int>(state.range(1)),
                        state.range(2) != 0, state.range(3) != 0);
}

void args(benchmark::internal::Benchmark* bm) {
  for (int bwd : {0, 1})
    for (int causal : {1, 0})
      for (int d : {64, 72, 128})
        for (int t : {1024, 2048, 4096, 8192, 16384}) bm->Args({t, d, causal, bwd});
  bm->ArgNames({"T", "D", "causal", "bwd"});
}

void window_args(benchmark::internal::Benchmark* bm) {
  for (int bwd : {0, 1})
    for (int d : {64, 128})
      for (int t : {4096, 16384})
        for (int w : {256, 1024, 4096}) bm->Args({t, d, w, bwd});
  bm->ArgNames({"T", "D", "window", "bwd"});
}

BENCHMARK(BM_flash_attention)->Apply(args)->UseManualTime()->Unit(benchmark::kMillisecond)->MinTime(0.2);
BENCHMARK(BM_cudnn_attention)->Apply(args)->UseManualTime()->Unit(benchmark::kMillisecond)->MinTime(0.2);
void backend_args(benchmark::internal::Benchmark* bm) {
  for (int mix : {0, 1})
    for (int d : {64, 128})
      for (int kv : {32, 8})
        for (int cudnn : {0, 1}) bm->Args({d, kv, mix, cudnn});
  bm->ArgNames({"D", "kv_heads", "step_mix", "cudnn"});
}
BENCHMARK(BM_attention_backends)->Apply(backend_args)->UseManualTime()->Unit(benchmark::kMillisecond)->MinTime(0.2);
void step_pack_args(benchmark::internal::Benchmark* bm) {
  for (int d : {64, 128}) {
    bm->Args({d, 0, 0});
    for (int fastest : {0, 1}) bm->Args({d, 1, fastest});
  }
  bm->ArgNames({"D", "cudnn", "fastest"});
}
BENCHMARK(BM_attention_backends_step_packs)
    ->Apply(step_pack_args)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->MinTime(0.2);
void deterministic_args(benchmark::internal::Benchmark* bm) {
  for (int d : {64, 128})
    for (int t : {4096, 8192, 16384}) bm->Args({t, d});
  bm->ArgNames({"T", "D"});
}

void bwd_layout_args(benchmark::internal::Benchmark* bm) {
  for (int causal : {1, 0})
    for (int d : {72, 96, 112, 128})
      for (int t : {4096, 8192, 16384})
        for (int layout : {1, 2}) bm->Args({t, d, causal, layout});
  bm->ArgNames({"T", "D", "causal", "layout"});
}
BENCHMARK(BM_flash_attention_bwd_layout)->Apply(bwd_layout_args)->UseManualTime()->Unit(benchmark::kMillisecond)->MinTime(0.2);
BENCHMARK(BM_flash_attention_deterministic)->Apply(deterministic_args)->UseManualTime()->Unit(benchmark::kMillisecond)->MinTime(0.2);
BENCHMARK(BM_flash_attention_window)->Apply(window_args)->UseManualTime()->Unit(benchmark::kMillisecond)->MinTime(0.2);

void padded_args(benchmark::internal::Benchmark* bm) {
  for (int bwd : {0, 1})
    for (int causal : {1, 0}) bm->Args({8192, 72, causal, bwd});
  bm->ArgNames({"T", "D", "causal", "bwd"});
}
void so400m_args(benchmark::internal::Benchmark* bm) {
  for (int bwd : {0, 1})
    for (int padded : {0, 1}) bm->Args({bwd, padded});
  bm->ArgNames({"bwd", "padded"});
}
BENCHMARK(BM_flash_attention_padded)->Apply(padded_args)->UseManualTime()->Unit(benchmark::kMillisecond)->MinTime(0.2);
BENCHMARK(BM_flash_attention_so400m)->Apply(so400m_args)->UseManualTime()->Unit(benchmark::kMillisecond)->MinTime(0.2);

}  // namespace

BENCHMARK_MAIN();
