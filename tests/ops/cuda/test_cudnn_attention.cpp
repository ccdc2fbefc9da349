// cuDNN's fused flash attention as the second attention backend (AttentionOptions::backend = Cudnn,
// ops/cuda/cudnn_attention/): the CUDA op against the CPU reference op (f64 accumulation, the oracle
// of test_flash_attention_prefix.cpp too), run in f32 on the same bf16/f16-rounded inputs: out, lse
// and every gradient with the flash tests' dtype-tied budgets. Packs of odd lengths (not multiples
// of 64, one-token documents), GQA 32/8 and MHA, head dims 64/128, causal and bidirectional (also
// len_q != len_k), bf16 and f16; forward and backward on different backends; the refusals; the
// workspace charged to the Workspace tag and the handle's memory to External; both plan choices
// (CudnnPlanChoice First / Fastest) and the plan log. Skips without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "cuda/attention_backend.h"
#include "kernels/attention.h"
#include "kestrel/autograd/tape.h"
#include "kestrel/ops/attention.h"
#include "kestrel/ops/elementwise.h"
#include "kestrel/ops/reduce.h"
#include "kestrel/runtime/memory_trace.h"
#include "ops/attention_case_util.h"
#include "support/errors.h"
#include "support/gpu.h"
#include "support/numerics.h"

namespace kestrel {
namespace {
using testing::randn;

struct Case {
  std::vector<int64_t> len_q, len_k;
  int64_t hq, hkv, d;
  bool causal;
};

using testing::cu_from;
using testing::error_of;
using testing::max_of;
using testing::sum_of;
using testing::tol_grad;
using testing::tol_out;
using Outputs = testing::AttentionOutputs;

Tensor host(const Tensor& t) { return t.to(Device::cpu()).to(DType::F32); }

// The op on `dev`; self-attention (one cu_seqlens tensor) when len_q == len_k, as the decoder calls it.
Outputs run_op(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& dout, const Case& c, Device dev,
               AttentionBackend backend) {
  Tensor qd = q.to(dev).set_requires_grad(true), kd = k.to(dev).set_requires_grad(true);
  Tensor vd = v.to(dev).set_requires_grad(true);
  AttentionOptions o;
  o.causal = c.causal;
  o.backend = dev.is_cuda() ? backend : AttentionBackend::Auto;
  const Tensor cq = cu_from(c.len_q).to(dev), ck = c.len_q == c.len_k ? cq : cu_from(c.len_k).to(dev);
  AttentionOutput r = attention(qd, kd, vd, cq, ck, max_of(c.len_q), max_of(c.len_k), o);
  autograd::backward(sum(mul(r.out, dout.to(dev))));
  return Outputs{host(r.out), host(r.lse), host(qd.grad()), host(kd.grad()), host(vd.grad())};
}

struct Inputs {
  Tensor q, k, v, dout;  // CPU, in the case's dtype
};
Inputs make_inputs(const Case& c, DType dt) {
  return Inputs{randn({sum_of(c.len_q), c.hq, c.d}).to(dt), randn({sum_of(c.len_k), c.hkv, c.d}).to(dt),
                randn({sum_of(c.len_k), c.hkv, c.d}).to(dt), randn({sum_of(c.len_q), c.hq, c.d}).to(dt)};
}
Outputs reference(const Inputs& in, const Case& c) {
  auto f = [](const Tensor& t) { return t.to(DType::F32); };
  return run_op(f(in.q), f(in.k), f(in.v), f(in.dout), c, Device::cpu(), AttentionBackend::Auto);
}

std::string describe(const Case& c, DType dt) {
  char buf[160];
  std::snprintf(buf, sizeof buf, "docs=%zu Tq=%lld Tk=%lld Hq=%lld Hkv=%lld D=%lld %s %s", c.len_q.size(),
                static_cast<long long>(sum_of(c.len_q)), static_cast<long long>(sum_of(c.len_k)),
                static_cast<long long>(c.hq), static_cast<long long>(c.hkv), static_cast<long long>(c.d),
                c.causal ? "causal" : "bidir", std::string(dtype_name(dt)).c_str());
  return buf;
}

void expect_close(const Outputs& got, const Outputs& ref, DType dt, const std::string& what) {
  SCOPED_TRACE(what);
  for (const Tensor* t : {&got.out, &got.dq, &got.dk, &got.dv}) EXPECT_TRUE(testing::all_finite(*t));
  const double e_out = testing::rel_l2(got.out, ref.out), e_dq = testing::rel_l2_floored(got.dq, ref.dq, 1e-3),
               e_dk = testing::rel_l2_floored(got.dk, ref.dk, 1e-3), e_dv = testing::rel_l2(got.dv, ref.dv);
  std::printf("[cudnn attention] %-62s out %.2e dq %.2e dk %.2e dv %.2e\n", what.c_str(), e_out, e_dq, e_dk, e_dv);
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
  EXPECT_EQ(bad, 0u) << "lse rows off the reference";
}

void run_case(const Case& c, DType dt) {
  const Inputs in = make_inputs(c, dt);
  const Outputs ref = reference(in, c);
  const Outputs got = run_op(in.q, in.k, in.v, in.dout, c, Device::cuda(0), AttentionBackend::Cudnn);
  expect_close(got, ref, dt, describe(c, dt));
}

// Odd lengths: documents end mid-tile, one-token documents, none a multiple of 64 but one.
const std::vector<int64_t> kPack = {1000, 1, 333, 129, 64, 257};
const std::vector<int64_t> kSmallPack = {1, 17, 5, 130, 1, 63, 200};

TEST(CudnnAttentionCuda, MatchesReferenceMha) {
  KESTREL_REQUIRE_GPU();
  int i = 0;
  for (bool causal : {true, false})
    for (int64_t d : {64, 128}) {
      run_case({kPack, kPack, 4, 4, d, causal}, i++ % 2 ? DType::F16 : DType::BF16);
      run_case({{1}, {1}, 2, 2, d, causal}, DType::BF16);          // a single one-token document
      run_case({{777}, {777}, 2, 2, d, causal}, DType::F16);       // one document, not a multiple of 64
    }
}

TEST(CudnnAttentionCuda, MatchesReferenceGqa32x8) {
  KESTREL_REQUIRE_GPU();
  int i = 0;
  for (bool causal : {true, false})
    for (int64_t d : {64, 128}) run_case({kSmallPack, kSmallPack, 32, 8, d, causal}, i++ % 2 ? DType::BF16 : DType::F16);
}

TEST(CudnnAttentionCuda, BidirectionalCrossLengths) {
  KESTREL_REQUIRE_GPU();
  // len_q != len_k per document (separate cu_seqlens): the padding mask bounds each side.
  for (int64_t d : {64, 128}) run_case({{3, 200, 1, 129}, {150, 7, 300, 129}, 4, 2, d, false}, DType::BF16);
}

// Many documents and a long one in the same plan bucket twice: the cached plan is reused with a
// different document mix (B and S rounded up; rows past the documents have length 0).
TEST(CudnnAttentionCuda, PlanReuseAcrossDocumentMixes) {
  KESTREL_REQUIRE_GPU();
  run_case({{300, 1, 2, 700, 9}, {300, 1, 2, 700, 9}, 4, 2, 128, true}, DType::BF16);
  run_case({{650, 3, 100, 250, 1}, {650, 3, 100, 250, 1}, 4, 2, 128, true}, DType::BF16);
  run_case({{1, 1, 1, 1, 1, 1, 1, 1, 1, 600}, {1, 1, 1, 1, 1, 1, 1, 1, 1, 600}, 4, 2, 128, true}, DType::BF16);
}

// Forward on one backend, backward on the other (kernel slots called directly with each backend):
// both use the same lse convention, so the gradients match the reference either way.
TEST(CudnnAttentionCuda, MixedBackendsAgree) {
  KESTREL_REQUIRE_GPU();
  const Device dev = Device::cuda(0);
  for (bool causal : {true, false}) {
    const Case c{kSmallPack, kSmallPack, 8, 2, 128, causal};
    const DType dt = DType::BF16;
    const Inputs in = make_inputs(c, dt);
    const Outputs ref = reference(in, c);
    const Tensor q = in.q.to(dev), k = in.k.to(dev), v = in.v.to(dev), dout = in.dout.to(dev);
    const Tensor cu = cu_from(c.len_q).to(dev);
    kernels::AttentionParams p;
    p.max_seqlen_q = p.max_seqlen_k = max_of(c.len_q);
    p.softmax_scale = 1.0 / std::sqrt(static_cast<double>(c.d));
    p.causal = causal;
    for (auto [fwd, bwd] : {std::pair{AttentionBackend::Kestrel, AttentionBackend::Cudnn},
                            std::pair{AttentionBackend::Cudnn, AttentionBackend::Kestrel}}) {
      Tensor out = Tensor::empty(q.shape(), dt, dev), lse = Tensor::empty({q.shape()[0], c.hq}, DType::F32, dev);
      Tensor dq = Tensor::empty(q.shape(), dt, dev), dk = Tensor::empty(k.shape(), dt, dev),
             dv = Tensor::empty(v.shape(), dt, dev);
      p.backend = fwd;
      kernels::dispatch(kernels::attention_forward, "attention", dev, out, lse, q, k, v, cu, cu, p);
      p.backend = bwd;
      kernels::dispatch(kernels::attention_backward, "attention_backward", dev, dq, dk, dv, dout, q, k, v, out, lse,
                        cu, cu, p);
      const Outputs got{host(out), host(lse), host(dq), host(dk), host(dv)};
      expect_close(got, ref, dt,
                   std::string("fwd ") + attention_backend_name(fwd) + " bwd " + attention_backend_name(bwd) +
                       (causal ? " causal" : " bidir"));
    }
  }
}

// Sets the cuDNN backend's plan choice for a scope (process-wide; restored to what it was).
struct PlanChoiceScope {
  cuda_ops::CudnnPlanChoice saved = cuda_ops::cudnn_plan_choice();
  explicit PlanChoiceScope(cuda_ops::CudnnPlanChoice c) { cuda_ops::set_cudnn_plan_choice(c); }
  ~PlanChoiceScope() { cuda_ops::set_cudnn_plan_choice(saved); }
};

// Both plan choices build their own plans (the cache is keyed by the choice): the first config of
// heuristics mode A, and the fastest of up to 8 candidates timed on the call's buffers (the timing
// runs overwrite out / lse / dq / dk / dv, so the result must still match the reference).
TEST(CudnnAttentionCuda, BothPlanChoicesMatchReference) {
  KESTREL_REQUIRE_GPU();
  for (auto choice : {cuda_ops::CudnnPlanChoice::First, cuda_ops::CudnnPlanChoice::Fastest}) {
    PlanChoiceScope scope(choice);
    SCOPED_TRACE(cuda_ops::cudnn_plan_choice_name(choice));
    int i = 0;
    for (int64_t d : {64, 128}) {
      run_case({kSmallPack, kSmallPack, 32, 8, d, true}, i++ % 2 ? DType::F16 : DType::BF16);
      run_case({kPack, kPack, 4, 4, d, false}, DType::BF16);
    }
    run_case({{3, 200, 1, 129}, {150, 7, 300, 129}, 4, 2, 64, false}, DType::F16);
  }
}

// A call in a new bucket logs its forward and backward plans: the bucket, the engine chosen (its
// global index), and, with Fastest, every candidate's time, the chosen one the fastest.
TEST(CudnnAttentionCuda, PlanLogNamesTheChosenEngine) {
  KESTREL_REQUIRE_GPU();
  for (auto choice : {cuda_ops::CudnnPlanChoice::First, cuda_ops::CudnnPlanChoice::Fastest}) {
    PlanChoiceScope scope(choice);
    const size_t before = cuda_ops::cudnn_attention_plan_log(0).size();
    const Case c{{500, 12, 300}, {500, 12, 300}, 6, 2, 96, true};  // Hq 6 / D 96: no other test's bucket
    const Inputs in = make_inputs(c, DType::BF16);
    run_op(in.q, in.k, in.v, in.dout, c, Device::cuda(0), AttentionBackend::Cudnn);
    const std::vector<cuda_ops::CudnnPlanRecord> log = cuda_ops::cudnn_attention_plan_log(0);
    ASSERT_EQ(log.size(), before + 2) << "one forward and one backward plan built";
    const std::vector<cuda_ops::CudnnPlanRecord> added(log.begin() + static_cast<std::ptrdiff_t>(before), log.end());
    std::printf("[cudnn attention] plan log (%s):\n%s", cuda_ops::cudnn_plan_choice_name(choice),
                cuda_ops::format_cudnn_plan_log(added).c_str());
    for (const cuda_ops::CudnnPlanRecord& r : added) {
      SCOPED_TRACE(std::string(r.backward ? "backward " : "forward ") + cuda_ops::cudnn_plan_choice_name(choice));
      EXPECT_EQ(r.choice, choice);
      EXPECT_EQ(r.dtype, "bf16");
      EXPECT_EQ(r.hq, 6);
      EXPECT_EQ(r.hkv, 2);
      EXPECT_EQ(r.d, 96);
      EXPECT_EQ(r.b, 3);
      EXPECT_GE(r.sq, 500);
      EXPECT_EQ(r.docs, 3);
      EXPECT_EQ(r.tokens_q, 812);
      EXPECT_GT(r.build_ms, 0.0) << "the plan's host build time";
      ASSERT_FALSE(r.candidates.empty());
      ASSERT_GE(r.chosen, 0);
      ASSERT_LT(r.chosen, static_cast<int>(r.candidates.size()));
      const cuda_ops::CudnnPlanCandidate& got = r.candidates[static_cast<size_t>(r.chosen)];
      EXPECT_GE(got.engine, 0) << "the chosen engine's CUDNN_ATTR_ENGINE_GLOBAL_INDEX";
      EXPECT_NE(cuda_ops::format_cudnn_plan_log({r}).find("engine " + std::to_string(got.engine)), std::string::npos);
      if (choice == cuda_ops::CudnnPlanChoice::First) {
        EXPECT_EQ(r.candidates.size(), 1u);
        EXPECT_EQ(r.chosen, 0);
        EXPECT_EQ(got.heuristics, "A");
      } else if (r.candidates.size() > 1) {
        EXPECT_GT(got.ms, 0) << "the chosen plan was timed";
        for (const cuda_ops::CudnnPlanCandidate& other : r.candidates)
          if (other.ms >= 0) EXPECT_LE(got.ms, other.ms);
      }
    }
  }
}

// Explicit cudnn refuses what it cannot run, naming it; Auto runs Kestrel's kernels there.
TEST(CudnnAttentionCuda, RefusalsNameWhatIsUnsupported) {
  KESTREL_REQUIRE_GPU();
  const Device dev = Device::cuda(0);
  const std::vector<int64_t> lens = {100, 28};
  auto call = [&](AttentionOptions o, DType dt, int64_t d, bool separate_cu = false) {
    Tensor q = randn({128, 4, d}).to(dt).to(dev), k = randn({128, 2, d}).to(dt).to(dev);
    Tensor v = randn({128, 2, d}).to(dt).to(dev);
    const Tensor cq = cu_from(lens).to(dev), ck = separate_cu ? cu_from(lens).to(dev) : cq;
    attention(q, k, v, cq, ck, 100, 100, o);
  };
  auto refused = [&](AttentionOptions o, DType dt, int64_t d, const char* needle, bool separate_cu = false) {
    o.backend = AttentionBackend::Cudnn;
    const std::string e = error_of([&] { call(o, dt, d, separate_cu); });
    EXPECT_NE(e.find("backend cudnn"), std::string::npos) << e;
    EXPECT_NE(e.find(needle), std::string::npos) << e;
    o.backend = AttentionBackend::Auto;  // Auto falls back to Kestrel's kernels
    if (dt != DType::F32) EXPECT_NO_THROW(call(o, dt, d, separate_cu)) << needle;
  };
  AttentionOptions window;
  window.window = 16;
  refused(window, DType::BF16, 64, "sliding window");
  AttentionOptions prefix;
  prefix.prefix_len = Tensor::from_vector(std::vector<int64_t>{10, 3}, {2}, DType::I32).to(dev);
  refused(prefix, DType::BF16, 64, "prefix_len");
  AttentionOptions det;
  det.deterministic = true;
  refused(det, DType::BF16, 128, "deterministic");
  refused(AttentionOptions{}, DType::F32, 64, "dtype f32");
  refused(AttentionOptions{}, DType::BF16, 256, "head_dim 256");
  refused(AttentionOptions{}, DType::BF16, 64, "one cu_seqlens tensor", /*separate_cu=*/true);
  {
    AttentionOptions o;
    o.causal = false;
    o.backend = AttentionBackend::Cudnn;
    o.block_mask = block_mask_from_predicate(128, 128, [](int64_t i, int64_t j) { return j <= i; }).to(dev);
    Tensor q = randn({128, 4, 64}).to(DType::BF16).to(dev), k = randn({128, 2, 64}).to(DType::BF16).to(dev);
    const Tensor cu = cu_from({128}).to(dev);
    const std::string e = error_of([&] { attention(q, k, k, cu, cu, 128, 128, o); });
    EXPECT_NE(e.find("block_mask"), std::string::npos) << e;
  }
  {
    AttentionOptions o;
    o.backend = AttentionBackend::Cudnn;
    Tensor q = randn({8, 2, 64}), cu = cu_from({8});
    const std::string e = error_of([&] { attention(q, q, q, cu, cu, 8, 8, o); });
    EXPECT_NE(e.find("CUDA devices only"), std::string::npos) << e;
  }
}

// The backward's workspace comes from the caching allocator under the Workspace tag (its dq
// accumulator alone is total_q * Hq * D * 4 bytes), and the handle's and kernels' device memory is
// charged as External.
TEST(CudnnAttentionCuda, WorkspaceAndHandleAreCharged) {
  KESTREL_REQUIRE_GPU();
  const Case c{kSmallPack, kSmallPack, 8, 2, 128, true};
  const Inputs in = make_inputs(c, DType::BF16);
  MemoryTrace& trace = memory_trace(Device::cuda(0));
  const int64_t ws_before = trace.snapshot().tags[static_cast<int>(MemoryTag::Workspace)].allocated_bytes;
  run_op(in.q, in.k, in.v, in.dout, c, Device::cuda(0), AttentionBackend::Cudnn);
  const MemorySnapshot after = trace.snapshot();
  const TagStats& ws = after.tags[static_cast<int>(MemoryTag::Workspace)];
  EXPECT_GT(ws.peak, 0);
  EXPECT_GE(ws.allocated_bytes - ws_before, sum_of(c.len_q) * c.hq * c.d * 4)
      << "the cuDNN backward's workspace did not come from the allocator under MemoryTag::Workspace";
  const int64_t handle_bytes = cuda_ops::cudnn_attention_external_bytes(0);
  std::printf("[cudnn attention] handle + kernels charged as External: %lld bytes (External now %lld)\n",
              static_cast<long long>(handle_bytes), static_cast<long long>(after.external));
  EXPECT_GT(handle_bytes, 0);
  EXPECT_GE(after.external, handle_bytes);
}

}  // namespace
}  // namespace kestrel
