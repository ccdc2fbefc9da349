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

// q8::encode_magnitude / decode_* written with selects and constants only (no branches, no table
// loads), so a block's codes decode and encode in vector lanes; the same comparisons and arithmetic,
// hence the same bits (the tests compare the host offload with the reference bit for bit).
// 2^(-r/8) for r in [0, 8]: q8::mantissa's constants, as a table the vector loops gather from.
alignas(64) constexpr float kMant[16] = {1.0f,         0.917004049f, 0.840896428f, 0.771105409f, 0.707106769f, 0.648419797f,
                                         0.594603539f, 0.545253873f, 0.5f};

inline float level_tab(int d) {  // q8::level(d)
  return kMant[d & 7] * std::bit_cast<float>(static_cast<uint32_t>(127 - (d >> 3)) << 23);
}

inline float decode_m_sel(uint8_t c) {  // q8::decode_m
  const int k = c & 0x7f;
  const float a = level_tab(q8::kMaxMagnitudeM - k) * static_cast<float>(k != 0);
  const uint32_t sign = static_cast<uint32_t>((k != 0) & (c >> 7)) << 31;
  return std::bit_cast<float>(std::bit_cast<uint32_t>(a) | sign);
}

inline float decode_v_sel(uint8_t c) { return level_tab(q8::kMaxCodeV - c) * static_cast<float>(c != 0); }

// Phase 1 of one block, bf16 gradients (the hot path): dequantise, update master, new moments into
// mnew/vnew. Written without branches in the loop body so it vectorises.
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
void block_update_bf16(float* __restrict master, const uint8_t* __restrict mc, const uint8_t* __restrict vc, float sm,
                       float sv, const uint16_t* __restrict g, float* __restrict mnew, float* __restrict vnew,
                       int64_t len, HostAdamWConstants c) {
  for (int64_t j = 0; j < len; ++j) {
    const float gi = load_bf16(g[j]);
    float p = master[j] * c.decay;
    const float mi = c.b1 * (decode_m_sel(mc[j]) * sm) + c.one_minus_b1 * gi;
    const float vi = c.b2 * (decode_v_sel(vc[j]) * sv) + c.one_minus_b2 * gi * gi;
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
    const float mi = c.b1 * (decode_m_sel(mc[j]) * sm) + c.one_minus_b1 * gi;
    const float vi = c.b2 * (decode_v_sel(vc[j]) * sv) + c.one_minus_b2 * gi * gi;
    p = p - c.step_size * mi / (std::sqrt(vi) / c.bc2_sqrt + c.eps);
    master[j] = p;
    mnew[j] = mi;
    vnew[j] = vi;
  }
}

// u[j] = philox_uniform(seed, 0, 4 * c0 + j) for j in [0, 4 * nc): one Philox4x32-10 block per four
// elements (philox_uniform recomputes the block for each word), written so the counters vectorise.
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
void fill_uniforms(uint64_t seed, uint64_t c0, int64_t nc, float* __restrict u) {
  const uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  for (int64_t c = 0; c < nc; ++c) {
    const uint64_t ctr = c0 + static_cast<uint64_t>(c);
    uint32_t x0 = static_cast<uint32_t>(ctr), x1 = static_cast<uint32_t>(ctr >> 32), x2 = 0, x3 = 0;
    uint32_t a = k0, b = k1;
#pragma GCC unroll 10
    for (int r = 0; r < 10; ++r) {
      const uint64_t p0 = uint64_t{0xD2511F53u} * x0, p1 = uint64_t{0xCD9E8D57u} * x2;
      const uint32_t n0 = static_cast<uint32_t>(p1 >> 32) ^ x1 ^ a, n1 = static_cast<uint32_t>(p1);
      const uint32_t n2 = static_cast<uint32_t>(p0 >> 32) ^ x3 ^ b, n3 = static_cast<uint32_t>(p0);
      x0 = n0;
      x1 = n1;
      x2 = n2;
      x3 = n3;
      a += 0x9E3779B9u;
      b += 0xBB67AE85u;
    }
    constexpr float kScale = 1.0f / 16777216.0f;
    u[4 * c + 0] = static_cast<float>(x0 >> 8) * kScale;
    u[4 * c + 1] = static_cast<float>(x1 >> 8) * kScale;
    u[4 * c + 2] = static_cast<float>(x2 >> 8) * kScale;
    u[4 * c + 3] = static_cast<float>(x3 >> 8) * kScale;
  }
}

void uniforms(uint64_t seed, uint64_t i0, int64_t len, float* u) {
  if (seed == 0) {
    std::fill(u, u + len, 0.5f);  // round to nearest
    return;
  }
  fill_uniforms(seed, i0 / 4, (len + 3) / 4, u);  // i0 is a block start: a multiple of 4
}

inline int encode_magnitude_sel(float x, int kmax, float u, bool keep_nonzero) {  // q8::encode_magnitude
  const int dmin = kmax - 1;
  const float smallest = q8::level(dmin);
  const uint32_t b = std::bit_cast<uint32_t>(x);
  const int e = static_cast<int>(b >> 23);
  const int q = 126 - e;
  const float f = std::bit_cast<float>((b & 0x7fffffu) | (126u << 23));
  int r = 0;
  for (int k = 1; k < 8; ++k) r += static_cast<int>(kMant[k] >= f);
  const int d_hi = q * 8 + r;
  const float hi = kMant[r], lo = kMant[r + 1];
  const float p = (f - lo) / (hi - lo);
  const int inside = kmax - d_hi - static_cast<int>(!((f == hi) | (d_hi == dmin) | (u < p)));
  const int below = keep_nonzero ? 1 : static_cast<int>(u < x / smallest);
  const bool is_below = (e == 0) | (q > (dmin >> 3)) | (x < smallest);
  int k = is_below ? below : inside;
  k = x >= 1.0f ? kmax : k;
  return x > 0.0f ? k : 0;
}

// The block's absmax as the reference's absmax_step gives it, vectorised: non-negative floats order
// like their bit patterns, so the max of |x|'s bits is the max of |x|, and any NaN (above +inf in
// that order) wins, so the scale still propagates NaN (its payload may differ from the device's).
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
float absmax_bits(const float* __restrict x, int64_t len) {
  uint32_t m = 0;
  for (int64_t j = 0; j < len; ++j) {
    const uint32_t b = std::bit_cast<uint32_t>(x[j]) & 0x7fffffffu;
    m = b > m ? b : m;
  }
  return std::bit_cast<float>(m);
}

// float_to_bf16_bits of runtime/dtype.h (nearest even, the runtime's NaN rule), branch-free.
inline uint16_t to_bf16(float f) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  const uint32_t nan = (u >> 16) | 0x0040u;
  const uint32_t rne = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? nan : rne);
}

__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
void store_bf16(const float* __restrict p, uint16_t* __restrict out, int64_t len) {
  for (int64_t j = 0; j < len; ++j) out[j] = to_bf16(p[j]);
}

__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
void encode_block(const float* __restrict mnew, const float* __restrict vnew, const float* __restrict um,
                  const float* __restrict uv, float am, float av, uint8_t* __restrict mc, uint8_t* __restrict vc,
                  int64_t len) {
  // An all-zero block (scale 0) has every code 0.
  if (!(am > 0.0f)) std::fill(mc, mc + len, uint8_t{0});
  if (!(av > 0.0f)) std::fill(vc, vc + len, uint8_t{0});
  if (am > 0.0f) {
    for (int64_t j = 0; j < len; ++j) {
      const float m = mnew[j];
      const int k = encode_magnitude_sel(std::fabs(m) / am, q8::kMaxMagnitudeM, um[j], false);
      mc[j] = static_cast<uint8_t>(k | (static_cast<int>((k != 0) & (m < 0.0f)) << 7));
    }
  }
  if (av > 0.0f) {
    for (int64_t j = 0; j < len; ++j)
      vc[j] = static_cast<uint8_t>(encode_magnitude_sel(vnew[j] / av, q8::kMaxCodeV, uv[j], true));
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
  alignas(64) float mnew[q8::kBlock], vnew[q8::kBlock], um[q8::kBlock + 4], uv[q8::kBlock + 4];
  for (int64_t base = 0, k = 0; base < n; base += q8::kBlock, ++k) {
    const int64_t len = std::min<int64_t>(q8::kBlock, n - base);
    const void* g = static_cast<const char*>(grad) + base * gsz;
    if (gt == DType::BF16)
      block_update_bf16(master + base, q.m_codes + base, q.v_codes + base, q.m_scale[k], q.v_scale[k],
                        static_cast<const uint16_t*>(g), mnew, vnew, len, c);
    else
      block_update_generic(master + base, q.m_codes + base, q.v_codes + base, q.m_scale[k], q.v_scale[k], g, gt, mnew,
                           vnew, len, c);
    const float am = absmax_bits(mnew, len), av = absmax_bits(vnew, len);
    q.m_scale[k] = am;
    q.v_scale[k] = av;
    const uint64_t i0 = q.index0 + static_cast<uint64_t>(base);
    uniforms(mseed, i0, len, um);
    uniforms(vseed, i0, len, uv);
    encode_block(mnew, vnew, um, uv, am, av, q.m_codes + base, q.v_codes + base, len);
    if (out != nullptr && ot == DType::BF16)
      store_bf16(master + base, static_cast<uint16_t*>(out) + base, len);
    else if (out != nullptr)
      for (int64_t j = 0; j < len; ++j) store_out(out, ot, base + j, master[base + j]);
  }
}

}  // namespace kestrel::train
