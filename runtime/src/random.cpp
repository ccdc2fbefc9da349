// CPU generation of the Philox streams. The values are produced in f32 on the host and then
// converted/transferred; the CUDA backend may generate on the device with the same formulas.
#include "kestrel/runtime/random.h"

#include <cmath>

#include "backend.h"
#include "kestrel/runtime/parallel.h"
#include "kestrel/runtime/philox.h"

namespace kestrel {

Generator& default_generator() {
  static thread_local Generator g;
  return g;
}

namespace {
Tensor host_fill(const Shape& shape, DType dtype, Device device, const std::function<void(float*, int64_t)>& fill) {
  Tensor h = Tensor::empty(shape, DType::F32, Device::cpu());
  fill(h.data<float>(), h.numel());
  if (dtype == DType::F32 && device.is_cpu()) return h;
  Tensor out = Tensor::empty(shape, dtype, device);
  out.copy_(h);
  return out;
}
// CUDA tensors: generated on the device by the backend with the same stream (no host round trip).
Tensor device_fill(const Shape& shape, DType dtype, Device device, bool normal, uint64_t seed, uint64_t off,
                   double a, double b) {
  Tensor out = Tensor::empty(shape, dtype, device);
  detail::cuda_backend().fill_random(out, normal, seed, off, a, b);
  return out;
}
}  // namespace

Tensor uniform(const Shape& shape, double lo, double hi, DType dtype, Device device, Generator& gen) {
  int64_t n = numel(shape);
  uint64_t seed = gen.seed(), off = gen.advance(static_cast<uint64_t>(n));
  if (device.is_cuda() && is_floating(dtype)) return device_fill(shape, dtype, device, false, seed, off, lo, hi);
  return host_fill(shape, dtype, device, [&](float* p, int64_t cnt) {
    parallel_for(0, cnt, 1 << 14, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i)
        p[i] = static_cast<float>(lo + (hi - lo) * philox_uniform(seed, off, static_cast<uint64_t>(i)));
    });
  });
}

Tensor normal(const Shape& shape, double mean, double std, DType dtype, Device device, Generator& gen) {
  int64_t n = numel(shape);
  int64_t pairs = (n + 1) / 2;
  uint64_t seed = gen.seed(), off = gen.advance(static_cast<uint64_t>(pairs * 2));
  if (device.is_cuda() && is_floating(dtype)) return device_fill(shape, dtype, device, true, seed, off, mean, std);
  return host_fill(shape, dtype, device, [&](float* p, int64_t cnt) {
    parallel_for(0, pairs, 1 << 13, [&](int64_t b, int64_t e) {
      for (int64_t j = b; j < e; ++j) {
        float u1 = 1.0f - philox_uniform(seed, off, static_cast<uint64_t>(2 * j));  // (0, 1]
        float u2 = philox_uniform(seed, off, static_cast<uint64_t>(2 * j + 1));
        float r = std::sqrt(-2.0f * std::log(u1));
        float t = 6.28318530717958647692f * u2;
        p[2 * j] = static_cast<float>(mean + std * r * std::cos(t));
        if (2 * j + 1 < cnt) p[2 * j + 1] = static_cast<float>(mean + std * r * std::sin(t));
      }
    });
  });
}

Tensor randint(const Shape& shape, int64_t n, DType dtype, Device device, Generator& gen) {
  KESTREL_CHECK(n > 0, "randint", "upper bound must be positive, got ", n);
  int64_t cnt = numel(shape);
  uint64_t seed = gen.seed(), off = gen.advance(static_cast<uint64_t>(cnt));
  Tensor h = Tensor::empty(shape, DType::I64, Device::cpu());
  int64_t* p = h.data<int64_t>();
  for (int64_t i = 0; i < cnt; ++i)
    p[i] = static_cast<int64_t>(philox_word(seed, off, static_cast<uint64_t>(i)) % static_cast<uint64_t>(n));
  if (dtype == DType::I64 && device.is_cpu()) return h;
  Tensor out = Tensor::empty(shape, dtype, device);
  out.copy_(h);
  return out;
}

}  // namespace kestrel
