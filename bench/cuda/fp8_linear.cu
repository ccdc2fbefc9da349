// FP8 vs bf16 linear layers at the 1.5B decoder's shapes (issue 23): T = 8192 tokens, (K, N) =
// (2048, 2048) q/o, (2048, 512) k/v, (2048, 8192) gate/up, (8192, 2048) down. Timed with CUDA events
// on the compute stream (manual time).
//   BM_linear_bf16 / BM_linear_fp8: forward + backward (dgrad and wgrad) through the tape, 6 T K N
//     FLOP; the FP8 figure includes its casts (x, W, dy; W^T again in backward) and the amax folds.
//   BM_gemm_fp8: the forward GEMM alone (2 T K N FLOP), e4m3 x e4m3, fast accumulation: the ceiling
//     the casts eat into. BM_gemm_bf16 is the same GEMM in bf16 (kestrel's matmul: cuBLASLt).
//   BM_cast_fp8: x [T, K] bf16 -> plain + transposed e4m3 (GB/s: 2 bytes read + 2 written per element).
//   BM_copy: a device copy of [T, K] bf16 (2 bytes read + 2 written per element): the HBM ceiling.
//   SwiGLU with linear_fp8's input cast (kestrel/ops/fp8_producers.h) as two passes (swiglu, then
//   fp8_input_cast: BM_swiglu_cast) and fused (swiglu_fp8: BM_swiglu_fp8), X8 and X8T written, under
//   no-grad (the op alone): gate, up [T, I] -> y, codes; GB/s over 8 bytes per element (4 read, 4
//   written). Both rows count the fused pass's bytes, so their GB/s compare directly (the two-pass
//   version moves 2 bytes per element more, reading y back for the cast, and launches twice). (The
//   norms' producers are the plain op and the cast since their fused kernels measured slower:
//   bench/notes/step_profile.md, "FP8 casts".)
//   The MLP's gate/up projections and SwiGLU, forward + backward through the tape (seeded): the separate
//   entries (linear_fp8 over {gate, up}, then swiglu_fp8; SwiGLU's backward writes bf16 dgate/dup, then
//   two standalone casts: BM_gate_up_separate) against swiglu_gate_up_fp8 (its backward kernel writes
//   the gradients' casts directly: BM_gate_up_combined); (C, I) the 1.5B and the 9B MLP; TFLOP/s over
//   the six GEMM passes (2 x 6 T C I FLOP).
// Counters: TFLOP/s (GEMMs, linears) and GB/s (casts, copies, SwiGLU). The scales are seeded (one
// roll) so the timed path is the delayed one (no amax pre-pass; the fused SwiGLU needs it).
#include <benchmark/benchmark.h>

#include <functional>
#include <vector>

#include "bench_common.cuh"
#include "kestrel/autograd/grad_mode.h"
#include "kestrel/autograd/tape.h"
#include "kestrel/cuda/check.h"
#include "kestrel/cuda/context.h"
#include "kestrel/ops/activation.h"
#include "kestrel/ops/fp8.h"
#include "kestrel/ops/fp8_producers.h"
#include "kestrel/ops/matmul.h"
#include "kestrel/runtime/random.h"

namespace kestrel {
namespace {

const Device kGpu = Device::cuda(0);
constexpr int64_t kTokens = 8192;

// Times fn on the compute stream after two warm-up calls (bench_common.cuh); counters from the mean.
void time_loop(benchmark::State& state, const std::function<void()>& fn, double flops, double bytes = 0) {
  const double per = bench::time_with_events(state, fn, cuda::current_stream(), 2);  // seconds
  if (flops > 0) state.counters["TFLOP/s"] = flops / per / 1e12;
  if (bytes > 0) state.counters["GB/s"] = bytes / per / 1e9;
}

Tensor rnd(const Shape& s, double std = 1.0) { return normal(s, 0.0, std, DType::BF16, kGpu); }

// A state whose scales come from one step of these tensors (the delayed path).
Fp8State seeded_state(const Tensor& x, const Tensor& w, const Tensor& dy) {
  Fp8State st(1, Fp8Recipe{}, kGpu);
  Tensor xl = x.detach().clone().set_requires_grad(true), wl = w.detach().clone().set_requires_grad(true);
  autograd::backward({linear_fp8(xl, wl, Tensor(), st, 0)}, {dy});
  st.roll();
  return st;
}

void run_linear(benchmark::State& state, bool fp8) {
  const int64_t K = state.range(0), N = state.range(1);
  Tensor x = rnd({kTokens, K}), w = rnd({N, K}, 0.02), dy = rnd({kTokens, N}, 1e-3);
  Fp8State st = seeded_state(x, w, dy);
  x.set_requires_grad(true);
  w.set_requires_grad(true);
  time_loop(state, [&] {
    Tensor y = fp8 ? linear_fp8(x, w, Tensor(), st, 0) : linear(x, w);
    autograd::backward({y}, {dy});
    x.zero_grad();
    w.zero_grad();
  }, 6.0 * kTokens * K * N);
}
void BM_linear_bf16(benchmark::State& state) { run_linear(state, false); }
void BM_linear_fp8(benchmark::State& state) { run_linear(state, true); }

void BM_gemm_fp8(benchmark::State& state) {
  const int64_t K = state.range(0), N = state.range(1);
  Tensor one = Tensor::full({1}, 1.0, DType::F32, kGpu);
  Fp8Tensor a = fp8_cast(rnd({kTokens, K}), one, Fp8Format::E4M3, true, false).plain;
  Fp8Tensor b = fp8_cast(rnd({N, K}), one, Fp8Format::E4M3, true, false).plain;
  time_loop(state, [&] { (void)fp8_gemm(a, b, DType::BF16, true); }, 2.0 * kTokens * K * N);
}
void BM_gemm_bf16(benchmark::State& state) {
  const int64_t K = state.range(0), N = state.range(1);
  Tensor a = rnd({kTokens, K}), b = rnd({N, K});
  time_loop(state, [&] { (void)matmul(a, b, false, true); }, 2.0 * kTokens * K * N);
}

void BM_cast_fp8(benchmark::State& state) {
  const int64_t K = state.range(0);
  Tensor x = rnd({kTokens, K});
  Tensor scale = Tensor::full({1}, 8.0, DType::F32, kGpu), amax = Tensor::zeros({1}, DType::F32, kGpu);
  time_loop(state, [&] { (void)fp8_cast(x, scale, Fp8Format::E4M3, true, true, amax); }, 0,
            static_cast<double>(kTokens * K) * 4.0);
}

void BM_copy(benchmark::State& state) {
  const int64_t K = state.range(0);
  Tensor x = rnd({kTokens, K}), y = Tensor::empty({kTokens, K}, DType::BF16, kGpu);
  time_loop(state, [&] { y.copy_(x); }, 0, static_cast<double>(kTokens * K) * 4.0);
}

// One linear's seeded state (input scale 112: e4m3's max at |y| = 4).
Fp8State producer_state() {
  Fp8State st(1, Fp8Recipe{}, kGpu);
  st.load(Tensor::full({3, Fp8Recipe{}.amax_history}, 4.0), Tensor::full({3}, 112.0), 1);
  return st;
}

void run_swiglu(benchmark::State& state, bool fused) {
  const int64_t C = state.range(0);
  Tensor gate = rnd({kTokens, C}), up = rnd({kTokens, C});
  Fp8State st = producer_state();
  autograd::NoGradGuard no_grad;  // the op alone, no tape entries
  time_loop(state, [&] {
    if (fused) (void)swiglu_fp8(gate, up, st, 0, true);
    else (void)fp8_input_cast(swiglu(gate, up), st, 0, true);
  }, 0, static_cast<double>(kTokens * C) * 8.0);
}
void BM_swiglu_cast(benchmark::State& state) { run_swiglu(state, false); }
void BM_swiglu_fp8(benchmark::State& state) { run_swiglu(state, true); }

// gate/up + SwiGLU forward and backward, the input cast made by fp8_input_cast (as the norm producer
// makes it), the state seeded (the fused backward kernel's path).
void run_gate_up(benchmark::State& state, bool combined) {
  const int64_t C = state.range(0), I = state.range(1);
  Tensor x = rnd({kTokens, C}), wg = rnd({I, C}, 0.02), wu = rnd({I, C}, 0.02), ds = rnd({kTokens, I}, 1e-3);
  Fp8State st(3, Fp8Recipe{}, kGpu);
  st.load(Tensor::full({9, Fp8Recipe{}.amax_history}, 4.0), Tensor::full({9}, 112.0), 1);
  for (Tensor* t : {&x, &wg, &wu}) t->set_requires_grad(true);
  time_loop(state, [&] {
    Fp8InputCast x8 = fp8_input_cast(x, st, 0, true);
    Tensor s;
    if (combined) {
      s = swiglu_gate_up_fp8(x, wg, wu, st, 0, 1, 2, true, &x8).y;
    } else {
      std::vector<Tensor> gu = linear_fp8(x, {wg, wu}, {}, st, {0, 1}, &x8);
      s = swiglu_fp8(gu[0], gu[1], st, 2, true).y;
    }
    autograd::backward({s}, {ds});
    for (Tensor* t : {&x, &wg, &wu}) t->zero_grad();
  }, 12.0 * kTokens * C * I);
}
void BM_gate_up_separate(benchmark::State& state) { run_gate_up(state, false); }
void BM_gate_up_combined(benchmark::State& state) { run_gate_up(state, true); }

#define SHAPES(b)                                                                                   \
  BENCHMARK(b)->Args({2048, 2048})->Args({2048, 512})->Args({2048, 8192})->Args({8192, 2048})->UseManualTime() \
      ->Unit(benchmark::kMillisecond)->MinTime(0.2)
SHAPES(BM_linear_bf16);
SHAPES(BM_linear_fp8);
SHAPES(BM_gemm_bf16);
SHAPES(BM_gemm_fp8);
#define COLUMNS(b) BENCHMARK(b)->Arg(2048)->Arg(8192)->UseManualTime()->Unit(benchmark::kMillisecond)->MinTime(0.2)
COLUMNS(BM_cast_fp8);
COLUMNS(BM_copy);
COLUMNS(BM_swiglu_cast);
COLUMNS(BM_swiglu_fp8);
#define MLP(b) BENCHMARK(b)->Args({2048, 8192})->Args({4096, 14336})->UseManualTime()->Unit(benchmark::kMillisecond)->MinTime(0.2)
MLP(BM_gate_up_separate);
MLP(BM_gate_up_combined);

}  // namespace
}  // namespace kestrel

BENCHMARK_MAIN();
