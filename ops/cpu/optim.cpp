// CPU optimizer kernels: AdamW (torch.optim.AdamW arithmetic, f32 for f32 params; f32 on the widened
// value for a 16-bit parameter without a master), AdamW on 8-bit block-wise moments (adamw_q8.h),
// 16-bit parameter copies by round-to-nearest or stochastic rounding from the Philox stream, and the sums of squares
// and in-place scaling behind global-norm clipping (f64 accumulation, fixed blocks so the result
// does not depend on the thread count).
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "kernels/optim.h"
#include "kestrel/ops/adamw_q8.h"
#include "kestrel/runtime/dtype_dispatch.h"
#include "kestrel/runtime/parallel.h"
#include "kestrel/runtime/philox.h"

namespace kestrel::cpu {
namespace {

constexpr int64_t kBlock = 16384;

// Stochastic rounding of x (finite) to a 16-bit format with bit-level neighbours: the two values lo < |x| < hi
// around |x| are consecutive bit patterns, and hi is chosen with probability (|x| - lo) / (hi - lo).
template <typename T16>
T16 round_stochastic(float x, float u) {
  T16 nearest(x);
  if (!std::isfinite(x)) return nearest;
  float a = std::fabs(x);
  uint16_t sign = std::signbit(x) ? 0x8000u : 0u;
  uint16_t hb = T16(a).bits;  // magnitude bits of the nearest value
  float h = static_cast<float>(T16::from_bits(hb));
  if (h == a) return nearest;
  uint16_t lo_b = h < a ? hb : static_cast<uint16_t>(hb - 1);
  uint16_t hi_b = static_cast<uint16_t>(lo_b + 1);
  float lo = static_cast<float>(T16::from_bits(lo_b)), hi = static_cast<float>(T16::from_bits(hi_b));
  if (!std::isfinite(hi)) return nearest;  // beyond the largest finite value: no upper neighbour
  double p_hi = (static_cast<double>(a) - lo) / (static_cast<double>(hi) - lo);
  uint16_t b = u < p_hi ? hi_b : lo_b;
  return T16::from_bits(static_cast<uint16_t>(b | sign));
}

template <typename P>
void write_copy(const Tensor& copy, int64_t i, P value, uint64_t seed) {
  float x = static_cast<float>(value);
  switch (copy.dtype()) {
    case DType::BF16:
      copy.data<bf16>()[i] = seed ? round_stochastic<bf16>(x, philox_uniform(seed, 0, i)) : bf16(x);
      break;
    case DType::F16:
      copy.data<f16>()[i] = seed ? round_stochastic<f16>(x, philox_uniform(seed, 0, i)) : f16(x);
      break;
    case DType::F32: copy.data<float>()[i] = x; break;
    case DType::F64: copy.data<double>()[i] = static_cast<double>(value); break;
    default: break;
  }
}

// The gradient value the step uses: g, or g * grad_scale rounded to G as scale_in_place_cpu rounds it.
template <typename G>
struct GradReader {
  const G* g;
  double s = 1.0;
  bool scaled = false;
  explicit GradReader(const kernels::AdamWTensors& t) : g(t.grad.data<G>()) {
    if (t.grad_scale.defined()) {  // an f64 in an 8-byte slot
      std::memcpy(&s, t.grad_scale.data_ptr(), sizeof(double));
      scaled = s != 1.0;
    }
  }
  double operator[](int64_t i) const {
    return scaled ? elem_to_double(elem_from_double<G>(elem_to_double(g[i]) * s)) : elem_to_double(g[i]);
  }
};

template <typename P, typename G>
void adamw_typed(const kernels::AdamWTensors& t, const kernels::AdamWHyper& h) {
  using C = compute_t<P>;
  const int64_t n = t.param.numel();
  P* p = t.param.data<P>();
  P* m = t.m.data<P>();
  P* v = t.v.data<P>();
  const GradReader<G> g(t);
  const double bc1 = 1.0 - std::pow(h.beta1, static_cast<double>(h.step));
  const double bc2 = 1.0 - std::pow(h.beta2, static_cast<double>(h.step));
  const C decay = static_cast<C>(1.0 - h.lr * h.weight_decay), b1 = static_cast<C>(h.beta1),
          b2 = static_cast<C>(h.beta2), step_size = static_cast<C>(h.lr / bc1),
          bc2_sqrt = static_cast<C>(std::sqrt(bc2)), eps = static_cast<C>(h.eps);
  parallel_for(0, n, kBlock, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      C gi = static_cast<C>(g[i]);
      C pi = p[i] * decay;
      C mi = b1 * m[i] + (1 - b1) * gi;
      C vi = b2 * v[i] + (1 - b2) * gi * gi;
      pi -= step_size * mi / (std::sqrt(vi) / bc2_sqrt + eps);
      p[i] = pi;
      m[i] = mi;
      v[i] = vi;
      if (t.param_copy.defined()) write_copy(t.param_copy, i, pi, t.stochastic_rounding_seed);
    }
  });
}

// The f32 constants of one step, computed as adamw_typed<float> computes them.
struct StepConstants {
  float decay, b1, b2, step_size, bc2_sqrt, eps;
  explicit StepConstants(const kernels::AdamWHyper& h) {
    const double bc1 = 1.0 - std::pow(h.beta1, static_cast<double>(h.step));
    const double bc2 = 1.0 - std::pow(h.beta2, static_cast<double>(h.step));
    decay = static_cast<float>(1.0 - h.lr * h.weight_decay);
    b1 = static_cast<float>(h.beta1);
    b2 = static_cast<float>(h.beta2);
    step_size = static_cast<float>(h.lr / bc1);
    bc2_sqrt = static_cast<float>(std::sqrt(bc2));
    eps = static_cast<float>(h.eps);
  }
};

// The parameter's current value in f32 (an f32 master, or a bf16/f16 parameter without one).
float load_param(const Tensor& p, int64_t i) {
  switch (p.dtype()) {
    case DType::BF16: return static_cast<float>(p.data<bf16>()[i]);
    case DType::F16: return static_cast<float>(p.data<f16>()[i]);
    default: return p.data<float>()[i];
  }
}

// Stores the updated value: into the f32 master (and its copy), or, without a master, into the
// 16-bit parameter itself, rounded as the copy would be.
void store_param(const kernels::AdamWTensors& t, int64_t i, float x) {
  if (t.param.dtype() == DType::F32) {
    t.param.data<float>()[i] = x;
    if (t.param_copy.defined()) write_copy(t.param_copy, i, x, t.stochastic_rounding_seed);
  } else {
    write_copy(t.param, i, x, t.stochastic_rounding_seed);
  }
}

// A 16-bit parameter without a master: the f32 arithmetic of adamw_typed<float> on its widened value.
template <typename G>
void adamw_no_master(const kernels::AdamWTensors& t, const kernels::AdamWHyper& h) {
  const StepConstants c(h);
  float* m = t.m.data<float>();
  float* v = t.v.data<float>();
  const GradReader<G> g(t);
  parallel_for(0, t.param.numel(), kBlock, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      float gi = static_cast<float>(g[i]);
      float pi = load_param(t.param, i) * c.decay;
      float mi = c.b1 * m[i] + (1 - c.b1) * gi;
      float vi = c.b2 * v[i] + (1 - c.b2) * gi * gi;
      pi -= c.step_size * mi / (std::sqrt(vi) / c.bc2_sqrt + c.eps);
      m[i] = mi;
      v[i] = vi;
      store_param(t, i, pi);
    }
  });
}

void adamw_cpu(const std::vector<kernels::AdamWTensors>& tensors, const kernels::AdamWHyper& h) {
  for (const kernels::AdamWTensors& t : tensors) {
    dispatch_floating(t.grad.dtype(), "adamw_step", [&](auto gtag) {
      using G = decltype(gtag);
      if (t.param.dtype() == DType::F64)
        adamw_typed<double, G>(t, h);
      else if (t.param.dtype() == DType::F32)
        adamw_typed<float, G>(t, h);
      else
        adamw_no_master<G>(t, h);
    });
  }
}

// 8-bit moments, one quantisation block at a time: dequantise, the f32 update (as adamw_no_master /
// adamw_typed<float>, operation by operation), then the block's new absmax and codes.
template <typename G>
void adamw_q8_typed(const kernels::AdamWQ8Tensors& t, const kernels::AdamWHyper& h) {
  const StepConstants c(h);
  const int64_t n = t.param.numel();
  const G* g = t.grad.data<G>();
  uint8_t* mc = t.m_codes.data<uint8_t>();
  uint8_t* vc = t.v_codes.data<uint8_t>();
  float* ms = t.m_scale.data<float>();
  float* vs = t.v_scale.data<float>();
  const uint64_t mseed = q8::m_stream(t.moment_seed), vseed = q8::v_stream(t.moment_seed);
  const kernels::AdamWTensors pt{t.param, Tensor(), Tensor(), Tensor(), t.param_copy, t.stochastic_rounding_seed};
  parallel_for(0, q8::num_blocks(n), 1, [&](int64_t kb, int64_t ke) {
    float mnew[q8::kBlock], vnew[q8::kBlock];
    for (int64_t k = kb; k < ke; ++k) {
      const int64_t base = k * q8::kBlock, len = std::min(q8::kBlock, n - base);
      const float sm = ms[k], sv = vs[k];
      float am = 0.0f, av = 0.0f;
      for (int64_t j = 0; j < len; ++j) {
        const int64_t i = base + j;
        float gi = static_cast<float>(elem_to_double(g[i]));
        float pi = load_param(t.param, i) * c.decay;
        float mi = c.b1 * (q8::decode_m(mc[i]) * sm) + (1 - c.b1) * gi;
        float vi = c.b2 * (q8::decode_v(vc[i]) * sv) + (1 - c.b2) * gi * gi;
        pi -= c.step_size * mi / (std::sqrt(vi) / c.bc2_sqrt + c.eps);
        store_param(pt, i, pi);
        mnew[j] = mi;
        vnew[j] = vi;
        am = q8::absmax_step(am, mi);
        av = q8::absmax_step(av, vi);
      }
      ms[k] = am;
      vs[k] = av;
      for (int64_t j = 0; j < len; ++j) {
        const int64_t i = base + j;
        mc[i] = am > 0.0f ? q8::encode_m(mnew[j], am, q8::uniform_or_half(mseed, i)) : 0;
        vc[i] = av > 0.0f ? q8::encode_v(vnew[j], av, q8::uniform_or_half(vseed, i)) : 0;
      }
    }
  });
}

void adamw_q8_cpu(const std::vector<kernels::AdamWQ8Tensors>& tensors, const kernels::AdamWHyper& h) {
  for (const kernels::AdamWQ8Tensors& t : tensors)
    dispatch_floating(t.grad.dtype(), "adamw_step_q8", [&](auto gtag) { adamw_q8_typed<decltype(gtag)>(t, h); });
}

double sum_squares_cpu(const std::vector<Tensor>& tensors) {
  double total = 0;
  for (const Tensor& x : tensors) {
    const int64_t n = x.numel(), blocks = (n + kBlock - 1) / kBlock;
    std::vector<double> partial(blocks, 0.0);
    dispatch_floating(x.dtype(), "global_grad_norm", [&](auto tag) {
      using T = decltype(tag);
      const T* px = x.data<T>();
      parallel_for(0, blocks, 1, [&](int64_t b, int64_t e) {
        for (int64_t k = b; k < e; ++k) {
          double s = 0;
          for (int64_t i = k * kBlock; i < std::min(n, (k + 1) * kBlock); ++i) {
            double xi = elem_to_double(px[i]);
            s += xi * xi;
          }
          partial[k] = s;
        }
      });
    });
    for (double s : partial) total += s;
  }
  return total;
}

void scale_in_place_cpu(const std::vector<Tensor>& tensors, double s) {
  for (const Tensor& x : tensors) {
    dispatch_floating(x.dtype(), "clip_grad_norm", [&](auto tag) {
      using T = decltype(tag);
      T* px = x.data<T>();
      parallel_for(0, x.numel(), kBlock, [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) px[i] = elem_from_double<T>(elem_to_double(px[i]) * s);
      });
    });
  }
}

}  // namespace

KESTREL_REGISTER_KERNEL(adamw, cpu, adamw_cpu);
KESTREL_REGISTER_KERNEL(adamw_q8, cpu, adamw_q8_cpu);
KESTREL_REGISTER_KERNEL(sum_squares, cpu, sum_squares_cpu);
KESTREL_REGISTER_KERNEL(scale_in_place, cpu, scale_in_place_cpu);

}  // namespace kestrel::cpu
