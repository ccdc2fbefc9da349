// Tests of the fused linear + cross-entropy launcher (ops/cuda/fused_linear_cross_entropy.h).
// Oracles: a float64 CPU reference written here with full logits (small sizes), a naive float64 GPU
// reference (one thread per output element, medium size), and central finite differences of the op's
// own loss for d_hidden (f32). Inputs are fresh random draws each run (the seed is printed on failure);
// every output and the workspace are NaN-poisoned before the op runs.
#include <gtest/gtest.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <random>
#include <vector>

#include "cuda/fused_linear_cross_entropy.h"
#include "kestrel/cuda/check.h"
#include "kestrel/cuda/cublaslt_api.h"
#include "kestrel/runtime/dtype.h"
#include "kestrel/runtime/error.h"
#include "support/gpu.h"

namespace {

using kestrel::DType;
using kestrel::cuda::CrossEntropyReduction;
using kestrel::cuda::FusedLinearCrossEntropyParams;

// ---- RAII helpers ----
struct DeviceBytes {
  void* ptr = nullptr;
  size_t bytes = 0;
  explicit DeviceBytes(size_t n) : bytes(n) { KESTREL_CUDA_CHECK(cudaMalloc(&ptr, n ? n : 1)); }
  ~DeviceBytes() { KESTREL_CUDA_CHECK_NOTHROW(cudaFree(ptr)); }
  DeviceBytes(const DeviceBytes&) = delete;
  DeviceBytes& operator=(const DeviceBytes&) = delete;
  template <class T> T* as() const { return static_cast<T*>(ptr); }
  void poison() const { KESTREL_CUDA_CHECK(cudaMemset(ptr, 0xFF, bytes)); }  // NaN in f32, bf16, f16
  void upload(const void* src) const { KESTREL_CUDA_CHECK(cudaMemcpy(ptr, src, bytes, cudaMemcpyHostToDevice)); }
  void download(void* dst) const { KESTREL_CUDA_CHECK(cudaMemcpy(dst, ptr, bytes, cudaMemcpyDeviceToHost)); }
};
struct LtHandle {
  cublasLtHandle_t h = nullptr;
  LtHandle() { KESTREL_CUBLAS_CHECK(kestrel::cuda::cublaslt_api().Create(&h)); }
  ~LtHandle() { kestrel::cuda::cublaslt_api().Destroy(h); }
};
struct Stream {
  cudaStream_t s = nullptr;
  Stream() { KESTREL_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking)); }
  ~Stream() { KESTREL_CUDA_CHECK_NOTHROW(cudaStreamDestroy(s)); }
};

// ---- host encoding of the element types ----
double round_to(DType t, double v) {
  switch (t) {
    case DType::BF16: return double(float(kestrel::bf16(float(v))));
    case DType::F16: return double(float(kestrel::f16(float(v))));
    default: return double(float(v));
  }
}
std::vector<uint8_t> encode(DType t, const std::vector<double>& v) {
  std::vector<uint8_t> out(v.size() * kestrel::dtype_size(t));
  for (size_t i = 0; i < v.size(); ++i) {
    if (t == DType::F32) { float f = float(v[i]); std::memcpy(&out[4 * i], &f, 4); }
    else { uint16_t b = t == DType::BF16 ? kestrel::bf16(float(v[i])).bits : kestrel::f16(float(v[i])).bits; std::memcpy(&out[2 * i], &b, 2); }
  }
  return out;
}
std::vector<double> decode(DType t, const std::vector<uint8_t>& bytes) {
  std::vector<double> out(bytes.size() / kestrel::dtype_size(t));
  for (size_t i = 0; i < out.size(); ++i) {
    if (t == DType::F32) { float f; std::memcpy(&f, &bytes[4 * i], 4); out[i] = f; }
    else { uint16_t b; std::memcpy(&b, &bytes[2 * i], 2);
           out[i] = t == DType::BF16 ? float(kestrel::bf16::from_bits(b)) : float(kestrel::f16::from_bits(b)); }
  }
  return out;
}

// ---- problem description and random inputs ----
struct Case {
  DType dtype = DType::F32;
  int64_t n = 37, h = 48, v = 1000;
  int64_t token_chunk = 16, vocab_chunk = 128;  // 1000 = 7 * 128 + 104, 37 = 2 * 16 + 5
  double ignore_frac = 0.2;
  bool token_weights = false;
  float z_loss = 0, eps = 0;
  CrossEntropyReduction reduction = CrossEntropyReduction::Mean;
  int64_t ignore_index = -100;
};

struct Inputs {
  std::vector<double> x, w;  // [N, H], [V, H], already rounded to the dtype
  std::vector<int64_t> labels;
  std::vector<float> tw;     // [N] or empty
};

uint64_t fresh_seed() { return (uint64_t(std::random_device{}()) << 32) ^ std::random_device{}(); }

Inputs make_inputs(const Case& c, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  Inputs in;
  in.x.resize(c.n * c.h);
  in.w.resize(c.v * c.h);
  for (auto& e : in.x) e = round_to(c.dtype, normal(rng));
  for (auto& e : in.w) e = round_to(c.dtype, normal(rng) * 2.0 / std::sqrt(double(c.h)));  // logits ~ N(0, 4)
  in.labels.resize(c.n);
  for (auto& y : in.labels) y = unit(rng) < c.ignore_frac ? c.ignore_index : int64_t(unit(rng) * double(c.v)) % c.v;
  if (c.token_weights) {
    in.tw.resize(c.n);
    for (auto& t : in.tw) t = float(0.2 + 1.8 * unit(rng));
  }
  return in;
}

// ---- float64 CPU reference, full logits ----
struct Result {
  double loss = 0;
  std::vector<double> lse, dh, dw;  // [N], [N, H], [V, H]
};

Result cpu_reference(const Case& c, const Inputs& in, double upstream = 1.0) {
  const int64_t n = c.n, h = c.h, v = c.v;
  Result r;
  r.lse.assign(n, 0);
  r.dh.assign(n * h, 0);
  r.dw.assign(v * h, 0);
  auto valid = [&](int64_t y) { return y != c.ignore_index && y >= 0 && y < v; };
  auto weight = [&](int64_t i) { return in.tw.empty() ? 1.0 : double(in.tw[i]); };
  double denom = 0, total = 0;
  for (int64_t i = 0; i < n; ++i) if (valid(in.labels[i])) denom += weight(i);
  const bool mean = c.reduction == CrossEntropyReduction::Mean;
  std::vector<double> l(v);
  for (int64_t i = 0; i < n; ++i) {
    double m = -INFINITY, sum = 0, lsum = 0;
    for (int64_t j = 0; j < v; ++j) {
      double d = 0;
      for (int64_t k = 0; k < h; ++k) d += in.x[i * h + k] * in.w[j * h + k];
      l[j] = d;
      m = std::max(m, d);
      lsum += d;
    }
    for (int64_t j = 0; j < v; ++j) sum += std::exp(l[j] - m);
    const double lse = m + std::log(sum);
    r.lse[i] = lse;
    const int64_t y = in.labels[i];
    if (!valid(y)) continue;
    const double eps = c.eps, z = c.z_loss;
    total += weight(i) * ((1 - eps) * (lse - l[y]) + eps * (lse - lsum / double(v)) + z * lse * lse);
    const double coef = (mean ? (denom > 0 ? weight(i) / denom : 0.0) : weight(i)) * upstream;
    for (int64_t j = 0; j < v; ++j) {
      const double g = coef * ((1 + 2 * z * lse) * std::exp(l[j] - lse) - eps / double(v) - (j == y ? 1 - eps : 0.0));
      for (int64_t k = 0; k < h; ++k) {
        r.dh[i * h + k] += g * in.w[j * h + k];
        r.dw[j * h + k] += g * in.x[i * h + k];
      }
    }
  }
  r.loss = mean ? (denom > 0 ? total / denom : 0.0) : total;
  return r;
}

// ---- the op on the device ----
struct RunOptions {
  bool grads = true, want_d_hidden = true, want_d_weight = true;
  const std::vector<double>* dw_init = nullptr;  // accumulate into this when set
  const float* upstream = nullptr;               // host value, uploaded to a device scalar
  size_t workspace_bound = 0;                    // pick chunks from a byte bound when set
  bool graph = false;                            // capture into a CUDA graph and replay twice
  bool dw_in_dtype = false;                      // d_weight in the input dtype (else f32)
};

struct Fused : Result {
  int flag = 0;
  size_t workspace = 0;
};

Fused run_fused(const Case& c, const Inputs& in, const RunOptions& o = {}) {
  Stream stream;
  LtHandle lt;
  const size_t es = kestrel::dtype_size(c.dtype);
  DeviceBytes x(c.n * c.h * es), w(c.v * c.h * es), labels(c.n * 8), tw(c.n * 4), loss(4), lse(c.n * 4),
      dh(c.n * c.h * es), dw(c.v * c.h * 4), flag(4), up(4);
  x.upload(encode(c.dtype, in.x).data());
  w.upload(encode(c.dtype, in.w).data());
  labels.upload(in.labels.data());
  if (!in.tw.empty()) tw.upload(in.tw.data());
  if (o.upstream) up.upload(o.upstream);
  FusedLinearCrossEntropyParams p;
  p.dtype = c.dtype; p.tokens = c.n; p.hidden = c.h; p.vocab = c.v;
  p.hidden_states = x.ptr; p.weight = w.ptr; p.labels = labels.as<int64_t>();
  p.token_weights = in.tw.empty() ? nullptr : tw.as<float>();
  p.ignore_index = c.ignore_index; p.reduction = c.reduction; p.z_loss = c.z_loss; p.label_smoothing = c.eps;
  p.loss = loss.as<float>(); p.lse = lse.as<float>();
  p.d_hidden = o.grads && o.want_d_hidden ? dh.ptr : nullptr;
  p.d_weight = o.grads && o.want_d_weight ? dw.as<float>() : nullptr;
  p.d_weight_f32 = !o.dw_in_dtype;
  p.accumulate_d_weight = o.dw_init != nullptr;
  p.error_flag = flag.as<int>();
  p.upstream_grad = o.upstream ? up.as<float>() : nullptr;
  p.token_chunk = c.token_chunk; p.vocab_chunk = c.vocab_chunk;
  if (o.workspace_bound) {
    kestrel::cuda::pick_fused_linear_cross_entropy_chunks(p, o.workspace_bound).apply_to(p);
  }
  Fused r;
  r.workspace = kestrel::cuda::fused_linear_cross_entropy_workspace_bytes(p);
  DeviceBytes ws(r.workspace);
  auto poison = [&] {
    for (auto* b : {&loss, &lse, &dh, &dw, &ws}) b->poison();
    if (o.dw_init && o.dw_in_dtype) {
      const std::vector<uint8_t> init = encode(c.dtype, *o.dw_init);
      KESTREL_CUDA_CHECK(cudaMemcpy(dw.ptr, init.data(), init.size(), cudaMemcpyHostToDevice));
    } else if (o.dw_init) {
      std::vector<float> init(o.dw_init->begin(), o.dw_init->end());
      dw.upload(init.data());
    }
    KESTREL_CUDA_CHECK(cudaMemset(flag.ptr, 0, 4));
    KESTREL_CUDA_CHECK(cudaDeviceSynchronize());  // legacy-stream copies/memsets vs. our non-blocking stream
  };
  poison();
  if (!o.graph) {
    kestrel::cuda::fused_linear_cross_entropy(p, ws.ptr, ws.bytes, lt.h, stream.s);
  } else {
    kestrel::cuda::fused_linear_cross_entropy(p, ws.ptr, ws.bytes, lt.h, stream.s);  // builds the plans
    KESTREL_CUDA_CHECK(cudaStreamSynchronize(stream.s));
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    KESTREL_CUDA_CHECK(cudaStreamBeginCapture(stream.s, cudaStreamCaptureModeGlobal));
    kestrel::cuda::fused_linear_cross_entropy(p, ws.ptr, ws.bytes, lt.h, stream.s);  // a host sync would fail here
    KESTREL_CUDA_CHECK(cudaStreamEndCapture(stream.s, &graph));
    KESTREL_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    for (int rep = 0; rep < 2; ++rep) {
      KESTREL_CUDA_CHECK(cudaStreamSynchronize(stream.s));
      poison();
      KESTREL_CUDA_CHECK(cudaGraphLaunch(exec, stream.s));
    }
    KESTREL_CUDA_CHECK(cudaStreamSynchronize(stream.s));
    KESTREL_CUDA_CHECK(cudaGraphExecDestroy(exec));
    KESTREL_CUDA_CHECK(cudaGraphDestroy(graph));
  }
  KESTREL_CUDA_CHECK(cudaStreamSynchronize(stream.s));
  KESTREL_CUDA_CHECK(cudaGetLastError());
  float l;
  loss.download(&l);
  r.loss = l;
  std::vector<float> f(c.n);
  lse.download(f.data());
  r.lse.assign(f.begin(), f.end());
  if (p.d_hidden) {
    std::vector<uint8_t> b(dh.bytes);
    dh.download(b.data());
    r.dh = decode(c.dtype, b);
  }
  if (p.d_weight && o.dw_in_dtype) {
    std::vector<uint8_t> b(c.v * c.h * es);
    KESTREL_CUDA_CHECK(cudaMemcpy(b.data(), dw.ptr, b.size(), cudaMemcpyDeviceToHost));
    r.dw = decode(c.dtype, b);
  } else if (p.d_weight) {
    std::vector<float> g(c.v * c.h);
    dw.download(g.data());
    r.dw.assign(g.begin(), g.end());
  }
  flag.download(&r.flag);
  return r;
}

// ---- comparisons, tolerances tied to the dtype ----
double rel_norm_error(const std::vector<double>& a, const std::vector<double>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i])) return INFINITY;
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}
double max_abs_error(const std::vector<double>& a, const std::vector<double>& b) {
  double e = 0;
  for (size_t i = 0; i < a.size(); ++i) e = std::isfinite(a[i]) ? std::max(e, std::abs(a[i] - b[i])) : INFINITY;
  return e;
}
// Gradients: bf16 rounds G and d_hidden to 8 bits of mantissa (~2e-3 rms), f16 to 11 bits.
double grad_tol(DType t) { return t == DType::BF16 ? 1.2e-2 : t == DType::F16 ? 4e-3 : 5e-5; }

void expect_matches(const Case& c, const Fused& got, const Result& ref, bool grads = true) {
  // Logits are f32 GEMM outputs of the rounded inputs in every dtype, so loss and lse are f32-accurate.
  EXPECT_NEAR(got.loss, ref.loss, 2e-5 * std::max(1.0, std::abs(ref.loss))) << "loss";
  EXPECT_LT(max_abs_error(got.lse, ref.lse), 1e-4) << "lse";
  if (!grads) return;
  if (!got.dh.empty()) EXPECT_LT(rel_norm_error(got.dh, ref.dh), grad_tol(c.dtype)) << "d_hidden";
  if (!got.dw.empty()) EXPECT_LT(rel_norm_error(got.dw, ref.dw), grad_tol(c.dtype)) << "d_weight";
}

void check_case(const Case& c, const RunOptions& o = {}) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed) + " dtype " + std::string(kestrel::dtype_name(c.dtype)));
  const Inputs in = make_inputs(c, seed);
  const Fused got = run_fused(c, in, o);
  const Result ref = cpu_reference(c, in);
  std::printf("  %-4s N=%lld V=%lld z=%g eps=%g: loss %.6f (ref %.6f), rel err d_hidden %.2e d_weight %.2e\n",
              std::string(kestrel::dtype_name(c.dtype)).c_str(), (long long)c.n, (long long)c.v, c.z_loss, c.eps,
              got.loss, ref.loss, got.dh.empty() ? 0.0 : rel_norm_error(got.dh, ref.dh),
              got.dw.empty() ? 0.0 : rel_norm_error(got.dw, ref.dw));
  expect_matches(c, got, ref, o.grads);
  EXPECT_EQ(got.flag, 0);
}

constexpr DType kAllTypes[] = {DType::F32, DType::BF16, DType::F16};

TEST(FusedLinearCrossEntropy, MatchesCpuReferenceEveryDtype) {
  KESTREL_REQUIRE_GPU();
  for (DType t : kAllTypes) { Case c; c.dtype = t; check_case(c); }
}

TEST(FusedLinearCrossEntropy, SingleTokenAndOddChunks) {
  KESTREL_REQUIRE_GPU();
  for (DType t : {DType::F32, DType::BF16}) {
    Case c; c.dtype = t; c.n = 1; c.ignore_frac = 0; c.v = 333; c.vocab_chunk = 40;
    check_case(c);
    Case d; d.dtype = t; d.v = 7; d.h = 5; d.vocab_chunk = 3; d.token_chunk = 1;  // chunk rounds to 8 > V
    check_case(d);
  }
}

TEST(FusedLinearCrossEntropy, AllIgnoredGivesZeroLossAndZeroGradients) {
  KESTREL_REQUIRE_GPU();
  for (DType t : {DType::F32, DType::BF16}) {
    Case c; c.dtype = t; c.ignore_frac = 1.0; c.token_weights = true;
    for (auto red : {CrossEntropyReduction::Mean, CrossEntropyReduction::Sum}) {
      c.reduction = red;
      const Inputs in = make_inputs(c, fresh_seed());
      const Fused got = run_fused(c, in);
      EXPECT_EQ(got.loss, 0.0);
      for (double g : got.dh) ASSERT_EQ(g, 0.0);
      for (double g : got.dw) ASSERT_EQ(g, 0.0);
      EXPECT_LT(max_abs_error(got.lse, cpu_reference(c, in).lse), 1e-4);  // lse is still reported
    }
  }
}

TEST(FusedLinearCrossEntropy, MixedIgnoredTokenWeightsSumAndMean) {
  KESTREL_REQUIRE_GPU();
  for (DType t : {DType::F32, DType::BF16}) {
    for (auto red : {CrossEntropyReduction::Mean, CrossEntropyReduction::Sum}) {
      Case c; c.dtype = t; c.ignore_frac = 0.4; c.token_weights = true; c.reduction = red; c.ignore_index = -1;
      check_case(c);
    }
  }
}

TEST(FusedLinearCrossEntropy, ZLossAndLabelSmoothing) {
  KESTREL_REQUIRE_GPU();
  for (DType t : kAllTypes) {
    Case c; c.dtype = t; c.z_loss = 0.05f; check_case(c);
    Case d; d.dtype = t; d.eps = 0.1f; d.token_weights = true; check_case(d);
    Case e; e.dtype = t; e.eps = 0.2f; e.z_loss = 1e-3f; e.reduction = CrossEntropyReduction::Sum; check_case(e);
  }
}

TEST(FusedLinearCrossEntropy, AccumulatesDWeightAndAppliesUpstreamGradient) {
  KESTREL_REQUIRE_GPU();
  for (DType t : {DType::F32, DType::BF16}) {
    Case c; c.dtype = t; c.eps = 0.1f;
    const uint64_t seed = fresh_seed();
    SCOPED_TRACE("seed " + std::to_string(seed));
    const Inputs in = make_inputs(c, seed);
    std::vector<double> init(c.v * c.h);
    std::mt19937_64 rng(seed + 1);
    std::normal_distribution<double> normal(0.0, 0.01);
    for (auto& e : init) e = double(float(normal(rng)));
    const float upstream = 0.37f;
    RunOptions o; o.dw_init = &init; o.upstream = &upstream;
    const Fused got = run_fused(c, in, o);
    Result ref = cpu_reference(c, in, upstream);
    ref.loss = cpu_reference(c, in).loss;  // the loss itself is not scaled
    for (size_t i = 0; i < init.size(); ++i) ref.dw[i] += init[i];
    expect_matches(c, got, ref);
  }
}

// What the training op's single pass runs (ops/cuda/cross_entropy.cu): a 16-bit d_weight added into
// by every token chunk's GEMM (37 tokens in chunks of 16: three roundings), on top of a held gradient,
// for an upstream gradient given on the device.
TEST(FusedLinearCrossEntropy, DWeightInTheInputDtypeAcrossTokenChunks) {
  KESTREL_REQUIRE_GPU();
  for (DType t : {DType::BF16, DType::F16}) {
    Case c; c.dtype = t; c.z_loss = 1e-3f;
    const uint64_t seed = fresh_seed();
    SCOPED_TRACE("seed " + std::to_string(seed) + " dtype " + std::string(kestrel::dtype_name(t)));
    const Inputs in = make_inputs(c, seed);
    std::vector<double> init(c.v * c.h);
    std::mt19937_64 rng(seed + 1);
    std::normal_distribution<double> normal(0.0, 1e-4);  // the size of the gradient it is added to
    for (auto& e : init) e = round_to(t, normal(rng));
    const float upstream = 0.25f;
    RunOptions o; o.dw_init = &init; o.upstream = &upstream; o.dw_in_dtype = true;
    const Fused got = run_fused(c, in, o);
    Result ref = cpu_reference(c, in, upstream);
    ref.loss = cpu_reference(c, in).loss;  // the loss itself is not scaled
    for (size_t i = 0; i < init.size(); ++i) ref.dw[i] += init[i];
    expect_matches(c, got, ref);
    EXPECT_EQ(got.flag, 0);
  }
}

TEST(FusedLinearCrossEntropy, ForwardOnlyAndSingleGradient) {
  KESTREL_REQUIRE_GPU();
  Case c; c.dtype = DType::BF16; c.token_chunk = 0; c.vocab_chunk = 0;  // default chunking
  RunOptions fwd; fwd.grads = false;
  check_case(c, fwd);
  RunOptions dh_only; dh_only.want_d_weight = false;
  check_case(c, dh_only);
  RunOptions dw_only; dw_only.want_d_hidden = false;
  check_case(c, dw_only);
}

TEST(FusedLinearCrossEntropy, OutOfRangeLabelSetsErrorFlagAndIsSkipped) {
  KESTREL_REQUIRE_GPU();
  Case c; c.dtype = DType::F32; c.ignore_frac = 0.1;
  Inputs in = make_inputs(c, fresh_seed());
  in.labels[3] = c.v + 3;
  in.labels[20] = -5;
  const Fused got = run_fused(c, in);
  EXPECT_EQ(got.flag, kestrel::cuda::kLabelOutOfRange);
  Inputs skipped = in;
  skipped.labels[3] = skipped.labels[20] = c.ignore_index;
  expect_matches(c, got, cpu_reference(c, skipped));
}

TEST(FusedLinearCrossEntropy, GraphCaptureRunsWithoutHostSync) {
  KESTREL_REQUIRE_GPU();
  Case c; c.dtype = DType::BF16; c.token_weights = true; c.z_loss = 1e-3f;
  RunOptions o; o.graph = true;
  check_case(c, o);
}

TEST(FusedLinearCrossEntropy, WorkspaceBoundHolds) {
  // Host-only: the production shape at V = 250k.
  FusedLinearCrossEntropyParams p;
  p.dtype = DType::BF16; p.tokens = 8192; p.hidden = 4096; p.vocab = 250000;
  p.d_hidden = reinterpret_cast<void*>(256);  // only non-null-ness matters for sizing
  for (size_t bound : {size_t(1) << 30, size_t(3) << 29}) {
    const auto ch = kestrel::cuda::pick_fused_linear_cross_entropy_chunks(p, bound);
    FusedLinearCrossEntropyParams q = p;
    ch.apply_to(q);
    EXPECT_LE(kestrel::cuda::fused_linear_cross_entropy_workspace_bytes(q), bound);
    EXPECT_GE(ch.token_chunk, 2048) << "bound " << bound;  // at most 4 token chunks
    EXPECT_GE(ch.vocab_chunk, 4000) << "bound " << bound;  // 4096 balanced over V: 4040
  }
  // Forward only keeps no row: all 8192 tokens in one chunk.
  FusedLinearCrossEntropyParams f = p;
  f.d_hidden = nullptr;
  EXPECT_EQ(kestrel::cuda::resolve_fused_linear_cross_entropy_chunks(f).token_chunk, 8192);
  EXPECT_LE(kestrel::cuda::fused_linear_cross_entropy_workspace_bytes(p), size_t(1) << 30);  // default
  EXPECT_THROW(kestrel::cuda::pick_fused_linear_cross_entropy_chunks(p, size_t(1) << 20), kestrel::Error);

  KESTREL_REQUIRE_GPU();
  Case c; c.dtype = DType::BF16;
  RunOptions o; o.workspace_bound = (size_t(4) << 20) + (size_t(96) << 10);  // cuBLASLt's tight 4 MiB + 96 KiB
  const Inputs in = make_inputs(c, fresh_seed());
  const Fused got = run_fused(c, in, o);
  EXPECT_LE(got.workspace, o.workspace_bound);
  expect_matches(c, got, cpu_reference(c, in));
}

TEST(FusedLinearCrossEntropy, FiniteDifferenceDHiddenF32) {
  KESTREL_REQUIRE_GPU();
  Case c; c.dtype = DType::F32; c.n = 4; c.h = 16; c.v = 300; c.ignore_frac = 0; c.z_loss = 0.01f; c.eps = 0.1f;
  c.reduction = CrossEntropyReduction::Sum; c.vocab_chunk = 64; c.token_chunk = 3;
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  Inputs in = make_inputs(c, seed);
  const Fused base = run_fused(c, in);
  RunOptions fwd; fwd.grads = false;
  const double step = 1e-2;
  for (int64_t idx : {int64_t(0), int64_t(5), int64_t(17), int64_t(33), int64_t(50), int64_t(63)}) {
    const double keep = in.x[idx];
    in.x[idx] = keep + step;
    const double up = run_fused(c, in, fwd).loss;
    in.x[idx] = keep - step;
    const double down = run_fused(c, in, fwd).loss;
    in.x[idx] = keep;
    const double fd = (up - down) / (2 * step);
    EXPECT_NEAR(base.dh[idx], fd, 2e-3 + 1e-2 * std::abs(fd)) << "d_hidden[" << idx << "]";
  }
}

// ---- naive float64 GPU reference: one thread per output element ----
template <class T> __device__ double to_double(T v) { return double(v); }
template <> __device__ double to_double<__nv_bfloat16>(__nv_bfloat16 v) { return double(__bfloat162float(v)); }
template <> __device__ double to_double<__half>(__half v) { return double(__half2float(v)); }

template <class T>
__global__ void naive_logits(const T* x, const T* w, double* out, int64_t n, int64_t h, int64_t v) {
  const int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (e >= n * v) return;
  const int64_t i = e / v, j = e % v;
  double d = 0;
  for (int64_t k = 0; k < h; ++k) d += to_double(x[i * h + k]) * to_double(w[j * h + k]);
  out[e] = d;
}
// Row i of logits becomes dloss/dlogits in place; token_loss[i] = w_i * loss_i.
__global__ void naive_rows(double* lg, const int64_t* labels, const float* tw, int64_t n, int64_t v, int64_t ignore,
                           double denom, bool mean, double z, double eps, double* token_loss) {
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  double* l = lg + i * v;
  double m = -INFINITY, s = 0, ls = 0;
  for (int64_t j = 0; j < v; ++j) { m = fmax(m, l[j]); ls += l[j]; }
  for (int64_t j = 0; j < v; ++j) s += exp(l[j] - m);
  const double lse = m + log(s);
  const int64_t y = labels[i];
  const bool valid = y != ignore && y >= 0 && y < v;
  const double w = tw ? tw[i] : 1.0;
  token_loss[i] = valid ? w * ((1 - eps) * (lse - l[y]) + eps * (lse - ls / v) + z * lse * lse) : 0.0;
  const double c = valid ? (mean ? w / denom : w) : 0.0;
  for (int64_t j = 0; j < v; ++j)
    l[j] = c * ((1 + 2 * z * lse) * exp(l[j] - lse) - eps / v - (j == y ? 1 - eps : 0.0));
}
// out[r, k] = sum_s g(r, s) * m[s, k], with g(r, s) = G[r, s] (transpose_g false) or G[s, r].
template <class T>
__global__ void naive_gemm(const double* g, const T* m, double* out, int64_t rows, int64_t inner, int64_t cols,
                           bool transpose_g, int64_t ld_g) {
  const int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (e >= rows * cols) return;
  const int64_t r = e / cols, k = e % cols;
  double d = 0;
  for (int64_t s = 0; s < inner; ++s) d += (transpose_g ? g[s * ld_g + r] : g[r * ld_g + s]) * to_double(m[s * cols + k]);
  out[e] = d;
}

template <class T>
Result naive_gpu_reference(const Case& c, const Inputs& in) {
  const size_t es = sizeof(T);
  DeviceBytes x(c.n * c.h * es), w(c.v * c.h * es), labels(c.n * 8), tw(c.n * 4), lg(c.n * c.v * 8),
      tl(c.n * 8), dh(c.n * c.h * 8), dw(c.v * c.h * 8);
  x.upload(encode(c.dtype, in.x).data());
  w.upload(encode(c.dtype, in.w).data());
  labels.upload(in.labels.data());
  if (!in.tw.empty()) tw.upload(in.tw.data());
  double denom = 0;
  for (int64_t i = 0; i < c.n; ++i)
    if (in.labels[i] != c.ignore_index && in.labels[i] >= 0 && in.labels[i] < c.v) denom += in.tw.empty() ? 1.0 : in.tw[i];
  const bool mean = c.reduction == CrossEntropyReduction::Mean;
  auto blocks = [](int64_t e) { return unsigned((e + 255) / 256); };
  naive_logits<T><<<blocks(c.n * c.v), 256>>>(x.as<T>(), w.as<T>(), lg.as<double>(), c.n, c.h, c.v);
  naive_rows<<<blocks(c.n), 256>>>(lg.as<double>(), labels.as<int64_t>(), in.tw.empty() ? nullptr : tw.as<float>(),
                                   c.n, c.v, c.ignore_index, denom, mean, c.z_loss, c.eps, tl.as<double>());
  naive_gemm<T><<<blocks(c.n * c.h), 256>>>(lg.as<double>(), w.as<T>(), dh.as<double>(), c.n, c.v, c.h, false, c.v);
  naive_gemm<T><<<blocks(c.v * c.h), 256>>>(lg.as<double>(), x.as<T>(), dw.as<double>(), c.v, c.n, c.h, true, c.v);
  KESTREL_CUDA_CHECK(cudaGetLastError());
  KESTREL_CUDA_CHECK(cudaDeviceSynchronize());
  Result r;
  std::vector<double> token_loss(c.n);
  tl.download(token_loss.data());
  for (double t : token_loss) r.loss += t;
  if (mean) r.loss = denom > 0 ? r.loss / denom : 0.0;
  r.dh.resize(c.n * c.h);
  r.dw.resize(c.v * c.h);
  dh.download(r.dh.data());
  dw.download(r.dw.data());
  return r;
}

TEST(FusedLinearCrossEntropy, MatchesNaiveGpuReferenceMediumSize) {
  KESTREL_REQUIRE_GPU();
  for (DType t : kAllTypes) {
    Case c; c.dtype = t; c.n = 300; c.h = 256; c.v = 5003; c.token_chunk = 128; c.vocab_chunk = 1024;
    c.ignore_frac = 0.1; c.token_weights = true; c.eps = 0.05f; c.z_loss = 1e-4f;
    const uint64_t seed = fresh_seed();
    SCOPED_TRACE("seed " + std::to_string(seed));
    const Inputs in = make_inputs(c, seed);
    const Fused got = run_fused(c, in);
    Result ref = t == DType::BF16  ? naive_gpu_reference<__nv_bfloat16>(c, in)
                 : t == DType::F16 ? naive_gpu_reference<__half>(c, in)
                                   : naive_gpu_reference<float>(c, in);
    ref.lse = got.lse;  // lse is checked against the CPU reference elsewhere
    expect_matches(c, got, ref);
  }
}

TEST(FusedLinearCrossEntropy, ScaleByDeviceScalar) {
  KESTREL_REQUIRE_GPU();
  for (DType t : kAllTypes) {
    std::vector<double> v(1003);
    std::mt19937_64 rng(fresh_seed());
    std::normal_distribution<double> normal(0.0, 1.0);
    for (auto& e : v) e = round_to(t, normal(rng));
    DeviceBytes d(v.size() * kestrel::dtype_size(t)), s(4);
    d.upload(encode(t, v).data());
    const float scale = -1.75f;
    s.upload(&scale);
    kestrel::cuda::scale_by_device_scalar(d.ptr, t, v.size(), s.as<float>(), nullptr);
    KESTREL_CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<uint8_t> b(d.bytes);
    d.download(b.data());
    const std::vector<double> got = decode(t, b);
    for (size_t i = 0; i < v.size(); ++i) ASSERT_EQ(got[i], round_to(t, v[i] * scale)) << i;
  }
}

}  // namespace
