// CPU FP8 kernels: an exact model of the CUDA ones (kernels/fp8.h). A cast multiplies in f32 (as the
// device does) and rounds with float_to_fp8; the GEMM sums the decoded products in f64 (each product of
// two fp8 values is exact in f32, so the sum itself is exact to f64) and rounds that to f32, then to
// bf16 for a bf16 output: the device's epilogue likewise converts its f32 result to bf16; amax
// compares the bits of |x| as the device's atomicMax does (a NaN wins).
#include <cfloat>
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/fp8.h"
#include "kestrel/runtime/dtype.h"
#include "kestrel/runtime/parallel.h"

namespace kestrel::cpu {
namespace {

float load(const Tensor& x, int64_t i) {
  if (x.dtype() == DType::BF16) return bf16_bits_to_float(x.data<uint16_t>()[i]);
  return x.data<float>()[i];
}

uint32_t abs_bits(float v) {
  uint32_t b;
  std::memcpy(&b, &v, 4);
  return b & 0x7fffffffu;
}

float from_bits(uint32_t b) {
  float v;
  std::memcpy(&v, &b, 4);
  return v;
}

void fold_amax(const Tensor& amax, uint32_t bits) {
  float* a = amax.data<float>();
  if (bits > abs_bits(*a)) *a = from_bits(bits);
}

void amax_cpu(const Tensor& x, const Tensor& amax) {
  uint32_t m = 0;
  for (int64_t i = 0, n = x.numel(); i < n; ++i) m = std::max(m, abs_bits(load(x, i)));
  fold_amax(amax, m);
}

void cast_cpu(const Tensor& x, const kernels::Fp8CastTarget& into) {
  const int64_t R = x.shape()[0], C = x.shape()[1], Rp = into.padded_rows();
  const float s = *into.scale.data<float>();
  uint8_t* o = into.out.defined() ? into.out.data<uint8_t>() : nullptr;
  uint8_t* ot = into.out_t.defined() ? into.out_t.data<uint8_t>() : nullptr;
  parallel_for(0, R, std::max<int64_t>(1, 16384 / std::max<int64_t>(C, 1)), [&](int64_t rb, int64_t re) {
    for (int64_t r = rb; r < re; ++r)
      for (int64_t c = 0; c < C; ++c) {
        const uint8_t q = float_to_fp8(load(x, r * C + c) * s, into.format);
        if (o) o[r * C + c] = q;
        if (ot) ot[c * Rp + r] = q;
      }
  });
  // The padding rows R..Rp-1: code 0 (the value 0).
  if (o) std::memset(o + R * C, 0, static_cast<size_t>((Rp - R) * C));
  if (ot)
    for (int64_t c = 0; c < C; ++c) std::memset(ot + c * Rp + R, 0, static_cast<size_t>(Rp - R));
  into.scales_out.data<float>()[0] = 1.0f / s;
  into.scales_out.data<float>()[1] = s;
  if (into.amax.defined()) amax_cpu(x, into.amax);
}

void scale_cpu(const Tensor& history, const Tensor& scale, double fmax, int64_t margin) {
  const int64_t R = history.shape()[0], H = history.shape()[1];
  const float* h = history.data<float>();
  float* s = scale.data<float>();
  for (int64_t r = 0; r < R; ++r) {
    float m = 0.0f;
    bool finite = true;
    for (int64_t j = 0; j < H; ++j) {
      const float v = h[r * H + j];
      finite = finite && std::isfinite(v);
      m = std::max(m, v);
    }
    if (!finite || !(m > 0.0f)) continue;
    const float v = static_cast<float>(fmax) / (m * std::ldexp(1.0f, static_cast<int>(margin)));
    if (v > 0.0f) s[r] = std::isinf(v) ? FLT_MAX : v;  // 0: m * 2^margin overflowed; keep the scale
  }
}

void roll_cpu(const Tensor& history, const Tensor& amax) {
  const int64_t R = history.shape()[0], H = history.shape()[1];
  float* h = history.data<float>();
  float* a = amax.data<float>();
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t j = H - 1; j > 0; --j) h[r * H + j] = h[r * H + j - 1];
    h[r * H] = std::isfinite(a[r]) ? a[r] : 0.0f;
    a[r] = 0.0f;
  }
}

void gemm_cpu(const Tensor& out, const Tensor& a, Fp8Format fa, const Tensor& a_scales, const Tensor& b, Fp8Format fb,
              const Tensor& b_scales, bool /*fast_accum: the CPU sums exactly either way*/) {
  const int64_t M = a.shape()[0], K = a.shape()[1], N = b.shape()[0];
  auto decode = [](const Tensor& t, Fp8Format f) {
    std::vector<float> v(static_cast<size_t>(t.numel()));
    const uint8_t* p = t.data<uint8_t>();
    for (size_t i = 0; i < v.size(); ++i) v[i] = fp8_to_float(p[i], f);
    return v;
  };
  const std::vector<float> av = decode(a, fa), bv = decode(b, fb);
  const double scale = static_cast<double>(a_scales.data<float>()[0]) * static_cast<double>(b_scales.data<float>()[0]);
  const bool bf16 = out.dtype() == DType::BF16;
  parallel_for(0, M, std::max<int64_t>(1, 65536 / std::max<int64_t>(1, N * K)), [&](int64_t mb, int64_t me) {
    for (int64_t m = mb; m < me; ++m)
      for (int64_t n = 0; n < N; ++n) {
        double acc = 0.0;
        const float* ar = av.data() + m * K;
        const float* br = bv.data() + n * K;
        for (int64_t k = 0; k < K; ++k) acc += static_cast<double>(ar[k] * br[k]);
        const float v = static_cast<float>(acc * scale);
        if (bf16)
          out.data<uint16_t>()[m * N + n] = float_to_bf16_bits(v);
        else
          out.data<float>()[m * N + n] = v;
      }
  });
}

}  // namespace

KESTREL_REGISTER_KERNEL(fp8_cast, cpu, cast_cpu);
KESTREL_REGISTER_KERNEL(fp8_amax, cpu, amax_cpu);
KESTREL_REGISTER_KERNEL(fp8_scale, cpu, scale_cpu);
KESTREL_REGISTER_KERNEL(fp8_roll, cpu, roll_cpu);
KESTREL_REGISTER_KERNEL(fp8_gemm, cpu, gemm_cpu);

}  // namespace kestrel::cpu
