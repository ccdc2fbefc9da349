// Shared by the FP8 producer tests (CPU and CUDA; kestrel/ops/fp8_producers.h): each producer run
// through its producer op and as its unfused composition (the plain op, then linear_fp8's own input
// cast, fp8_input_cast) on two identically seeded states, compared bit for bit (output, codes in both
// layouts, scales, the state's running amax), and the codes checked against the host's conversion
// of the output (float_to_fp8 of y * scale, the padding rows zero, the transposed copy the transpose).
#pragma once

#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "kernels/activation.h"
#include "kestrel/autograd/tape.h"
#include "kestrel/ops/activation.h"
#include "kestrel/ops/fp8.h"
#include "kestrel/ops/fp8_producers.h"
#include "kestrel/ops/norm.h"

namespace kestrel::testing {

enum class Producer { RmsNorm, AddRmsNorm, Swiglu };
inline const char* producer_name(Producer p) {
  return p == Producer::RmsNorm ? "rms_norm" : p == Producer::AddRmsNorm ? "add_rms_norm" : "swiglu";
}

// The input scale of linear `index` in a seeded producer_state: distinct per linear (and the weight and
// gradient rows others again), so a cast made with another row's scale shows.
inline float producer_input_scale(float scale, int64_t index) { return scale + static_cast<float>(index); }

// A state of `linears` linears on `d`: seeded (rolled once, with the scales above) or fresh; its running
// amax pre-filled with `amax0` (so the fold's max is exercised), observing as asked.
inline Fp8State producer_state(int64_t linears, Device d, bool seeded, float scale, float amax0, bool observing) {
  Fp8State st(linears, Fp8Recipe{}, d);
  if (seeded) {
    std::vector<float> scales(static_cast<size_t>(3 * linears));
    for (int64_t i = 0; i < linears; ++i) {
      scales[static_cast<size_t>(i)] = producer_input_scale(scale, i);
      scales[static_cast<size_t>(linears + i)] = 3.0f * scale;
      scales[static_cast<size_t>(2 * linears + i)] = 5.0f * scale;
    }
    st.load(Tensor::full({3 * linears, 16}, 448.0 / scale, DType::F32), Tensor::from_vector(scales, {3 * linears}), 1);
  }
  Tensor running = st.amax();  // shares the state's storage
  running.copy_(Tensor::full({3 * linears}, amax0, DType::F32));
  st.set_observing(observing);
  return st;
}

// The producer's inputs: {x, residual or up, weight} (weight undefined for SwiGLU).
struct ProducerInputs {
  Tensor a, b, w;
};

struct ProducerOut {
  Tensor y, h;  // h: add_rms_norm's residual stream only
  Fp8InputCast x8;
};

inline ProducerOut run_producer(Producer kind, bool fused, const ProducerInputs& in, Fp8State& st, int64_t index,
                                bool transposed, double eps = 1e-5) {
  switch (kind) {
    case Producer::RmsNorm: {
      if (fused) {
        Fp8Produced p = rms_norm_fp8(in.a, in.w, eps, st, index, transposed);
        return {p.y, Tensor(), p.x8};
      }
      Tensor y = rms_norm(in.a, in.w, eps);
      return {y, Tensor(), fp8_input_cast(y, st, index, transposed)};
    }
    case Producer::AddRmsNorm: {
      if (fused) {
        Fp8ProducedResidual p = add_rms_norm_fp8(in.a, in.b, in.w, eps, st, index, transposed);
        return {p.y, p.h, p.x8};
      }
      auto [y, h] = add_rms_norm(in.a, in.b, in.w, eps);
      return {y, h, fp8_input_cast(y, st, index, transposed)};
    }
    case Producer::Swiglu: {
      if (fused) {
        Fp8Produced p = swiglu_fp8(in.a, in.b, st, index, transposed);
        return {p.y, Tensor(), p.x8};
      }
      Tensor y = swiglu(in.a, in.b);
      return {y, Tensor(), fp8_input_cast(y, st, index, transposed)};
    }
  }
  return {};
}

inline std::vector<uint8_t> host_codes(const Tensor& t) {
  Tensor h = t.to(Device::cpu()).contiguous();
  return std::vector<uint8_t>(h.data<uint8_t>(), h.data<uint8_t>() + h.numel());
}

// The bit patterns of a float tensor's values (bf16 and f32 values are exact as f32).
inline std::vector<uint32_t> host_bits(const Tensor& t) {
  const std::vector<float> v = t.to(Device::cpu()).to_float_vector();
  std::vector<uint32_t> b(v.size());
  if (!v.empty()) std::memcpy(b.data(), v.data(), v.size() * 4);
  return b;
}

// a (fused) and b (unfused) agree bit for bit, and so do their states' running amax.
inline void expect_same_producer_output(const ProducerOut& a, const ProducerOut& b, const Fp8State& sa,
                                        const Fp8State& sb, const std::string& what) {
  EXPECT_EQ(host_bits(a.y), host_bits(b.y)) << what << ": y";
  if (b.h.defined()) EXPECT_EQ(host_bits(a.h), host_bits(b.h)) << what << ": h";
  ASSERT_TRUE(a.x8.defined() && b.x8.defined()) << what;
  EXPECT_EQ(a.x8.x8.plain.data.shape(), b.x8.x8.plain.data.shape()) << what;
  EXPECT_TRUE(host_codes(a.x8.x8.plain.data) == host_codes(b.x8.x8.plain.data)) << what << ": plain codes";
  ASSERT_EQ(a.x8.x8.transposed.data.defined(), b.x8.x8.transposed.data.defined()) << what;
  if (b.x8.x8.transposed.data.defined()) {
    EXPECT_EQ(a.x8.x8.transposed.data.shape(), b.x8.x8.transposed.data.shape()) << what;
    EXPECT_TRUE(host_codes(a.x8.x8.transposed.data) == host_codes(b.x8.x8.transposed.data))
        << what << ": transposed codes";
  }
  EXPECT_EQ(host_bits(a.x8.x8.plain.scales), host_bits(b.x8.x8.plain.scales)) << what << ": scales";
  EXPECT_EQ(host_bits(sa.amax()), host_bits(sb.amax())) << what << ": running amax";
  EXPECT_EQ(a.x8.index, b.x8.index) << what;
  EXPECT_EQ(a.x8.rolls, b.x8.rolls) << what;
}

// The codes are the host conversion of y (as stored) times `scale`: X8 [Tp, C] with zero padding
// rows, X8T its transpose; the scales {1 / scale, scale}.
inline void expect_codes_cast_y(const ProducerOut& o, float scale, const std::string& what) {
  const int64_t C = o.y.shape().back(), T = o.y.numel() / C, Tp = (T + 15) / 16 * 16;
  ASSERT_EQ(o.x8.x8.plain.data.shape(), (Shape{Tp, C})) << what;
  const std::vector<float> y = o.y.to(Device::cpu()).to_float_vector();
  const std::vector<uint8_t> p = host_codes(o.x8.x8.plain.data);
  int64_t bad = 0;
  for (int64_t r = 0; r < Tp; ++r)
    for (int64_t c = 0; c < C; ++c) {
      const uint8_t want = r < T ? float_to_fp8(y[r * C + c] * scale, Fp8Format::E4M3) : uint8_t{0};
      bad += p[r * C + c] != want;
    }
  EXPECT_EQ(bad, 0) << what << ": plain codes that are not the cast of y";
  if (o.x8.x8.transposed.data.defined()) {
    ASSERT_EQ(o.x8.x8.transposed.data.shape(), (Shape{C, Tp})) << what;
    const std::vector<uint8_t> t = host_codes(o.x8.x8.transposed.data);
    int64_t wrong = 0;
    for (int64_t r = 0; r < Tp; ++r)
      for (int64_t c = 0; c < C; ++c) wrong += t[c * Tp + r] != p[r * C + c];
    EXPECT_EQ(wrong, 0) << what << ": transposed codes that are not the plain ones transposed";
  }
  const std::vector<float> s = o.x8.x8.plain.scales.to(Device::cpu()).to_float_vector();
  EXPECT_EQ(s[1], scale) << what;
  EXPECT_EQ(s[0], 1.0f / scale) << what;
}

// A CPU stand-in for the fused kernel slot (kernels/activation.h swiglu_fp8_forward; the norms have
// none: their cast is a second pass), installed while this lives: it composes the CPU's plain kernel
// and cast (so the bits are the composition's) and counts its calls; `decline` makes it return false
// (the op's fallback). With it the CPU runs the op's fused-kernel branch, which CUDA takes: the
// decoder tests count the calls to see which forwards ran SwiGLU through it.
struct FusedKernelStandIns {
  static inline int swiglu_calls = 0;
  static inline bool decline = false;
  static bool swiglu(const Tensor& out, const Tensor& gate, const Tensor& up, const kernels::Fp8CastTarget& fp8) {
    ++swiglu_calls;
    if (decline) return false;
    kernels::swiglu_forward.cpu(out, gate, up);
    kernels::fp8_cast.cpu(out, fp8);
    return true;
  }
  explicit FusedKernelStandIns(bool decline_all = false) {
    swiglu_calls = 0;
    decline = decline_all;
    kernels::swiglu_fp8_forward.cpu = &swiglu;
  }
  ~FusedKernelStandIns() {
    kernels::swiglu_fp8_forward.cpu = nullptr;
  }
  FusedKernelStandIns(const FusedKernelStandIns&) = delete;
  FusedKernelStandIns& operator=(const FusedKernelStandIns&) = delete;
};

// gate/up + SwiGLU + down, forward and backward (the decoder's FP8 MLP): swiglu_gate_up_fp8 when
// `combined`, else linear_fp8 over {gate, up} then swiglu_fp8 (the separate entries); y's input cast by
// fp8_input_cast in both (linears 0 gate, 1 up, 2 down of `st`). `freeze_gate`: the gate weight needs
// no gradient. Returns the output, every leaf's gradient (undefined for a frozen one) and the state's
// running amax.
inline std::vector<Tensor> gated_mlp_fp8_step(bool combined, const Tensor& x0, const Tensor& wg0, const Tensor& wu0,
                                              const Tensor& wd0, const Tensor& dm, Fp8State& st,
                                              bool freeze_gate = false) {
  Tensor x = x0.clone().set_requires_grad(true), wg = wg0.clone().set_requires_grad(!freeze_gate),
         wu = wu0.clone().set_requires_grad(true), wd = wd0.clone().set_requires_grad(true);
  Fp8InputCast y8 = fp8_input_cast(x, st, 0, true);
  Fp8Produced s;
  if (combined) {
    s = swiglu_gate_up_fp8(x, wg, wu, st, 0, 1, 2, true, &y8);
  } else {
    std::vector<Tensor> gu = linear_fp8(x, {wg, wu}, {}, st, {0, 1}, &y8);
    s = swiglu_fp8(gu[0], gu[1], st, 2, true);
  }
  Tensor m = linear_fp8(s.y, wd, Tensor(), st, 2, &s.x8);
  autograd::backward({m}, {dm});
  return {m, x.grad(), wg.grad(), wu.grad(), wd.grad(), st.amax().clone()};
}

// Two gated_mlp_fp8_step results agree bit for bit, tensor by tensor.
inline void expect_same_step(const std::vector<Tensor>& a, const std::vector<Tensor>& b, const std::string& what) {
  const char* names[] = {"out", "dx", "dgate", "dup", "ddown", "amax"};
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t k = 0; k < a.size(); ++k) {
    ASSERT_EQ(a[k].defined(), b[k].defined()) << what << " " << names[k];
    if (a[k].defined()) EXPECT_EQ(host_bits(a[k]), host_bits(b[k])) << what << " " << names[k];
  }
}

}  // namespace kestrel::testing
