// Step time of a SigLIP so400m-sized vision tower (models::VisionTower: hidden 1152, MLP 4304, 27
// layers, 16 heads of head dim 72, patch 14, 384 px -> 729 tokens per image, each image one
// bidirectional document) in bf16 on one GPU: forward, and forward + backward of a scalar loss
// (mean of the squared output) into the parameters' gradients, for batches of 384 px images.
// No optimizer step: the tower's share of a VLM step. Counters: images/s and ms per step (wall
// time around the step and a device synchronisation: host overhead included). Attention at head
// dim 72 runs the narrow Hopper kernels (kernel head dim 80; bench_flash_attention's
// BM_flash_attention_so400m times the attention alone, narrow against padded).
//   build-cuda/bench/bench_vision_tower --benchmark_counters_tabular=true
#include <chrono>
#include <cstdint>
#include <string>

#include <benchmark/benchmark.h>
#include <cuda_runtime.h>

#include "kestrel/autograd/grad_mode.h"
#include "kestrel/autograd/tape.h"
#include "kestrel/cuda/check.h"
#include "kestrel/models/config.h"
#include "kestrel/models/vision.h"
#include "kestrel/ops/elementwise.h"
#include "kestrel/ops/reduce.h"
#include "kestrel/runtime/random.h"

namespace {

using kestrel::DType;
using kestrel::Device;
using kestrel::Tensor;

kestrel::models::VisionConfig so400m() {
  kestrel::models::VisionConfig c;
  c.hidden_size = 1152;
  c.intermediate_size = 4304;
  c.num_hidden_layers = 27;
  c.num_attention_heads = 16;
  c.image_size = 384;
  c.patch_size = 14;
  c.validate("so400m");
  return c;
}

// range(0): images per step; range(1): 1 = forward + backward, 0 = forward only (no tape).
void BM_so400m_tower(benchmark::State& state) {
  const int64_t images = state.range(0);
  const bool backward = state.range(1) != 0;
  const kestrel::models::VisionConfig cfg = so400m();
  const Device dev = Device::cuda(0);
  kestrel::models::VisionTower tower(cfg, DType::BF16, dev, /*seed=*/1);
  kestrel::Generator gen(7);
  const Tensor pixels = kestrel::uniform({images, cfg.num_channels, cfg.image_size, cfg.image_size}, -1.0, 1.0,
                                         DType::BF16, dev, gen);
  auto step = [&] {
    if (backward) {
      kestrel::autograd::EnableGradGuard grad;
      const Tensor out = tower.forward(pixels);
      kestrel::autograd::backward(kestrel::mean(kestrel::square(out)));
    } else {
      kestrel::autograd::NoGradGuard no_grad;
      const Tensor out = tower.forward(pixels);
    }
    KESTREL_CUDA_CHECK(cudaDeviceSynchronize());
  };
  for (int i = 0; i < 2; ++i) step();  // warm-up: module load, cuBLASLt plans, allocator pools
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    step();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    state.SetIterationTime(s);
  }
  state.counters["images_per_s"] =
      benchmark::Counter(static_cast<double>(images), benchmark::Counter::kIsIterationInvariantRate);
  // kIsIterationInvariantRate | kInvert: seconds / (value * iterations), so value 1e-3 gives ms per step.
  state.counters["ms_per_step"] =
      benchmark::Counter(1e-3, benchmark::Counter::kIsIterationInvariantRate | benchmark::Counter::kInvert);
  state.counters["tokens"] = static_cast<double>(images * cfg.num_patches());
  state.SetLabel(std::string(backward ? "fwd+bwd" : "fwd") + " so400m 384px bf16");
}

void tower_args(benchmark::internal::Benchmark* bm) {
  for (int bwd : {1, 0})
    for (int images : {8, 22, 32}) bm->Args({images, bwd});
  bm->ArgNames({"images", "bwd"});
}

BENCHMARK(BM_so400m_tower)->Apply(tower_args)->UseManualTime()->Unit(benchmark::kMillisecond)->MinTime(1.0);

}  // namespace

BENCHMARK_MAIN();
