// Host AdamW on 8-bit block-wise moments (host_adamw.h, optimizer.offload "host" with
// optimizer.state_dtype "q8"). Per element the state is 2 code bytes instead of 8 (f32) or 4 (bf16)
// moment bytes; the f32 master stays. Compiled with -ffp-contract=off like host_adamw.cpp, so the
// element arithmetic rounds exactly as ops/cpu/optim.cpp's adamw_q8 and the CUDA kernel.
#include <algorithm>
#include <bit>
#include <cmath>

#include "host_adamw.h"
#include "kestrel/ops/adamw_q8.h"
#include "kestrel/runtime/error.h"

namespace kestrel::train {
namespace {

inline float load_bf16(uint16_t b) { return std::bit_cast<float>(static_cast<uint32_t>(b) << 16); }

inline float load_grad(const void* g, DType t, int64_t i) {
  switch (t) {
    case DType::BF16: return load_bf16(static_cast<const uint16_t*>(g)[i]);
    case DType::F16: return f16_bits_to_float(static_cast<const uint16_t*>(g)[i]);
    default: return static_cast<const float*>(g)[i];
  }
}

inline void store_out(void* out, DType t, int64_t i, float p) {
  switch (t) {
    case DType::BF16: static_cast<uint16_t*>(out)[i] = float_to_bf16_bits(p); break;
    case DType::F16: static_cast<uint16_t*>(out)[i] = float_to_f16_bits(p); break;
    default: static_cast<float*>(out)[i] = p; break;
  }
}

// Phase 1 of one block, bf16 gradients (the hot path): dequantise, update master, new moments into
// mnew/vnew. Written without branches in the loop body so it vectorises.
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
void block_update_bf16(float* __restrict master, const uint8_t* __restrict mc, const uint8_t* __restrict vc, float sm,
                       float sv, const uint16_t* __restrict g, float* __restrict mnew, float* __restrict vnew,
                       int64_t len, HostAdamWConstants c) {
  for (int64_t j = 0; j < len; ++j) {
    const float gi = load_bf16(g[j]);
    float p = master[j] * c.decay;
    const float mi = c.b1 * (q8::decode_m(mc[j]) * sm) + c.one_minus_b1 * gi;
    const float vi = c.b2 * (q8::decode_v(vc[j]) * sv) + c.one_minus_b2 * gi * gi;
    p = p - c.step_size * mi / (std::sqrt(vi) / c.bc2_sqrt + c.eps);
    master[j] = p;
    mnew[j] = mi;
    vnew[j] = vi;
  }
}

void block_update_generic(float* master, const uint8_t* mc, const uint8_t* vc, float sm, float sv, const void* g,
                          DType gt, float* mnew, float* vnew, int64_t len, const HostAdamWConstants& c) {
  for (int64_t j = 0; j < len; ++j) {
    const float gi = load_grad(g, gt, j);
    float p = master[j] * c.decay;
    const float mi = c.b1 * (q8::decode_m(mc[j]) * sm) + c.one_minus_b1 * gi;
    const float vi = c.b2 * (q8::decode_v(vc[j]) * sv) + c.one_minus_b2 * gi * gi;
    p = p - c.step_size * mi / (std::sqrt(vi) / c.bc2_sqrt + c.eps);
    master[j] = p;
    mnew[j] = mi;
    vnew[j] = vi;
  }
}

}  // namespace

void host_adamw_q8_update(float* master, const HostQ8State& q, const void* grad, DType gt, void* out, DType ot,
                          int64_t n, const HostAdamWConstants& c) {
  KESTREL_CHECK(gt == DType::F32 || gt == DType::BF16 || gt == DType::F16, "adamw-host",
                "gradients must be f32, bf16 or f16, got ", dtype_name(gt));
  KESTREL_CHECK(out == nullptr || ot == DType::F32 || ot == DType::BF16 || ot == DType::F16, "adamw-host",
                "parameter copies must be f32, bf16 or f16, got ", dtype_name(ot));
  KESTREL_CHECK(q.index0 % q8::kBlock == 0, "adamw-host", "a q8 range must start on a block, got element ", q.index0);
  const uint64_t mseed = q8::m_stream(q.moment_seed), vseed = q8::v_stream(q.moment_seed);
  const int64_t gsz = static_cast<int64_t>(dtype_size(gt));
  alignas(64) float mnew[q8::kBlock], vnew[q8::kBlock];
  for (int64_t base = 0, k = 0; base < n; base += q8::kBlock, ++k) {
    const int64_t len = std::min<int64_t>(q8::kBlock, n - base);
    const void* g = static_cast<const char*>(grad) + base * gsz;
    if (gt == DType::BF16)
      block_update_bf16(master + base, q.m_codes + base, q.v_codes + base, q.m_scale[k], q.v_scale[k],
                        static_cast<const uint16_t*>(g), mnew, vnew, len, c);
    else
      block_update_generic(master + base, q.m_codes + base, q.v_codes + base, q.m_scale[k], q.v_scale[k], g, gt, mnew,
                           vnew, len, c);
    float am = 0.0f, av = 0.0f;
    for (int64_t j = 0; j < len; ++j) {
      am = q8::absmax_step(am, mnew[j]);
      av = q8::absmax_step(av, vnew[j]);
    }
    q.m_scale[k] = am;
    q.v_scale[k] = av;
    const uint64_t i0 = q.index0 + static_cast<uint64_t>(base);
    for (int64_t j = 0; j < len; ++j) {
      q.m_codes[base + j] = am > 0.0f ? q8::encode_m(mnew[j], am, q8::uniform_or_half(mseed, i0 + j)) : 0;
      q.v_codes[base + j] = av > 0.0f ? q8::encode_v(vnew[j], av, q8::uniform_or_half(vseed, i0 + j)) : 0;
    }
    if (out != nullptr)
      for (int64_t j = 0; j < len; ++j) store_out(out, ot, base + j, master[base + j]);
  }
}

}  // namespace kestrel::train
