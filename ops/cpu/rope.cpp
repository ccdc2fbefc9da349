// CPU rotary embedding (reference): angles position * inv_freq[i] in f64 from the op's table, cos and
// sin times the table's attention scaling, one token per task.
#include <cmath>
#include <vector>

#include "kernels/rope.h"
#include "kestrel/runtime/dtype_dispatch.h"
#include "kestrel/runtime/parallel.h"

namespace kestrel::cpu {
namespace {

void rope_cpu(const Tensor& out, const Tensor& x, const Tensor& positions, const RopeFrequencies& freqs,
              bool inverse) {
  const int64_t T = x.shape()[0], H = x.shape()[1], D = x.shape()[2];
  const int64_t rotary_dim = freqs.rotary_dim(), half = rotary_dim / 2;
  const std::vector<double>& inv_freq = freqs.inv_freq;
  const double scale = freqs.attention_scaling;
  auto position = [&](int64_t t) -> double {
    return positions.dtype() == DType::I32 ? positions.data<int32_t>()[t] : static_cast<double>(positions.data<int64_t>()[t]);
  };
  dispatch_floating(x.dtype(), "rope", [&](auto tag) {
    using Tp = decltype(tag);
    using C = compute_t<Tp>;
    const Tp* px = x.data<Tp>();
    Tp* po = out.data<Tp>();
    parallel_for(0, T, std::max<int64_t>(1, 4096 / std::max<int64_t>(H * D, 1)), [&](int64_t b, int64_t e) {
      std::vector<C> cs(static_cast<size_t>(half)), sn(static_cast<size_t>(half));
      for (int64_t t = b; t < e; ++t) {
        double p = position(t);
        for (int64_t i = 0; i < half; ++i) {
          double a = p * inv_freq[i];
          cs[i] = static_cast<C>(scale * std::cos(a));
          sn[i] = static_cast<C>(inverse ? -scale * std::sin(a) : scale * std::sin(a));
        }
        for (int64_t h = 0; h < H; ++h) {
          const Tp* xr = px + (t * H + h) * D;
          Tp* orow = po + (t * H + h) * D;
          for (int64_t i = 0; i < half; ++i) {
            C x1 = to_compute(xr[i]), x2 = to_compute(xr[i + half]);
            orow[i] = from_compute<Tp>(x1 * cs[i] - x2 * sn[i]);
            orow[i + half] = from_compute<Tp>(x2 * cs[i] + x1 * sn[i]);
          }
          for (int64_t i = rotary_dim; i < D; ++i) orow[i] = xr[i];
        }
      }
    });
  });
}

}  // namespace

KESTREL_REGISTER_KERNEL(rope, cpu, rope_cpu);

}  // namespace kestrel::cpu
