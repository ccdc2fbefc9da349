// Host AdamW kernels (see host_adamw.h). Memory-bound: per element 12 bytes of f32 state read and
// written, the 2-4 byte gradient read and the 2-4 byte copy written; the loops carry no branches so
// the compiler vectorises them (the 16-bit rounding is a select).
#include "host_adamw.h"

#include <bit>
#include <cmath>

#include "kestrel/runtime/error.h"

namespace kestrel::train {
namespace {

inline float load_bf16(uint16_t b) { return std::bit_cast<float>(static_cast<uint32_t>(b) << 16); }

// float_to_bf16_bits of runtime/dtype.h, written branch-free.
inline uint16_t to_bf16(float f) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  const uint32_t nan = (u >> 16) | 0x0040u;
  const uint32_t rne = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? nan : rne);
}

// A moment as stored: f32 (exact), or bf16 bits rounded to nearest even on every store.
inline float load_moment(float x) { return x; }
inline float load_moment(uint16_t x) { return load_bf16(x); }
inline void store_moment(float& dst, float x) { dst = x; }
inline void store_moment(uint16_t& dst, float x) { dst = to_bf16(x); }

// One element of the reference update (ops/cpu/optim.cpp, operation by operation); returns the new
// master value and updates the moments in place.
template <typename S>
inline float adamw_element(float& master, S& m, S& v, float g, const HostAdamWConstants& c) {
  float p = master * c.decay;
  const float mi = c.b1 * load_moment(m) + c.one_minus_b1 * g;
  const float vi = c.b2 * load_moment(v) + c.one_minus_b2 * g * g;
  p = p - c.step_size * mi / (std::sqrt(vi) / c.bc2_sqrt + c.eps);
  master = p;
  store_moment(m, mi);
  store_moment(v, vi);
  return p;
}

// The hot paths (bf16 gradients and parameters, both moment storages; f32 throughout), cloned per ISA.
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
void update_bf16_f32_state(float* __restrict master, float* __restrict m, float* __restrict v,
                           const uint16_t* __restrict g, uint16_t* __restrict out, int64_t n, HostAdamWConstants c) {
  for (int64_t i = 0; i < n; ++i) out[i] = to_bf16(adamw_element(master[i], m[i], v[i], load_bf16(g[i]), c));
}

__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
void update_bf16_bf16_state(float* __restrict master, uint16_t* __restrict m, uint16_t* __restrict v,
                            const uint16_t* __restrict g, uint16_t* __restrict out, int64_t n, HostAdamWConstants c) {
  for (int64_t i = 0; i < n; ++i) out[i] = to_bf16(adamw_element(master[i], m[i], v[i], load_bf16(g[i]), c));
}

__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
void update_f32(float* __restrict master, float* __restrict m, float* __restrict v, const float* __restrict g,
                float* __restrict out, int64_t n, HostAdamWConstants c) {
  for (int64_t i = 0; i < n; ++i) {
    const float p = adamw_element(master[i], m[i], v[i], g[i], c);
    if (out) out[i] = p;
  }
}

// Every other combination (f16 anywhere, mixed gradient/copy types): the same element update, scalar.
template <typename S>
void update_generic(float* master, S* m, S* v, const void* grad, DType gt, void* out, DType ot, int64_t n,
                    const HostAdamWConstants& c) {
  for (int64_t i = 0; i < n; ++i) {
    float gi;
    switch (gt) {
      case DType::BF16: gi = load_bf16(static_cast<const uint16_t*>(grad)[i]); break;
      case DType::F16: gi = f16_bits_to_float(static_cast<const uint16_t*>(grad)[i]); break;
      default: gi = static_cast<const float*>(grad)[i]; break;
    }
    const float p = adamw_element(master[i], m[i], v[i], gi, c);
    if (out == nullptr) continue;
    switch (ot) {
      case DType::BF16: static_cast<uint16_t*>(out)[i] = to_bf16(p); break;
      case DType::F16: static_cast<uint16_t*>(out)[i] = float_to_f16_bits(p); break;
      default: static_cast<float*>(out)[i] = p; break;
    }
  }
}

}  // namespace

HostAdamWConstants HostAdamWConstants::make(const AdamWOptions& o, int64_t step) {
  // As adamw_typed<float> in ops/cpu/optim.cpp: double maths, each constant rounded to f32 once.
  const double bc1 = 1.0 - std::pow(o.beta1, static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(o.beta2, static_cast<double>(step));
  HostAdamWConstants c;
  c.decay = static_cast<float>(1.0 - o.lr * o.weight_decay);
  c.b1 = static_cast<float>(o.beta1);
  c.b2 = static_cast<float>(o.beta2);
  c.one_minus_b1 = 1.0f - c.b1;
  c.one_minus_b2 = 1.0f - c.b2;
  c.step_size = static_cast<float>(o.lr / bc1);
  c.bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  c.eps = static_cast<float>(o.eps);
  return c;
}

void host_adamw_update(float* master, void* mv, void* vv, DType state_dtype, const void* grad, DType grad_dtype,
                       void* out, DType out_dtype, int64_t n, const HostAdamWConstants& c) {
  KESTREL_CHECK(grad_dtype == DType::F32 || grad_dtype == DType::BF16 || grad_dtype == DType::F16, "adamw-host",
                "gradients must be f32, bf16 or f16, got ", dtype_name(grad_dtype));
  KESTREL_CHECK(out == nullptr || out_dtype == DType::F32 || out_dtype == DType::BF16 || out_dtype == DType::F16,
                "adamw-host", "parameter copies must be f32, bf16 or f16, got ", dtype_name(out_dtype));
  KESTREL_CHECK(state_dtype == DType::F32 || state_dtype == DType::BF16, "adamw-host",
                "moments must be f32 or bf16, got ", dtype_name(state_dtype));
  const bool bf16_hot = grad_dtype == DType::BF16 && out != nullptr && out_dtype == DType::BF16;
  if (state_dtype == DType::BF16) {
    auto* m = static_cast<uint16_t*>(mv);
    auto* v = static_cast<uint16_t*>(vv);
    if (bf16_hot)
      update_bf16_bf16_state(master, m, v, static_cast<const uint16_t*>(grad), static_cast<uint16_t*>(out), n, c);
    else
      update_generic(master, m, v, grad, grad_dtype, out, out_dtype, n, c);
    return;
  }
  auto* m = static_cast<float*>(mv);
  auto* v = static_cast<float*>(vv);
  if (bf16_hot)
    update_bf16_f32_state(master, m, v, static_cast<const uint16_t*>(grad), static_cast<uint16_t*>(out), n, c);
  else if (grad_dtype == DType::F32 && (out == nullptr || out_dtype == DType::F32))
    update_f32(master, m, v, static_cast<const float*>(grad), static_cast<float*>(out), n, c);
  else
    update_generic(master, m, v, grad, grad_dtype, out, out_dtype, n, c);
}

}  // namespace kestrel::train
