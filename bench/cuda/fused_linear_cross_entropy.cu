// Benchmark: fused linear + cross-entropy, loss + d_hidden + d_weight, N = 8192 tokens, H = 4096, bf16,
// V in {32000, 128256, 152064, 250000}, against its ceiling measured in the same binary: the same three
// GEMMs (logits = X W^T, d_hidden = G W, d_weight = G^T X) run unchunked through the same cuBLASLt path.
// FLOPs counted: 3 * 2 * N * H * V. Extra memory: the op's workspace (it allocates nothing else; the
// free-memory delta around the first call is printed to prove it). Outputs (d_hidden bf16, d_weight f32)
// are the caller's and reported apart. Inputs are random (never zeros), generated on the device.
#include <benchmark/benchmark.h>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <array>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "cuda/fused_linear_cross_entropy.h"
#include "cuda/fused_linear_cross_entropy_internal.h"
#include "kestrel/cuda/check.h"
#include "kestrel/cuda/cublaslt_api.h"

namespace {

using kestrel::DType;
namespace kc = kestrel::cuda;

constexpr int64_t kTokens = 8192, kHidden = 4096;
constexpr int kIters = 8;
constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

struct DeviceBytes {
  void* ptr = nullptr;
  explicit DeviceBytes(size_t n) { KESTREL_CUDA_CHECK(cudaMalloc(&ptr, n)); }
  ~DeviceBytes() { KESTREL_CUDA_CHECK_NOTHROW(cudaFree(ptr)); }
  DeviceBytes(const DeviceBytes&) = delete;
  DeviceBytes& operator=(const DeviceBytes&) = delete;
};

__device__ uint32_t mix(uint64_t x) {
  x ^= x >> 33; x *= 0xff51afd7ed558ccdull; x ^= x >> 33; x *= 0xc4ceb9fe1a85ec53ull; x ^= x >> 33;
  return uint32_t(x);
}
// Uniform(-scale, scale) bf16.
__global__ void fill_bf16(__nv_bfloat16* p, size_t n, uint64_t seed, float scale) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    p[i] = __float2bfloat16_rn(scale * (float(mix(seed * 0x9e3779b97f4a7c15ull + i)) * 2.3283064e-10f * 2.0f - 1.0f));
}
// Labels in [0, V), about 3% ignored.
__global__ void fill_labels(int64_t* p, int64_t n, int64_t v, uint64_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const uint32_t r = mix(seed + i);
    p[i] = (r % 100) < 3 ? -100 : int64_t(mix(seed ^ (i * 7919)) % uint32_t(v));
  }
}

struct Timer {
  cudaEvent_t start, stop;
  Timer() { KESTREL_CUDA_CHECK(cudaEventCreate(&start)); KESTREL_CUDA_CHECK(cudaEventCreate(&stop)); }
  ~Timer() { cudaEventDestroy(start); cudaEventDestroy(stop); }
  template <class F> double ms(F&& f, cudaStream_t s) {
    KESTREL_CUDA_CHECK(cudaEventRecord(start, s));
    f();
    KESTREL_CUDA_CHECK(cudaEventRecord(stop, s));
    KESTREL_CUDA_CHECK(cudaEventSynchronize(stop));
    float t = 0;
    KESTREL_CUDA_CHECK(cudaEventElapsedTime(&t, start, stop));
    return t;
  }
};

struct Row {
  double fused_ms = 0, fused_tflops = 0, workspace_gib = 0, hidden_alloc_gib = 0, outputs_gib = 0, loss = 0;
  int64_t token_chunk = 0, vocab_chunk = 0;
  size_t gemm_ws_mib = 0;
  bool grads = true;
};
// (V, label) -> row, label e.g. "bound1536" or "nc2048,vc1024" (+ ",fwd").
std::map<std::pair<int64_t, std::string>, Row> g_rows;
// V -> times of the unchunked cuBLAS GEMMs: logits, d_hidden, d_weight, all three.
std::map<int64_t, std::array<double, 4>> g_cublas;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Context {
  cublasLtHandle_t lt = nullptr;
  cudaStream_t stream = nullptr;
  Context() {
    KESTREL_CUBLAS_CHECK(kc::cublaslt_api().Create(&lt));
    KESTREL_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  }
};
Context& ctx() {
  static Context c;
  return c;
}

// args: V, workspace bound in MiB (0: explicit chunks), token chunk, vocab chunk, gradients (0/1)
void BM_FusedLinearCrossEntropy(benchmark::State& state) {
  const int64_t v = state.range(0), bound_mib = state.range(1);
  const bool grads = state.range(4) != 0;
  auto& c = ctx();
  DeviceBytes x(kTokens * kHidden * 2), w(size_t(v) * kHidden * 2), labels(kTokens * 8), loss(4),
      dh(kTokens * kHidden * 2), dw(size_t(v) * kHidden * 4);
  fill_bf16<<<1024, 256, 0, c.stream>>>(static_cast<__nv_bfloat16*>(x.ptr), kTokens * kHidden, 1, 1.0f);
  fill_bf16<<<1024, 256, 0, c.stream>>>(static_cast<__nv_bfloat16*>(w.ptr), size_t(v) * kHidden, 2, 0.03f);
  fill_labels<<<64, 256, 0, c.stream>>>(static_cast<int64_t*>(labels.ptr), kTokens, v, 3);
  KESTREL_CUDA_CHECK_LAUNCH();
  kc::FusedLinearCrossEntropyParams p;
  p.dtype = DType::BF16; p.tokens = kTokens; p.hidden = kHidden; p.vocab = v;
  p.hidden_states = x.ptr; p.weight = w.ptr; p.labels = static_cast<int64_t*>(labels.ptr);
  p.loss = static_cast<float*>(loss.ptr);
  p.d_hidden = grads ? dh.ptr : nullptr;
  p.d_weight = grads ? static_cast<float*>(dw.ptr) : nullptr;
  const auto chunks = bound_mib > 0 ? kc::pick_fused_linear_cross_entropy_chunks(p, size_t(bound_mib) << 20)
                                    : kc::FusedCrossEntropyChunks{state.range(2), state.range(3), 0};
  chunks.apply_to(p);
  const size_t ws_bytes = kc::fused_linear_cross_entropy_workspace_bytes(p);
  DeviceBytes ws(ws_bytes);
  KESTREL_CUDA_CHECK(cudaDeviceSynchronize());
  size_t free_before = 0, free_after = 0, total = 0;
  KESTREL_CUDA_CHECK(cudaMemGetInfo(&free_before, &total));
  kc::fused_linear_cross_entropy(p, ws.ptr, ws_bytes, c.lt, c.stream);  // warm-up: plans, module load
  KESTREL_CUDA_CHECK(cudaStreamSynchronize(c.stream));
  KESTREL_CUDA_CHECK(cudaMemGetInfo(&free_after, &total));
  Timer timer;
  std::vector<double> times;
  for (auto _ : state) {
    const double t = timer.ms([&] { kc::fused_linear_cross_entropy(p, ws.ptr, ws_bytes, c.lt, c.stream); }, c.stream);
    state.SetIterationTime(t / 1e3);
    times.push_back(t);
  }
  float l = 0;
  KESTREL_CUDA_CHECK(cudaMemcpy(&l, loss.ptr, 4, cudaMemcpyDeviceToHost));
  std::string label = bound_mib > 0 ? "bound" + std::to_string(bound_mib)
                                    : "nc" + std::to_string(state.range(2)) + ",vc" + std::to_string(state.range(3));
  if (!grads) label += ",fwd";
  Row& row = g_rows[{v, label}];
  row.grads = grads;
  row.fused_ms = median(times);
  row.fused_tflops = (grads ? 6.0 : 2.0) * kTokens * kHidden * double(v) / (row.fused_ms * 1e-3) / 1e12;
  row.workspace_gib = double(ws_bytes) / kGiB;
  row.hidden_alloc_gib = (double(free_before) - double(free_after)) / kGiB;
  row.outputs_gib = double(kTokens * kHidden * 2 + size_t(v) * kHidden * 4) / kGiB;
  row.loss = l;
  row.token_chunk = chunks.token_chunk;
  row.vocab_chunk = chunks.vocab_chunk;
  row.gemm_ws_mib = kc::resolve_fused_linear_cross_entropy_chunks(p).gemm_workspace_bytes >> 20;
  state.counters["TFLOP/s"] = row.fused_tflops;
  state.counters["workspace_GiB"] = row.workspace_gib;
  state.counters["Nc"] = double(chunks.token_chunk);
  state.counters["loss"] = l;
}

// What a training step runs (ops/cuda/cross_entropy.cu), both ways of train.loss_gradient:
//   mode 0 "lse_backward": the forward (loss + lse, no gradients), then the backward from the lse (logits
//     recomputed per vocabulary chunk; d_hidden bf16 through an f32 accumulator; d_weight bf16 written by
//     its GEMM). FLOPs 8NHV (logits twice, d_hidden, d_weight).
//   mode 1 "single_pass" (the default, known_grad): loss + both gradients in one launcher call under the
//     op's 1 GiB bound, d_weight bf16 added into a held gradient by each token chunk. FLOPs 6NHV.
// Both report 6NHV-based TFLOP/s too (the work a step needs), so the two rows compare directly.
// Extra memory: the larger workspace of the call(s) (the outputs are the gradients themselves).
struct StepRow {
  double fwd_ms = 0, bwd_ms = 0, total_ms = 0, fwd_ws_gib = 0, bwd_ws_gib = 0;
  int64_t token_chunks = 1;
};
std::map<std::pair<int64_t, int>, StepRow> g_step;

void BM_FusedCrossEntropyTrainingStep(benchmark::State& state) {
  const int64_t v = state.range(0);
  const int mode = int(state.range(1));
  auto& c = ctx();
  DeviceBytes x(kTokens * kHidden * 2), w(size_t(v) * kHidden * 2), labels(kTokens * 8), loss(4), lse(kTokens * 4),
      one(4), dh(kTokens * kHidden * 2), dw(size_t(v) * kHidden * 2);
  fill_bf16<<<1024, 256, 0, c.stream>>>(static_cast<__nv_bfloat16*>(x.ptr), kTokens * kHidden, 1, 1.0f);
  fill_bf16<<<1024, 256, 0, c.stream>>>(static_cast<__nv_bfloat16*>(w.ptr), size_t(v) * kHidden, 2, 0.03f);
  fill_labels<<<64, 256, 0, c.stream>>>(static_cast<int64_t*>(labels.ptr), kTokens, v, 3);
  KESTREL_CUDA_CHECK(cudaMemsetAsync(dw.ptr, 0, size_t(v) * kHidden * 2, c.stream));
  KESTREL_CUDA_CHECK_LAUNCH();
  const float up = 1.0f;
  KESTREL_CUDA_CHECK(cudaMemcpy(one.ptr, &up, 4, cudaMemcpyHostToDevice));
  kc::FusedLinearCrossEntropyParams f;
  f.dtype = DType::BF16; f.tokens = kTokens; f.hidden = kHidden; f.vocab = v;
  f.hidden_states = x.ptr; f.weight = w.ptr; f.labels = static_cast<int64_t*>(labels.ptr);
  f.loss = static_cast<float*>(loss.ptr);
  kc::FusedLinearCrossEntropyParams b = f;
  b.upstream_grad = static_cast<const float*>(one.ptr);
  b.d_hidden = dh.ptr;
  b.d_weight = dw.ptr;
  b.d_weight_f32 = false;
  std::function<void()> fwd, bwd;
  size_t fwd_bytes = 0, bwd_bytes = 0;
  if (mode == 0) {
    f.lse = static_cast<float*>(lse.ptr);
    kc::pick_fused_linear_cross_entropy_chunks(f, size_t(1) << 30).apply_to(f);  // as the op's forward
    fwd_bytes = kc::fused_linear_cross_entropy_workspace_bytes(f);
    bwd_bytes = kc::fused_linear_cross_entropy_backward_workspace_bytes(b);
  } else {
    b.accumulate_d_weight = true;  // a later micro-batch: added into the held gradient
    kc::pick_fused_linear_cross_entropy_chunks(b, size_t(1) << 30).apply_to(b);  // as the op's forward_backward
    fwd_bytes = kc::fused_linear_cross_entropy_workspace_bytes(b);
  }
  DeviceBytes ws(std::max(fwd_bytes, bwd_bytes));
  if (mode == 0) {
    fwd = [&] { kc::fused_linear_cross_entropy(f, ws.ptr, fwd_bytes, c.lt, c.stream); };
    bwd = [&] {
      kc::fused_linear_cross_entropy_backward(b, static_cast<const float*>(lse.ptr), ws.ptr, bwd_bytes, c.lt,
                                              c.stream);
    };
  } else {
    fwd = [&] { kc::fused_linear_cross_entropy(b, ws.ptr, fwd_bytes, c.lt, c.stream); };
    bwd = [] {};
  }
  fwd();
  bwd();
  KESTREL_CUDA_CHECK(cudaStreamSynchronize(c.stream));
  Timer timer;
  std::vector<double> tf, tb, tt;
  for (auto _ : state) {
    const double a = timer.ms(fwd, c.stream), d = mode == 0 ? timer.ms(bwd, c.stream) : 0.0;
    state.SetIterationTime((a + d) / 1e3);
    tf.push_back(a);
    tb.push_back(d);
    tt.push_back(a + d);
  }
  StepRow& r = g_step[{v, mode}];
  r.fwd_ms = median(tf);
  r.bwd_ms = median(tb);
  r.total_ms = median(tt);
  r.fwd_ws_gib = double(fwd_bytes) / kGiB;
  r.bwd_ws_gib = double(bwd_bytes) / kGiB;
  r.token_chunks = mode == 1 ? (kTokens + b.token_chunk - 1) / b.token_chunk : 1;
  state.counters["TFLOP/s(6NHV)"] = 6.0 * kTokens * kHidden * double(v) / (r.total_ms * 1e-3) / 1e12;
  state.counters["workspace_GiB"] = double(std::max(fwd_bytes, bwd_bytes)) / kGiB;
}

// The ceiling: the same three GEMMs unchunked (full [N, V] bf16 logits / G), same cuBLASLt plan path.
void BM_CublasThreeGemms(benchmark::State& state) {
  const int64_t v = state.range(0);
  auto& c = ctx();
  const int64_t ldv = (v + 7) / 8 * 8;
  DeviceBytes x(kTokens * kHidden * 2), w(size_t(v) * kHidden * 2), g(size_t(kTokens) * ldv * 2),
      dh(kTokens * kHidden * 2), dw(size_t(v) * kHidden * 4), lt_ws(size_t(32) << 20);
  fill_bf16<<<1024, 256, 0, c.stream>>>(static_cast<__nv_bfloat16*>(x.ptr), kTokens * kHidden, 4, 1.0f);
  fill_bf16<<<1024, 256, 0, c.stream>>>(static_cast<__nv_bfloat16*>(w.ptr), size_t(v) * kHidden, 5, 0.03f);
  fill_bf16<<<1024, 256, 0, c.stream>>>(static_cast<__nv_bfloat16*>(g.ptr), size_t(kTokens) * ldv, 6, 1e-4f);
  KESTREL_CUDA_CHECK_LAUNCH();
  namespace fc = kc::fused_ce;
  const fc::GemmDesc logits{CUBLAS_OP_T, CUBLAS_OP_N, v, kTokens, kHidden, kHidden, kHidden, ldv, CUDA_R_16BF, CUDA_R_16BF};
  const fc::GemmDesc dhid{CUBLAS_OP_N, CUBLAS_OP_N, kHidden, kTokens, v, kHidden, ldv, kHidden, CUDA_R_16BF, CUDA_R_16BF};
  const fc::GemmDesc dwt{CUBLAS_OP_N, CUBLAS_OP_T, kHidden, v, kTokens, kHidden, ldv, kHidden, CUDA_R_16BF, CUDA_R_32F};
  auto gemm = [&](int which) {
    if (which == 0) fc::lt_matmul(c.lt, logits, w.ptr, x.ptr, g.ptr, 0.0f, lt_ws.ptr, size_t(32) << 20, c.stream);
    if (which == 1) fc::lt_matmul(c.lt, dhid, w.ptr, g.ptr, dh.ptr, 0.0f, lt_ws.ptr, size_t(32) << 20, c.stream);
    if (which == 2) fc::lt_matmul(c.lt, dwt, x.ptr, g.ptr, dw.ptr, 0.0f, lt_ws.ptr, size_t(32) << 20, c.stream);
  };
  auto run = [&] { for (int i = 0; i < 3; ++i) gemm(i); };
  run();
  KESTREL_CUDA_CHECK(cudaStreamSynchronize(c.stream));
  Timer timer;
  std::vector<double> times, part[3];
  for (auto _ : state) {
    const double t = timer.ms(run, c.stream);
    state.SetIterationTime(t / 1e3);
    times.push_back(t);
    for (int i = 0; i < 3; ++i) part[i].push_back(timer.ms([&] { gemm(i); }, c.stream));
  }
  const double ms = median(times);
  g_cublas[v] = {median(part[0]), median(part[1]), median(part[2]), ms};
  state.counters["TFLOP/s"] = 6.0 * kTokens * kHidden * double(v) / (ms * 1e-3) / 1e12;
}

void register_all() {
  auto fused = [](std::vector<int64_t> args) {
    benchmark::RegisterBenchmark("fused_ce/bf16", BM_FusedLinearCrossEntropy)
        ->Args(args)->Iterations(kIters)->UseManualTime()->Unit(benchmark::kMillisecond);
  };
  const int64_t vocabs[] = {32000, 128256, 152064, 250000};
  for (int64_t v : vocabs) {
    fused({v, 1536, 0, 0, 1});
    if (v == 250000) {
      fused({v, 1024, 0, 0, 1});
      // Chunk-size study (run 2 of the notes also had 1664/15632, 2048/1024, 2752/4096, 4096/8192, loss only).
      for (auto [nc, vc] : {std::pair<int64_t, int64_t>{2752, 15632}, {2048, 4096}}) fused({v, 0, nc, vc, 1});
    }
    for (int mode : {0, 1})
      benchmark::RegisterBenchmark(mode == 0 ? "fused_ce_training_step/bf16/lse_backward"
                                             : "fused_ce_training_step/bf16/single_pass",
                                   BM_FusedCrossEntropyTrainingStep)
          ->Args({v, mode})->Iterations(kIters)->UseManualTime()->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark("cublas/bf16/3_gemms_unchunked", BM_CublasThreeGemms)
        ->Args({v})->Iterations(kIters)->UseManualTime()->Unit(benchmark::kMillisecond);
  }
}

void print_summary() {
  std::printf("\nunchunked cuBLASLt GEMMs, N=%lld H=%lld bf16 (ms; TFLOP/s)\n", (long long)kTokens, (long long)kHidden);
  std::printf("%8s %16s %16s %16s %16s\n", "V", "logits", "d_hidden", "d_weight(f32)", "all three");
  for (auto& [v, t] : g_cublas) {
    const double f = 2.0 * kTokens * kHidden * double(v) / 1e9;
    std::printf("%8lld %7.2f %8.1f %7.2f %8.1f %7.2f %8.1f %7.2f %8.1f\n", (long long)v, t[0], f / t[0], t[1],
                f / t[1], t[2], f / t[2], t[3], 3 * f / t[3]);
  }
  std::printf("\ntraining step, N=%lld H=%lld bf16: lse_backward (forward, then backward from the lse; 8NHV run) vs\n"
              "single_pass (loss + gradients in the forward, d_weight bf16 added per token chunk; 6NHV run);\n"
              "TFLOP/s over the 6NHV a step needs\n", (long long)kTokens, (long long)kHidden);
  std::printf("%8s %-13s %9s %9s %9s %8s %8s %8s %7s\n", "V", "mode", "fwd_ms", "bwd_ms", "total_ms", "TFLOP/s",
              "fwdWsGiB", "bwdWsGiB", "tchunks");
  for (auto& [key, r] : g_step)
    std::printf("%8lld %-13s %9.2f %9.2f %9.2f %8.1f %8.3f %8.3f %7lld\n", (long long)key.first,
                key.second == 0 ? "lse_backward" : "single_pass", r.fwd_ms, r.bwd_ms, r.total_ms,
                6.0 * kTokens * kHidden * double(key.first) / (r.total_ms * 1e-3) / 1e12, r.fwd_ws_gib, r.bwd_ws_gib,
                (long long)r.token_chunks);
  std::printf("\nfused linear+CE, N=%lld H=%lld bf16; FLOPs = 6NHV (loss+grads) or 2NHV (fwd)\n", (long long)kTokens,
              (long long)kHidden);
  std::printf("%8s %-18s %6s %6s %4s %9s %8s %9s %6s %8s %8s %8s\n", "V", "config", "Nc", "Vc", "ltM", "fused_ms",
              "TFLOP/s", "cublas_ms", "ratio", "ws_GiB", "hidnGiB", "outGiB");
  for (auto& [key, row] : g_rows) {
    const double cms = g_cublas.count(key.first) ? g_cublas[key.first][row.grads ? 3 : 0] : 0.0;
    std::printf("%8lld %-18s %6lld %6lld %4zu %9.2f %8.1f %9.2f %6.2f %8.3f %8.3f %8.3f\n", (long long)key.first,
                key.second.c_str(), (long long)row.token_chunk, (long long)row.vocab_chunk, row.gemm_ws_mib, row.fused_ms,
                row.fused_tflops, cms, cms > 0 ? cms / row.fused_ms : 0.0, row.workspace_gib, row.hidden_alloc_gib,
                row.outputs_gib);
  }
}

}  // namespace

int main(int argc, char** argv) {
  try {
    benchmark::Initialize(&argc, argv);
    register_all();
    benchmark::RunSpecifiedBenchmarks();
    print_summary();
    benchmark::Shutdown();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
  return 0;
}
