// CPU GEMM throughput of kestrel::matmul (the cache-blocked reference kernel) on 2 threads, the CI
// machine's core count: C[M,N] = A[M,K] @ B[K,N] for f32 and bf16 storage (f32 accumulation).
// Reports GFLOP/s (2*M*N*K per product). Figures are recorded in bench/notes/cpu_ops.md.
#include <benchmark/benchmark.h>

#include "kestrel/autograd/grad_mode.h"
#include "kestrel/ops/matmul.h"
#include "kestrel/runtime/parallel.h"
#include "kestrel/runtime/random.h"

namespace {
using namespace kestrel;

void BM_matmul(benchmark::State& state, DType dtype, bool trans_b) {
  int64_t n = state.range(0);
  set_num_cpu_threads(2);
  autograd::NoGradGuard no_grad;
  Generator gen(7);
  Tensor a = normal({n, n}, 0.0, 1.0, dtype, Device::cpu(), gen);  // [M, K]
  Tensor b = normal({n, n}, 0.0, 1.0, dtype, Device::cpu(), gen);  // [K, N] (or [N, K] when trans_b)
  for (auto _ : state) {
    Tensor c = matmul(a, b, false, trans_b);
    benchmark::DoNotOptimize(c.data_ptr());
  }
  double flops = 2.0 * static_cast<double>(n) * n * n;
  state.counters["GFLOP/s"] = benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["threads"] = num_cpu_threads();
}

BENCHMARK_CAPTURE(BM_matmul, f32, DType::F32, false)->Arg(512)->Arg(2048)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(BM_matmul, f32_linear_bT, DType::F32, true)->Arg(512)->Arg(2048)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(BM_matmul, bf16, DType::BF16, false)->Arg(512)->Arg(2048)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
