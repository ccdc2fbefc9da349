// The FP8 producers on the CPU (kestrel/ops/fp8_producers.h): rms_norm / add_rms_norm / swiglu with
// linear_fp8's input cast equal, bit for bit, the op followed by linear_fp8's own cast (the output,
// the codes in both layouts with their zero padding, the scales, the running amax) on ragged shapes,
// seeded and not, observing or not, and the codes are the host conversion of the output; linear_fp8
// given the produced cast equals linear_fp8 casting itself in its outputs, every gradient and the
// state's amax; a cast that does not fit the call is refused by name; SwiGLU's fused-kernel branch
// (a CPU stand-in for the CUDA kernel) and its fallback give the same bits, and the norms (whose
// cast is a second pass) never ask for a fused kernel.
#include <gtest/gtest.h>

#include <string>

#include "fp8_check.h"
#include "fp8_producer_check.h"
#include "kestrel/autograd/grad_mode.h"
#include "kestrel/autograd/tape.h"
#include "support/errors.h"
#include "support/numerics.h"

namespace kestrel::testing {
namespace {

constexpr Producer kProducers[] = {Producer::RmsNorm, Producer::AddRmsNorm, Producer::Swiglu};
constexpr float kScale = 200.0f;  // e4m3's 448 at |y| = 2.24: the largest outputs saturate

ProducerInputs producer_inputs(Producer kind, const Shape& shape, DType dt) {
  const int64_t C = shape.back();
  switch (kind) {
    case Producer::RmsNorm: return {randn(shape, dt, Device::cpu(), 2.0), Tensor(), randu({C}, 0.5, 1.5, dt)};
    case Producer::AddRmsNorm:
      return {randn(shape, dt, Device::cpu(), 2.0), randn(shape, dt), randu({C}, 0.5, 1.5, dt)};
    case Producer::Swiglu: return {randn(shape, dt, Device::cpu(), 2.0), randn(shape, dt), Tensor()};
  }
  return {};
}

TEST(Fp8Producers, EqualTheOpThenLinearFp8sCast) {
  const Shape shapes[] = {{1, 16}, {37, 48}, {64, 32}, {100, 80}, {2, 19, 32}};
  for (Producer kind : kProducers)
    for (DType dt : {DType::F32, DType::BF16})
      for (const Shape& shape : shapes)
        for (bool seeded : {true, false})
          for (bool observing : {true, false}) {
            const bool transposed = observing;  // both settings of each, without the full product
            const std::string what = std::string(producer_name(kind)) + " " + std::string(dtype_name(dt)) + " " +
                                     Tensor::empty(shape).str() + (seeded ? " seeded" : " unseeded") +
                                     (observing ? " observing" : " not observing");
            ProducerInputs in = producer_inputs(kind, shape, dt);
            Fp8State fa = producer_state(3, Device::cpu(), seeded, kScale, 0.5f, observing);
            Fp8State fb = producer_state(3, Device::cpu(), seeded, kScale, 0.5f, observing);
            ProducerOut fused = run_producer(kind, true, in, fa, 1, transposed);
            ProducerOut plain = run_producer(kind, false, in, fb, 1, transposed);
            expect_same_producer_output(fused, plain, fa, fb, what);
            EXPECT_EQ(fused.x8.x8.transposed.data.defined(), transposed) << what;
            const std::vector<float> y = fused.y.to_float_vector();
            const float scale = seeded ? producer_input_scale(kScale, 1) : ref_scale(ref_amax(y), Fp8Format::E4M3, 0);
            expect_codes_cast_y(fused, scale, what);
            // The input row of linear 1 (row 1) folds max |y|; the other rows keep their 0.5.
            const std::vector<float> amax = fa.amax().to_float_vector();
            EXPECT_EQ(amax[1], observing ? std::max(0.5f, ref_amax(y)) : 0.5f) << what;
            for (size_t r = 0; r < amax.size(); ++r)
              if (r != 1) EXPECT_EQ(amax[r], 0.5f) << what << " row " << r;
          }
}

// Forward and backward of producer -> linear_fp8 (q/k/v-like: two weights for the norms, one for
// SwiGLU), fused or not; returns the outputs and every leaf's gradient.
std::vector<Tensor> producer_linear_step(Producer kind, bool fused, const ProducerInputs& in0,
                                         const std::vector<Tensor>& ws0, const std::vector<Tensor>& dys,
                                         const Tensor& dh, Fp8State& st) {
  ProducerInputs in{in0.a.clone().set_requires_grad(true),
                    in0.b.defined() ? in0.b.clone().set_requires_grad(true) : Tensor(),
                    in0.w.defined() ? in0.w.clone().set_requires_grad(true) : Tensor()};
  std::vector<Tensor> ws;
  std::vector<int64_t> indices;
  for (size_t i = 0; i < ws0.size(); ++i) {
    ws.push_back(ws0[i].clone().set_requires_grad(true));
    indices.push_back(static_cast<int64_t>(i));
  }
  std::vector<Tensor> outs, grads;
  if (fused) {
    ProducerOut p = run_producer(kind, true, in, st, 0, fp8_input_needs_transposed(ws));
    outs = linear_fp8(p.y, ws, {}, st, indices, &p.x8);
    if (p.h.defined()) outs.push_back(p.h);
  } else {  // the op, then linear_fp8 casting its input itself
    ProducerOut p;
    if (kind == Producer::AddRmsNorm) {
      auto [y, h] = add_rms_norm(in.a, in.b, in.w, 1e-5);
      p.y = y, p.h = h;
    } else {
      p.y = kind == Producer::RmsNorm ? rms_norm(in.a, in.w, 1e-5) : swiglu(in.a, in.b);
    }
    outs = linear_fp8(p.y, ws, {}, st, indices);
    if (p.h.defined()) outs.push_back(p.h);
  }
  std::vector<Tensor> upstream = dys;
  if (kind == Producer::AddRmsNorm) upstream.push_back(dh);
  autograd::backward(outs, upstream);
  for (const Tensor& t : {in.a, in.b, in.w})
    if (t.defined()) grads.push_back(t.grad());
  for (const Tensor& w : ws) grads.push_back(w.grad());
  outs.insert(outs.end(), grads.begin(), grads.end());
  return outs;
}

TEST(Fp8Producers, LinearFp8GivenTheProducedCastEqualsItsOwnCast) {
  const int64_t T = 45;
  for (Producer kind : kProducers)
    for (DType dt : {DType::F32, DType::BF16}) {
      const int64_t C = kind == Producer::Swiglu ? 64 : 32;
      ProducerInputs in = producer_inputs(kind, {T, C}, dt);
      std::vector<Tensor> ws = {randn({48, C}, dt, Device::cpu(), 0.1)};
      if (kind != Producer::Swiglu) ws.push_back(randn({16, C}, dt, Device::cpu(), 0.1));
      std::vector<Tensor> dys;
      for (const Tensor& w : ws) dys.push_back(randn({T, w.shape()[0]}, dt));
      const Tensor dh = randn({T, C}, dt);
      Fp8State fa = producer_state(2, Device::cpu(), true, kScale, 0.0f, true);
      Fp8State fb = producer_state(2, Device::cpu(), true, kScale, 0.0f, true);
      const std::vector<Tensor> a = producer_linear_step(kind, true, in, ws, dys, dh, fa);
      const std::vector<Tensor> b = producer_linear_step(kind, false, in, ws, dys, dh, fb);
      ASSERT_EQ(a.size(), b.size());
      for (size_t i = 0; i < a.size(); ++i)
        EXPECT_EQ(host_bits(a[i]), host_bits(b[i])) << producer_name(kind) << " " << dtype_name(dt) << " result " << i;
      // Each role's amax (input once, weights, output gradients) folded exactly as without the producer.
      EXPECT_EQ(host_bits(fa.amax()), host_bits(fb.amax())) << producer_name(kind) << " " << dtype_name(dt);
      EXPECT_GT(fa.amax().to_float_vector()[0], 0.0f);  // the input row was observed
    }
}

TEST(Fp8Producers, LinearFp8RefusesACastThatDoesNotFit) {
  Fp8State st = producer_state(3, Device::cpu(), true, kScale, 0.0f, true);
  Fp8State other = producer_state(3, Device::cpu(), true, kScale, 0.0f, true);
  Tensor x = randn({32, 16}), w = randn({16, 16}).set_requires_grad(true), nw = randu({16}, 0.5, 1.5);
  auto cast_of = [&](Fp8State& s, int64_t index, bool transposed, const Tensor& in) {
    return rms_norm_fp8(in, nw, 1e-5, s, index, transposed);
  };
  Fp8Produced p = cast_of(st, 1, true, x);
  expect_has(error_of([&] { linear_fp8(p.y, w, Tensor(), st, 0, &p.x8); }),
             {"linear_fp8", "made for linear 1 of this FP8 state", "input row of linear 0"});
  expect_has(error_of([&] { linear_fp8(p.y, w, Tensor(), other, 1, &p.x8); }), {"linear_fp8", "another FP8 state"});
  Fp8Produced no_t = cast_of(st, 1, false, x);
  expect_has(error_of([&] { linear_fp8(no_t.y, w, Tensor(), st, 1, &no_t.x8); }),
             {"linear_fp8", "no transposed copy", "fp8_input_needs_transposed"});
  Tensor longer = randn({48, 16});
  expect_has(error_of([&] { linear_fp8(longer, w, Tensor(), st, 1, &p.x8); }),
             {"linear_fp8", "do not fit", "[48, 16]"});
  st.roll();
  expect_has(error_of([&] { linear_fp8(p.y, w, Tensor(), st, 1, &p.x8); }),
             {"linear_fp8", "made at roll 1", "rolled since (now 2)", "stale"});
  // The producers refuse what an FP8 GEMM operand cannot be.
  expect_has(error_of([&] { rms_norm_fp8(randn({8, 24}), randu({24}, 0.5, 1.5), 1e-5, st, 0, true); }),
             {"rms_norm_fp8", "multiple of 16", "[8, 24]"});
  expect_has(error_of([&] { swiglu_fp8(randn({8, 16}, DType::F64), randn({8, 16}, DType::F64), st, 0, true); }),
             {"swiglu_fp8", "bf16"});
  // Without grad mode no weight needs its gradient, so no transposed copy is needed.
  {
    autograd::NoGradGuard off;
    EXPECT_FALSE(fp8_input_needs_transposed({w}));
    Fp8Produced q = cast_of(st, 1, false, x);
    EXPECT_NO_THROW(linear_fp8(q.y, w, Tensor(), st, 1, &q.x8));
  }
  EXPECT_TRUE(fp8_input_needs_transposed({nw, w}));
  EXPECT_FALSE(fp8_input_needs_transposed({nw}));
}

TEST(Fp8Producers, FusedKernelBranchAndItsFallbackGiveTheSameBits) {
  for (bool decline : {false, true}) {
    FusedKernelStandIns standins(decline);
    for (Producer kind : kProducers) {
      ProducerInputs in = producer_inputs(kind, {37, 48}, DType::BF16);
      Fp8State fa = producer_state(2, Device::cpu(), true, kScale, 0.25f, true);
      Fp8State fb = producer_state(2, Device::cpu(), true, kScale, 0.25f, true);
      ProducerOut fused = run_producer(kind, true, in, fa, 1, true);
      ProducerOut plain = run_producer(kind, false, in, fb, 1, true);
      const std::string what = std::string(producer_name(kind)) + (decline ? " (declined)" : " (stand-in)");
      expect_same_producer_output(fused, plain, fa, fb, what);
      expect_codes_cast_y(fused, producer_input_scale(kScale, 1), what);
    }
    EXPECT_EQ(FusedKernelStandIns::swiglu_calls, 1);  // swiglu_fp8 only; the norms and the unfused ops never ask
  }
}

// swiglu_gate_up_fp8 (gate/up + SwiGLU as one tape entry) against linear_fp8 over {gate, up} then
// swiglu_fp8, followed by down in both: the output, every gradient and the running amax bit for bit
// (the CPU takes the entry's fallback: SwiGLU's backward, then the two casts), seeded or not, ragged
// token counts, f32 and bf16, a frozen gate weight; a gate/up shape mismatch is refused by name.
TEST(Fp8Producers, SwigluGateUpEqualsTheSeparateEntries) {
  const int64_t C = 32, I = 48;
  for (DType dt : {DType::F32, DType::BF16})
    for (int64_t T : {37, 64})
      for (bool seeded : {true, false})
        for (bool freeze_gate : {false, true}) {
          const std::string what = std::string(dtype_name(dt)) + " T=" + std::to_string(T) +
                                   (seeded ? " seeded" : " unseeded") + (freeze_gate ? " frozen gate" : "");
          Tensor x = randn({T, C}, dt, Device::cpu(), 1.5), wg = randn({I, C}, dt, Device::cpu(), 0.3),
                 wu = randn({I, C}, dt, Device::cpu(), 0.3), wd = randn({C, I}, dt, Device::cpu(), 0.2),
                 dm = randn({T, C}, dt);
          Fp8State fa = producer_state(3, Device::cpu(), seeded, kScale, 0.25f, true);
          Fp8State fb = producer_state(3, Device::cpu(), seeded, kScale, 0.25f, true);
          std::vector<Tensor> a = gated_mlp_fp8_step(true, x, wg, wu, wd, dm, fa, freeze_gate);
          std::vector<Tensor> b = gated_mlp_fp8_step(false, x, wg, wu, wd, dm, fb, freeze_gate);
          expect_same_step(a, b, what);
          EXPECT_EQ(a[2].defined(), !freeze_gate) << what;
        }
  Fp8State st = producer_state(3, Device::cpu(), true, kScale, 0.0f, true);
  expect_has(error_of([&] {
               swiglu_gate_up_fp8(randn({8, 16}), randn({32, 16}), randn({48, 16}), st, 0, 1, 2, true);
             }),
             {"swiglu_gate_up_fp8", "one shape"});
}

}  // namespace
}  // namespace kestrel::testing
