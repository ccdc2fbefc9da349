// CPU optimizer kernels: AdamW (torch.optim.AdamW arithmetic, f32 for f32 params), 16-bit parameter
// copies by round-to-nearest or stochastic rounding from the Philox stream, and the sums of squares
// and in-place scaling behind global-norm clipping (f64 accumulation, fixed blocks so the result
// does not depend on the thread count).
#include <cmath>
#include <limits>
#include <vector>

#include "kernels/optim.h"
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

template <typename P, typename G>
void adamw_typed(const kernels::AdamWTensors& t, const kernels::AdamWHyper& h) {
  using C = compute_t<P>;
  const int64_t n = t.param.numel();
  P* p = t.param.data<P>();
  P* m = t.m.data<P>();
  P* v = t.v.data<P>();
  const G* g = t.grad.data<G>();
  const double bc1 = 1.0 - std::pow(h.beta1, static_cast<double>(h.step));
  const double bc2 = 1.0 - std::pow(h.beta2, static_cast<double>(h.step));
  const C decay = static_cast<C>(1.0 - h.lr * h.weight_decay), b1 = static_cast<C>(h.beta1),
          b2 = static_cast<C>(h.beta2), step_size = static_cast<C>(h.lr / bc1),
          bc2_sqrt = static_cast<C>(std::sqrt(bc2)), eps = static_cast<C>(h.eps);
  parallel_for(0, n, kBlock, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      C gi = static_cast<C>(elem_to_double(g[i]));
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

void adamw_cpu(const std::vector<kernels::AdamWTensors>& tensors, const kernels::AdamWHyper& h) {
  for (const kernels::AdamWTensors& t : tensors) {
    dispatch_floating(t.grad.dtype(), "adamw_step", [&](auto gtag) {
      using G = decltype(gtag);
      if (t.param.dtype() == DType::F64)
        adamw_typed<double, G>(t, h);
      else
        adamw_typed<float, G>(t, h);
    });
  }
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
KESTREL_REGISTER_KERNEL(sum_squares, cpu, sum_squares_cpu);
KESTREL_REGISTER_KERNEL(scale_in_place, cpu, scale_in_place_cpu);

}  // namespace kestrel::cpu
