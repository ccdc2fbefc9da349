// Sliding-window attention on the GPU (AttentionOptions::window, FlashAttentionParams::window): the
// CUDA op against the CPU reference op (f64 accumulation, run in f32 on the same bf16/f16-rounded
// inputs), forward, lse and every gradient, with dtype-tied tolerances. Sizes straddle the kernels'
// tiles (forward 128/192 query rows x 128 keys, backward 128 keys x 64/128 queries) so windows start
// and end inside tiles, at their edges and one past them; packed documents of odd lengths, len_q !=
// len_k, GQA, head dims 64/128 (Hopper kernels), 72 (padded) and 136/256 (mma.sync kernels). Then a timing check that the window skips work: at 16k tokens a
// 512-token window must run far faster than full causal (the kernels skip the tiles outside it).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "cuda/flash_attention/flash_attention.h"
#include "kestrel/autograd/tape.h"
#include "kestrel/ops/attention.h"
#include "kestrel/ops/elementwise.h"
#include "kestrel/ops/reduce.h"
#include "kestrel/cuda/check.h"
#include "ops/attention_case_util.h"
#include "support/gpu.h"
#include "support/numerics.h"

namespace kestrel {
namespace {
using testing::randn;

struct WindowCase {
  std::vector<int64_t> len_q, len_k;
  int64_t hq, hkv, d, window;
};

using testing::cu_from;
using testing::max_of;
using testing::sum_of;
using testing::tol_grad;
using testing::tol_out;
using Outputs = testing::AttentionOutputs;

Outputs run_op(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& dout, const WindowCase& c, Device dev) {
  Tensor qd = q.to(dev).set_requires_grad(true), kd = k.to(dev).set_requires_grad(true);
  Tensor vd = v.to(dev).set_requires_grad(true);
  AttentionOptions o;
  o.window = c.window;
  AttentionOutput r = attention(qd, kd, vd, cu_from(c.len_q).to(dev), cu_from(c.len_k).to(dev), max_of(c.len_q),
                                max_of(c.len_k), o);
  autograd::backward(sum(mul(r.out, dout.to(dev))));
  auto host = [](const Tensor& t) { return t.to(Device::cpu()).to(DType::F32); };
  return Outputs{host(r.out), host(r.lse), host(qd.grad()), host(kd.grad()), host(vd.grad())};
}

void run_case(const WindowCase& c, DType dt) {
  SCOPED_TRACE(::testing::Message() << "window=" << c.window << " docs=" << c.len_q.size() << " Tq=" << sum_of(c.len_q)
                                    << " Tk=" << sum_of(c.len_k) << " Hq=" << c.hq << " Hkv=" << c.hkv << " D=" << c.d
                                    << " " << dtype_name(dt));
  // Inputs rounded to dt once; the reference runs on exactly those values in f32.
  Tensor q = randn({sum_of(c.len_q), c.hq, c.d}).to(dt), k = randn({sum_of(c.len_k), c.hkv, c.d}).to(dt);
  Tensor v = randn({sum_of(c.len_k), c.hkv, c.d}).to(dt), dout = randn({sum_of(c.len_q), c.hq, c.d}).to(dt);
  const Outputs ref = run_op(q.to(DType::F32), k.to(DType::F32), v.to(DType::F32), dout.to(DType::F32), c,
                             Device::cpu());
  const Outputs got = run_op(q, k, v, dout, c, Device::cuda(0));
  for (const Tensor* t : {&got.out, &got.dq, &got.dk, &got.dv}) EXPECT_TRUE(testing::all_finite(*t));
  const double e_out = testing::rel_l2(got.out, ref.out), e_dq = testing::rel_l2_floored(got.dq, ref.dq, 1e-3),
               e_dk = testing::rel_l2_floored(got.dk, ref.dk, 1e-3), e_dv = testing::rel_l2(got.dv, ref.dv);
  std::printf("[flash window] W=%-4lld D=%-3lld %s out %.2e dq %.2e dk %.2e dv %.2e\n",
              static_cast<long long>(c.window), static_cast<long long>(c.d), std::string(dtype_name(dt)).c_str(),
              e_out, e_dq, e_dk, e_dv);
  EXPECT_LE(e_out, tol_out(dt));
  EXPECT_LE(e_dq, tol_grad(dt));
  EXPECT_LE(e_dk, tol_grad(dt));
  EXPECT_LE(e_dv, tol_grad(dt));
  std::vector<float> lg = got.lse.to_float_vector(), lr = ref.lse.to_float_vector();
  size_t bad = 0;
  for (size_t i = 0; i < lr.size(); ++i) {
    if (std::isinf(lr[i])) bad += !(std::isinf(lg[i]) && lg[i] < 0);
    else bad += !(std::abs(lg[i] - lr[i]) <= 1e-3 * (1 + std::abs(lr[i])));
  }
  EXPECT_EQ(bad, 0u) << "lse rows off the reference (or not -inf where no key is visible)";
}

const std::vector<int64_t> kPack = {1000, 1, 333, 129, 64, 257};  // odd lengths, document ends mid-tile

TEST(FlashAttentionWindowCuda, DefaultKernelsTileEdges) {
  KESTREL_REQUIRE_GPU();
  for (int64_t d : {64, 128})
    for (int64_t w : {1, 63, 64, 65, 127, 128, 129, 191, 192, 193, 300})
      run_case({kPack, kPack, 4, 2, d, w}, w % 2 ? DType::BF16 : DType::F16);
}

TEST(FlashAttentionWindowCuda, CrossLengthsGqaAndPaddedHeadDims) {
  KESTREL_REQUIRE_GPU();
  // len_k > len_q: whole key tiles before every query's window (skipped: dk = dv = 0 there).
  for (int64_t d : {64, 128}) {
    run_case({{3, 200, 1, 129}, {150, 7, 300, 129}, 2, 1, d, 5}, DType::BF16);
    run_case({{3, 200, 1, 129}, {650, 7, 300, 129}, 8, 1, d, 100}, DType::F16);
  }
  run_case({{2049}, {2049}, 8, 1, 128, 256}, DType::BF16);  // GQA 8, windows aligned with no tile
  run_case({kPack, kPack, 4, 4, 72, 90}, DType::BF16);       // padded to the 128 kernels
  run_case({kPack, kPack, 2, 1, 256, 70}, DType::F16);       // mma.sync forward, 16-keys-per-warp backward
  run_case({kPack, kPack, 2, 2, 64, 100000}, DType::BF16);   // wider than every document: plain causal
}

// The mma.sync kernels (the path of head dims above 128, zero-padded to 256) on the same tile edges
// as the Hopper kernels above: 256 exact and 136 padded, one document pack and cross lengths.
TEST(FlashAttentionWindowCuda, MmaSyncKernelsTileEdges) {
  KESTREL_REQUIRE_GPU();
  for (int64_t d : {136, 256}) {
    for (int64_t w : {1, 63, 64, 65, 129}) run_case({kPack, kPack, 4, 2, d, w}, w % 2 ? DType::BF16 : DType::F16);
    run_case({{3, 200, 1, 129}, {150, 7, 300, 129}, 2, 1, d, 17}, DType::F16);
  }
}

// Mean forward and backward milliseconds of one causal bf16 document of T tokens (zero inputs: the
// kernels' work does not depend on the values), after a warm-up.
struct Timing {
  float fwd_ms, bwd_ms;
};
Timing time_causal(int T, int H, int D, int window) {
  const size_t n = static_cast<size_t>(T) * H * D;
  void *q, *k, *v, *out, *dout, *dq, *dk, *dv, *ws;
  float* lse;
  int32_t* cu;
  for (void** b : {&q, &k, &v, &out, &dout, &dq, &dk, &dv}) {
    KESTREL_CUDA_CHECK(cudaMalloc(b, n * 2));
    KESTREL_CUDA_CHECK(cudaMemset(*b, 0, n * 2));
  }
  KESTREL_CUDA_CHECK(cudaMalloc(&lse, static_cast<size_t>(T) * H * sizeof(float)));
  KESTREL_CUDA_CHECK(cudaMalloc(&cu, 2 * sizeof(int32_t)));
  const int32_t cu_h[2] = {0, T};
  KESTREL_CUDA_CHECK(cudaMemcpy(cu, cu_h, sizeof cu_h, cudaMemcpyHostToDevice));
  cuda::FlashAttentionParams p{q, k, v, out, lse, cu, cu, 1, T, T, H, H, D, 1.f / std::sqrt(static_cast<float>(D)),
                               true, cuda::AttnDType::BF16, T, T};
  p.window = window;
  const size_t ws_bytes = cuda::flash_attention_backward_workspace_bytes(p);
  KESTREL_CUDA_CHECK(cudaMalloc(&ws, ws_bytes));
  cuda::FlashAttentionBackwardParams bp{p, dout, dq, dk, dv, ws, ws_bytes};
  cudaEvent_t e0, e1, e2;
  KESTREL_CUDA_CHECK(cudaEventCreate(&e0));
  KESTREL_CUDA_CHECK(cudaEventCreate(&e1));
  KESTREL_CUDA_CHECK(cudaEventCreate(&e2));
  cuda::flash_attention_forward(p, nullptr);
  cuda::flash_attention_backward(bp, nullptr);
  constexpr int kReps = 5;
  KESTREL_CUDA_CHECK(cudaEventRecord(e0));
  for (int i = 0; i < kReps; ++i) cuda::flash_attention_forward(p, nullptr);
  KESTREL_CUDA_CHECK(cudaEventRecord(e1));
  for (int i = 0; i < kReps; ++i) cuda::flash_attention_backward(bp, nullptr);
  KESTREL_CUDA_CHECK(cudaEventRecord(e2));
  KESTREL_CUDA_CHECK(cudaEventSynchronize(e2));
  float f = 0, b = 0;
  KESTREL_CUDA_CHECK(cudaEventElapsedTime(&f, e0, e1));
  KESTREL_CUDA_CHECK(cudaEventElapsedTime(&b, e1, e2));
  for (cudaEvent_t e : {e0, e1, e2}) cudaEventDestroy(e);
  for (void* ptr : {q, k, v, out, dout, dq, dk, dv, ws, static_cast<void*>(lse), static_cast<void*>(cu)}) cudaFree(ptr);
  return Timing{f / kReps, b / kReps};
}

// At 16k tokens a 512-token window leaves ~6% of the causal score tiles: masking alone (visiting every
// causal tile) would keep the time near the full causal one, skipping brings it far below.
TEST(FlashAttentionWindowCuda, WindowSkipsTilesOutsideIt) {
  KESTREL_REQUIRE_GPU();
  for (int D : {64, 128}) {
    const Timing full = time_causal(16384, 16, D, 0), win = time_causal(16384, 16, D, 512);
    std::printf("[flash window] T=16384 H=16 D=%d: causal fwd %.3f ms bwd %.3f ms; "
                "window 512 fwd %.3f ms bwd %.3f ms\n",
                D, full.fwd_ms, full.bwd_ms, win.fwd_ms, win.bwd_ms);
    EXPECT_LT(win.fwd_ms, 0.3f * full.fwd_ms) << "D=" << D;
    EXPECT_LT(win.bwd_ms, 0.3f * full.bwd_ms) << "D=" << D;
  }
}

TEST(FlashAttentionWindowCuda, WindowNeedsCausal) {
  KESTREL_REQUIRE_GPU();
  cuda::FlashAttentionParams p{};
  int dummy[4];
  p.q = p.k = p.v = p.out = dummy;
  p.lse = reinterpret_cast<float*>(dummy);
  p.cu_seqlens_q = p.cu_seqlens_k = dummy;
  p.num_docs = 1, p.max_seqlen_q = p.max_seqlen_k = 4, p.num_heads_q = p.num_heads_kv = 1, p.head_dim = 64;
  p.total_q = p.total_k = 4;  // required token counts: only the window rule is wrong here
  p.causal = false;
  p.window = 3;
  try {
    cuda::flash_attention_forward(p, nullptr);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("sliding window is implemented for causal attention only"), std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace kestrel
