// Bandwidth-bound op kernels (>= 256 MiB of traffic each) against the measured device copy, and
// cuBLASLt matmul against plain cublasGemmEx on the same shapes. Timed with CUDA events on the
// compute stream (manual time). Counters: GB/s and pct_copy (of BM_copy, which runs first) for
// kernels, TFLOP/s for matmul. The decoder layer's non-GEMM kernels at Llama-8B widths (tokens 8192, hidden 4096,
// intermediate 14336, 32 heads x 128) are the shapes; bench/ops_vs_torch.py times PyTorch's eager
// equivalents on the same shapes.
#include <benchmark/benchmark.h>
#include <cublas_v2.h>

#include <functional>

#include "bench_common.cuh"
#include "kestrel/runtime/memory_config.h"
#include "kernels/norm.h"
#include "kernels/softmax.h"
#include "kestrel/autograd/tape.h"
#include "kestrel/ops/activation.h"
#include "kestrel/ops/elementwise.h"
#include "kestrel/ops/matmul.h"
#include "kestrel/ops/norm.h"
#include "kestrel/ops/optim.h"
#include "kestrel/ops/reduce.h"
#include "kestrel/ops/rope.h"
#include "kestrel/ops/softmax.h"
#include "kestrel/runtime/accumulate.h"
#include "kestrel/cuda/check.h"
#include "kestrel/cuda/context.h"
#include "kestrel/runtime/random.h"

namespace kestrel {
namespace {

const Device kGpu = Device::cuda(0);
constexpr int64_t kTokens = 8192, kHidden = 4096, kInter = 14336, kHeads = 32, kHeadDim = 128;
double g_copy_gbs = 0;  // measured by BM_copy (registered first)

// Times fn on the compute stream (bench_common.cuh) and sets the counters from the mean time per call.
void time_loop(benchmark::State& state, const std::function<void()>& fn, double bytes, double flops = 0) {
  const double per = bench::time_with_events(state, fn, cuda::current_stream());  // seconds
  if (bytes > 0) state.counters["GB/s"] = bytes / per / 1e9;
  if (bytes > 0 && g_copy_gbs > 0) state.counters["pct_copy"] = 100.0 * bytes / per / 1e9 / g_copy_gbs;
  if (flops > 0) state.counters["TFLOP/s"] = flops / per / 1e12;
}

Tensor rnd(const Shape& s, DType dt = DType::BF16) { return normal(s, 0.0, 1.0, dt, kGpu); }
double nb(const Tensor& t) { return static_cast<double>(t.nbytes()); }

void BM_copy(benchmark::State& state) {
  Tensor x = rnd({kTokens, kHidden * 4}), y = Tensor::empty(x.shape(), x.dtype(), kGpu);
  cudaStream_t s = cuda::current_stream();
  time_loop(state, [&] { cudaMemcpyAsync(y.data_ptr(), x.data_ptr(), x.nbytes(), cudaMemcpyDeviceToDevice, s); },
            2 * nb(x));
  g_copy_gbs = state.counters["GB/s"];
}

void BM_add(benchmark::State& state) {
  Tensor a = rnd({kTokens, kHidden * 2}), b = rnd({kTokens, kHidden * 2});
  time_loop(state, [&] { (void)add(a, b); }, 3 * nb(a));
}
void BM_exp_f32(benchmark::State& state) {
  Tensor a = rnd({kTokens, kHidden * 2}, DType::F32);
  time_loop(state, [&] { (void)exp(a); }, 2 * nb(a));
}
void BM_silu(benchmark::State& state) {
  Tensor a = rnd({kTokens, kInter});
  time_loop(state, [&] { (void)silu(a); }, 2 * nb(a));
}
void BM_swiglu(benchmark::State& state) {
  Tensor g = rnd({kTokens, kInter}), u = rnd({kTokens, kInter});
  time_loop(state, [&] { (void)swiglu(g, u); }, 3 * nb(g));
}
void BM_rms_norm(benchmark::State& state) {
  Tensor x = rnd({kTokens * 2, kHidden}), w = rnd({kHidden});
  time_loop(state, [&] { (void)rms_norm(x, w, 1e-5); }, 2 * nb(x));
}
void BM_add_rms_norm(benchmark::State& state) {
  Tensor x = rnd({kTokens * 2, kHidden}), r = rnd({kTokens * 2, kHidden}), w = rnd({kHidden});
  time_loop(state, [&] { (void)add_rms_norm(x, r, w, 1e-5); }, 4 * nb(x));
}
void BM_layer_norm(benchmark::State& state) {
  Tensor x = rnd({kTokens * 2, kHidden}), w = rnd({kHidden}), b = rnd({kHidden});
  time_loop(state, [&] { (void)layer_norm(x, w, b, 1e-5); }, 2 * nb(x));
}
void BM_rms_norm_backward(benchmark::State& state) {
  Tensor x = rnd({kTokens * 2, kHidden}), w = rnd({kHidden}), g = rnd({kTokens * 2, kHidden});
  x.set_requires_grad(true);
  w.set_requires_grad(true);
  time_loop(state, [&] {
    x.zero_grad();  // as for activations in training: no leaf accumulation (that is runtime add_into)
    w.zero_grad();
    Tensor y = rms_norm(x, w, 1e-5);
    autograd::backward({y}, {g});
  }, 5 * nb(x));  // forward 2 + backward 3 (x, dy, dx)
}
// Backward kernels alone (slots called directly, no tape): dx plus the weight/bias column sums.
void BM_rms_norm_bwd_kernel(benchmark::State& state) {
  Tensor x = rnd({kTokens * 2, kHidden}), w = rnd({kHidden}), g = rnd({kTokens * 2, kHidden});
  Tensor rstd = Tensor::empty({kTokens * 2}, DType::F32, kGpu), y = Tensor::empty(x.shape(), x.dtype(), kGpu);
  kernels::dispatch(kernels::rms_norm_forward, "rms_norm", kGpu, y, rstd, x, w, 1e-5);
  Tensor dx = Tensor::empty(x.shape(), x.dtype(), kGpu), dw = Tensor::empty({kHidden}, x.dtype(), kGpu);
  time_loop(state, [&] { kernels::dispatch(kernels::rms_norm_backward, "rms_norm", kGpu, dx, dw, g, x, w, rstd); },
            3 * nb(x));  // x, dy, dx
}
void BM_layer_norm_fwd_bwd(benchmark::State& state) {
  Tensor x = rnd({kTokens * 2, kHidden}), w = rnd({kHidden}), b = rnd({kHidden}), g = rnd({kTokens * 2, kHidden});
  x.set_requires_grad(true);
  w.set_requires_grad(true);
  b.set_requires_grad(true);
  time_loop(state, [&] {
    x.zero_grad();
    w.zero_grad();
    b.zero_grad();
    Tensor y = layer_norm(x, w, b, 1e-5);
    autograd::backward({y}, {g});
  }, 5 * nb(x));
}
void BM_layer_norm_bwd_kernel(benchmark::State& state) {
  Tensor x = rnd({kTokens * 2, kHidden}), w = rnd({kHidden}), b = rnd({kHidden}), g = rnd({kTokens * 2, kHidden});
  Tensor mean = Tensor::empty({kTokens * 2}, DType::F32, kGpu), rstd = Tensor::empty({kTokens * 2}, DType::F32, kGpu);
  Tensor y = Tensor::empty(x.shape(), x.dtype(), kGpu);
  kernels::dispatch(kernels::layer_norm_forward, "layer_norm", kGpu, y, mean, rstd, x, w, b, 1e-5);
  Tensor dx = Tensor::empty(x.shape(), x.dtype(), kGpu), dw = Tensor::empty({kHidden}, x.dtype(), kGpu),
         db = Tensor::empty({kHidden}, x.dtype(), kGpu);
  time_loop(state, [&] {
    kernels::dispatch(kernels::layer_norm_backward, "layer_norm", kGpu, dx, dw, db, g, x, w, mean, rstd);
  }, 3 * nb(x));
}
void BM_softmax(benchmark::State& state) {
  Tensor x = rnd({kTokens * 2, 8192});
  time_loop(state, [&] { (void)softmax(x, -1); }, 2 * nb(x));
}
void BM_softmax_fwd_bwd(benchmark::State& state) {
  Tensor x = rnd({kTokens * 2, 8192}), g = rnd({kTokens * 2, 8192});
  x.set_requires_grad(true);
  time_loop(state, [&] {
    x.zero_grad();
    Tensor y = softmax(x, -1);
    autograd::backward({y}, {g});
  }, 5 * nb(x));  // forward 2 + backward 3 (y, dy, dx)
}
void BM_softmax_bwd_kernel(benchmark::State& state) {
  Tensor y = softmax(rnd({kTokens * 2, 8192}), -1), g = rnd({kTokens * 2, 8192});
  Tensor dx = Tensor::empty(y.shape(), y.dtype(), kGpu);
  kernels::ReduceDim r{kTokens * 2, 8192, 1};
  time_loop(state, [&] { kernels::dispatch(kernels::softmax_backward, "softmax", kGpu, dx, y, g, r, false); },
            3 * nb(y));
}
void BM_rope(benchmark::State& state) {
  Tensor q = rnd({kTokens * 2, kHeads, kHeadDim});
  Tensor pos = Tensor::arange(kTokens * 2, DType::I64, kGpu);
  time_loop(state, [&] { (void)rope(q, pos, 500000.0); }, 2 * nb(q));
}
void BM_sum_rows(benchmark::State& state) {
  Tensor x = rnd({kTokens * 4, kHidden}, DType::F32);
  time_loop(state, [&] { (void)sum(x, {0}); }, nb(x));
}
// The runtime's gradient accumulation (dst += src; autograd's leaf accumulation), for reference.
void BM_add_into_bf16(benchmark::State& state) {
  Tensor a = rnd({kTokens * 2, kHidden}), b = rnd({kTokens * 2, kHidden});
  time_loop(state, [&] { add_into(a, b); }, 3 * nb(a));
}
void BM_sum_rows_bf16(benchmark::State& state) {
  Tensor x = rnd({kTokens * 8, kHidden});
  time_loop(state, [&] { (void)sum(x, {0}); }, nb(x));
}
// Global-norm clipping on the device (no host sync): 8 gradients of 64 MiB (bf16), read twice + written.
void BM_clip_grad_norm_device(benchmark::State& state) {
  std::vector<Tensor> gs;
  for (int i = 0; i < 8; ++i) gs.push_back(rnd({kTokens, kHidden}));
  time_loop(state, [&] { (void)clip_grad_norm_device(gs, 1e-3); }, 3 * 8 * nb(gs[0]));
}

// ---- matmul vs cublasGemmEx ----
void gemm_pair(benchmark::State& state, DType dt, bool kestrel_side) {
  int64_t M = state.range(0), N = state.range(1), K = state.range(2);
  Tensor a = rnd({M, K}, dt), b = rnd({K, N}, dt), c = Tensor::empty({M, N}, dt, kGpu);
  double flops = 2.0 * M * N * K;
  if (kestrel_side) {
    time_loop(state, [&] { (void)matmul(a, b); }, 0, flops);
    return;
  }
  static cublasHandle_t h = [] {
    cublasHandle_t x;
    cublasCreate(&x);
    return x;
  }();
  cublasSetStream(h, cuda::current_stream());
  cudaDataType_t t = dt == DType::BF16 ? CUDA_R_16BF : (dt == DType::F16 ? CUDA_R_16F : CUDA_R_32F);
  bool tf32 = memory_config(Device::cuda(cuda::current_device())).matmul_tf32;
  cublasComputeType_t ct = dt == DType::F32 && tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
  float alpha = 1, beta = 0;
  time_loop(state, [&] {
    // Row-major C = A B as column-major C^T = B^T A^T.
    KESTREL_CUBLAS_CHECK(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, N, M, K, &alpha, b.data_ptr(), t, N, a.data_ptr(),
                                      t, K, &beta, c.data_ptr(), t, N, ct, CUBLAS_GEMM_DEFAULT));
  }, 0, flops);
}
void BM_matmul_bf16(benchmark::State& s) { gemm_pair(s, DType::BF16, true); }
void BM_gemmex_bf16(benchmark::State& s) { gemm_pair(s, DType::BF16, false); }
void BM_matmul_f32(benchmark::State& s) { gemm_pair(s, DType::F32, true); }
void BM_gemmex_f32(benchmark::State& s) { gemm_pair(s, DType::F32, false); }

#define KB(fn) BENCHMARK(fn)->UseManualTime()->Unit(benchmark::kMillisecond)->MinTime(0.05)
KB(BM_copy);
KB(BM_add);
KB(BM_exp_f32);
KB(BM_silu);
KB(BM_swiglu);
KB(BM_rms_norm);
KB(BM_add_rms_norm);
KB(BM_layer_norm);
KB(BM_rms_norm_backward);
KB(BM_rms_norm_bwd_kernel);
KB(BM_layer_norm_fwd_bwd);
KB(BM_layer_norm_bwd_kernel);
KB(BM_softmax);
KB(BM_softmax_fwd_bwd);
KB(BM_softmax_bwd_kernel);
KB(BM_rope);
KB(BM_sum_rows);
KB(BM_sum_rows_bf16);
KB(BM_add_into_bf16);
KB(BM_clip_grad_norm_device);
KB(BM_matmul_bf16)->Args({8192, 8192, 8192})->Args({8192, 14336, 4096})->Args({8192, 4096, 14336});
KB(BM_gemmex_bf16)->Args({8192, 8192, 8192})->Args({8192, 14336, 4096})->Args({8192, 4096, 14336});
KB(BM_matmul_f32)->Args({4096, 4096, 4096});
KB(BM_gemmex_f32)->Args({4096, 4096, 4096});

}  // namespace
}  // namespace kestrel

BENCHMARK_MAIN();
