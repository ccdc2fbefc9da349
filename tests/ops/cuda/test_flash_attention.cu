// Tests of the flash attention kernels (ops/cuda/flash_attention/) against two independent
// references written here: a float64 CPU reference for small shapes, and a naive float32 GPU
// reference (one warp per row, no tiling, no online softmax) for large shapes. Inputs are fresh
// random bf16/f16 values; every output is NaN-poisoned before the kernel runs, so an unwritten
// element or a NaN fails isfinite. Covers packed documents (length 1 included), len_q != len_k
// with rows that see no key (out 0, lse -inf), GQA 1/4/8, causal and bidirectional, head dims
// 64/128 (fast), 72-120 (the narrow Hopper kernels at 80/96/112, NarrowHeadDim*) and 32/256
// (padded), and run-to-run reproducibility. Forward and backward run
// the Hopper kernels by default (head dims 64/128 and those padded to them);
// ForwardKernelVariantsMatch / BackwardKernelVariantsMatch also run the mma.sync kernels there
// (FlashAttentionParams::kernel), and DeterministicBackward* the fixed-order dq sum.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "cuda/flash_attention/flash_attention.h"
#include "cuda/flash_attention/heuristics.h"
#include "cuda/flash_attention/wgmma.cuh"
#include "kestrel/cuda/check.h"
#include "kestrel/runtime/dtype.h"
#include "kestrel/runtime/error.h"
#include "support/gpu.h"

namespace {

using kestrel::cuda::AttnDType;
using kestrel::cuda::FlashAttentionBackwardParams;
using kestrel::cuda::FlashAttentionParams;
using kestrel::cuda::FlashBwdLayout;
using kestrel::cuda::FlashKernel;

struct Case {
  std::vector<int> len_q, len_k;  // per document
  int hq, hkv, d;
  bool causal;
  AttnDType dtype;
  int total_q() const { int s = 0; for (int x : len_q) s += x; return s; }
  int total_k() const { int s = 0; for (int x : len_k) s += x; return s; }
  std::string name() const {
    char buf[160];
    std::snprintf(buf, sizeof buf, "docs=%zu Tq=%d Tk=%d Hq=%d Hkv=%d D=%d %s %s", len_q.size(), total_q(), total_k(),
                  hq, hkv, d, causal ? "causal" : "bidir", dtype == AttnDType::BF16 ? "bf16" : "f16");
    return buf;
  }
};

template <typename T>
struct DeviceBuffer {
  T* ptr = nullptr;
  size_t n = 0;
  explicit DeviceBuffer(size_t count) : n(count) { KESTREL_CUDA_CHECK(cudaMalloc(&ptr, std::max<size_t>(1, n) * sizeof(T))); }
  ~DeviceBuffer() { cudaFree(ptr); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  void upload(const std::vector<T>& h) { KESTREL_CUDA_CHECK(cudaMemcpy(ptr, h.data(), n * sizeof(T), cudaMemcpyHostToDevice)); }
  std::vector<T> download() const {
    std::vector<T> h(n);
    KESTREL_CUDA_CHECK(cudaMemcpy(h.data(), ptr, n * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
  }
  void poison() { KESTREL_CUDA_CHECK(cudaMemset(ptr, 0xff, std::max<size_t>(1, n) * sizeof(T))); }  // NaN for f32/bf16/f16
};

uint16_t to_bits(float f, AttnDType t) {
  return t == AttnDType::BF16 ? kestrel::float_to_bf16_bits(f) : kestrel::float_to_f16_bits(f);
}
float from_bits(uint16_t b, AttnDType t) {
  return t == AttnDType::BF16 ? kestrel::bf16_bits_to_float(b) : kestrel::f16_bits_to_float(b);
}

// Random low-precision tensor: bits for the device, the rounded values as float for references.
struct LowTensor {
  std::vector<uint16_t> bits;
  std::vector<float> val;
};
LowTensor random_tensor(size_t n, float scale, AttnDType t, std::mt19937& rng) {
  std::normal_distribution<float> nd(0.f, scale);
  LowTensor r{std::vector<uint16_t>(n), std::vector<float>(n)};
  for (size_t i = 0; i < n; ++i) {
    r.bits[i] = to_bits(nd(rng), t);
    r.val[i] = from_bits(r.bits[i], t);
  }
  return r;
}
std::vector<float> to_float(const std::vector<uint16_t>& b, AttnDType t) {
  std::vector<float> r(b.size());
  for (size_t i = 0; i < b.size(); ++i) r[i] = from_bits(b[i], t);
  return r;
}

template <typename A, typename B>
double rel_l2(const std::vector<A>& got, const std::vector<B>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double r = static_cast<double>(ref[i]);
    const double d = static_cast<double>(got[i]) - r;
    num += d * d;
    den += r * r;
  }
  // Floor on the denominator: a reference that is exactly zero (one key: dq = dk = 0) is compared
  // in absolute terms against elements of size 1e-3.
  return std::sqrt(num / std::max(den, 1e-6 * static_cast<double>(ref.size())));
}
template <typename A>
size_t count_nonfinite(const std::vector<A>& v) {
  size_t n = 0;
  for (const A& x : v) n += !std::isfinite(static_cast<double>(x));
  return n;
}

// ---- references ----
struct Reference {
  std::vector<double> out, lse, dq, dk, dv;  // lse -inf for rows without a visible key
};

// float64 CPU reference of forward and backward.
Reference cpu_reference(const Case& cs, const std::vector<float>& q, const std::vector<float>& k,
                        const std::vector<float>& v, const std::vector<float>& dout, float scale) {
  const int D = cs.d, Hq = cs.hq, Hkv = cs.hkv, G = Hq / Hkv;
  Reference r;
  r.out.assign(static_cast<size_t>(cs.total_q()) * Hq * D, 0.0);
  r.lse.assign(static_cast<size_t>(cs.total_q()) * Hq, -INFINITY);
  r.dq.assign(r.out.size(), 0.0);
  r.dk.assign(static_cast<size_t>(cs.total_k()) * Hkv * D, 0.0);
  r.dv.assign(r.dk.size(), 0.0);
  int qs = 0, ks = 0;
  for (size_t doc = 0; doc < cs.len_q.size(); ++doc) {
    const int lq = cs.len_q[doc], lk = cs.len_k[doc], off = lk - lq;
    for (int h = 0; h < Hq; ++h) {
      const int hk = h / G;
      for (int i = 0; i < lq; ++i) {
        const int jmax = cs.causal ? std::min(lk, i + off + 1) : lk;
        if (jmax <= 0) continue;
        const float* qi = &q[((size_t)(qs + i) * Hq + h) * D];
        const float* gi = &dout[((size_t)(qs + i) * Hq + h) * D];
        std::vector<double> s(jmax), dp(jmax);
        double m = -INFINITY;
        for (int j = 0; j < jmax; ++j) {
          const float* kj = &k[((size_t)(ks + j) * Hkv + hk) * D];
          const float* vj = &v[((size_t)(ks + j) * Hkv + hk) * D];
          double acc = 0, accp = 0;
          for (int d = 0; d < D; ++d) acc += (double)qi[d] * kj[d], accp += (double)gi[d] * vj[d];
          s[j] = acc * scale;
          dp[j] = accp;
          m = std::max(m, s[j]);
        }
        double l = 0;
        for (int j = 0; j < jmax; ++j) l += std::exp(s[j] - m);
        double* o = &r.out[((size_t)(qs + i) * Hq + h) * D];
        for (int j = 0; j < jmax; ++j) {
          s[j] = std::exp(s[j] - m) / l;  // P
          const float* vj = &v[((size_t)(ks + j) * Hkv + hk) * D];
          for (int d = 0; d < D; ++d) o[d] += s[j] * vj[d];
        }
        r.lse[(size_t)(qs + i) * Hq + h] = m + std::log(l);
        double delta = 0;
        for (int d = 0; d < D; ++d) delta += o[d] * gi[d];
        double* dqi = &r.dq[((size_t)(qs + i) * Hq + h) * D];
        for (int j = 0; j < jmax; ++j) {
          const double ds = s[j] * (dp[j] - delta);
          const size_t kb = ((size_t)(ks + j) * Hkv + hk) * D;
          for (int d = 0; d < D; ++d) {
            dqi[d] += scale * ds * k[kb + d];
            r.dk[kb + d] += scale * ds * qi[d];
            r.dv[kb + d] += s[j] * gi[d];
          }
        }
      }
    }
    qs += lq;
    ks += lk;
  }
  return r;
}

// Naive float32 GPU reference: one warp per (query row, head) or (key row, KV head); lane l holds
// columns l, l+32, ... Doc of a token comes from a per-token table.
constexpr int kMaxPerLane = 8;  // D <= 256

__device__ float warp_sum(float x) {
  for (int o = 16; o > 0; o /= 2) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

struct RefArgs {
  const float *q, *k, *v, *dout;
  const int *cu_q, *cu_k, *doc_q, *doc_k;
  int total_q, total_k, hq, hkv, d;
  float scale;
  bool causal;
  float *out, *lse, *delta, *dq, *dk, *dv;
};

__global__ void ref_forward_kernel(RefArgs a) {
  const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (row >= a.total_q * a.hq) return;
  const int t = row / a.hq, h = row % a.hq, hk = h / (a.hq / a.hkv), doc = a.doc_q[t];
  const int i = t - a.cu_q[doc], lq = a.cu_q[doc + 1] - a.cu_q[doc], ks = a.cu_k[doc], lk = a.cu_k[doc + 1] - ks;
  const int jmax = a.causal ? min(lk, i + lk - lq + 1) : lk;
  float qv[kMaxPerLane], acc[kMaxPerLane];
  for (int e = 0; e < kMaxPerLane; ++e) {
    const int d = lane + 32 * e;
    qv[e] = d < a.d ? a.q[(size_t)row * a.d + d] : 0.f;
    acc[e] = 0.f;
  }
  float m = -INFINITY;
  for (int j = 0; j < jmax; ++j) {
    float s = 0;
    for (int e = 0; e < kMaxPerLane; ++e) {
      const int d = lane + 32 * e;
      if (d < a.d) s += qv[e] * a.k[((size_t)(ks + j) * a.hkv + hk) * a.d + d];
    }
    m = fmaxf(m, warp_sum(s) * a.scale);
  }
  float l = 0;
  for (int j = 0; j < jmax; ++j) {
    float s = 0;
    for (int e = 0; e < kMaxPerLane; ++e) {
      const int d = lane + 32 * e;
      if (d < a.d) s += qv[e] * a.k[((size_t)(ks + j) * a.hkv + hk) * a.d + d];
    }
    const float p = expf(warp_sum(s) * a.scale - m);
    l += p;
    for (int e = 0; e < kMaxPerLane; ++e) {
      const int d = lane + 32 * e;
      if (d < a.d) acc[e] += p * a.v[((size_t)(ks + j) * a.hkv + hk) * a.d + d];
    }
  }
  float delta = 0;
  for (int e = 0; e < kMaxPerLane; ++e) {
    const int d = lane + 32 * e;
    if (d < a.d) {
      const float o = l > 0 ? acc[e] / l : 0.f;
      a.out[(size_t)row * a.d + d] = o;
      delta += o * a.dout[(size_t)row * a.d + d];
    }
  }
  delta = warp_sum(delta);
  if (lane == 0) {
    a.lse[row] = l > 0 ? m + logf(l) : -INFINITY;
    a.delta[row] = delta;
  }
}

__global__ void ref_dq_kernel(RefArgs a) {
  const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (row >= a.total_q * a.hq) return;
  const int t = row / a.hq, h = row % a.hq, hk = h / (a.hq / a.hkv), doc = a.doc_q[t];
  const int i = t - a.cu_q[doc], lq = a.cu_q[doc + 1] - a.cu_q[doc], ks = a.cu_k[doc], lk = a.cu_k[doc + 1] - ks;
  const int jmax = a.causal ? min(lk, i + lk - lq + 1) : lk;
  const float lse = a.lse[row], delta = a.delta[row];
  float acc[kMaxPerLane] = {};
  for (int j = 0; j < jmax; ++j) {
    const size_t kb = ((size_t)(ks + j) * a.hkv + hk) * a.d;
    float s = 0, dp = 0;
    for (int e = 0; e < kMaxPerLane; ++e) {
      const int d = lane + 32 * e;
      if (d < a.d) {
        s += a.q[(size_t)row * a.d + d] * a.k[kb + d];
        dp += a.dout[(size_t)row * a.d + d] * a.v[kb + d];
      }
    }
    const float p = expf(warp_sum(s) * a.scale - lse);
    const float ds = p * (warp_sum(dp) - delta);
    for (int e = 0; e < kMaxPerLane; ++e) {
      const int d = lane + 32 * e;
      if (d < a.d) acc[e] += ds * a.k[kb + d];
    }
  }
  for (int e = 0; e < kMaxPerLane; ++e) {
    const int d = lane + 32 * e;
    if (d < a.d) a.dq[(size_t)row * a.d + d] = acc[e] * a.scale;
  }
}

__global__ void ref_dkdv_kernel(RefArgs a) {
  const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (row >= a.total_k * a.hkv) return;
  const int t = row / a.hkv, hk = row % a.hkv, doc = a.doc_k[t], G = a.hq / a.hkv;
  const int qs = a.cu_q[doc], lq = a.cu_q[doc + 1] - qs, j = t - a.cu_k[doc], lk = a.cu_k[doc + 1] - a.cu_k[doc];
  const int i0 = a.causal ? max(0, j - (lk - lq)) : 0;
  float adk[kMaxPerLane] = {}, adv[kMaxPerLane] = {};
  for (int h = hk * G; h < (hk + 1) * G; ++h) {
    for (int i = i0; i < lq; ++i) {
      const size_t qr = (size_t)(qs + i) * a.hq + h;
      float s = 0, dp = 0;
      for (int e = 0; e < kMaxPerLane; ++e) {
        const int d = lane + 32 * e;
        if (d < a.d) {
          s += a.q[qr * a.d + d] * a.k[(size_t)row * a.d + d];
          dp += a.dout[qr * a.d + d] * a.v[(size_t)row * a.d + d];
        }
      }
      const float p = expf(warp_sum(s) * a.scale - a.lse[qr]);
      const float ds = p * (warp_sum(dp) - a.delta[qr]);
      for (int e = 0; e < kMaxPerLane; ++e) {
        const int d = lane + 32 * e;
        if (d < a.d) {
          adv[e] += p * a.dout[qr * a.d + d];
          adk[e] += ds * a.q[qr * a.d + d];
        }
      }
    }
  }
  for (int e = 0; e < kMaxPerLane; ++e) {
    const int d = lane + 32 * e;
    if (d < a.d) {
      a.dk[(size_t)row * a.d + d] = adk[e] * a.scale;
      a.dv[(size_t)row * a.d + d] = adv[e];
    }
  }
}

Reference gpu_reference(const Case& cs, const std::vector<float>& q, const std::vector<float>& k,
                        const std::vector<float>& v, const std::vector<float>& dout, float scale) {
  const int Tq = cs.total_q(), Tk = cs.total_k();
  std::vector<int> cu_q{0}, cu_k{0}, doc_q, doc_k;
  for (size_t i = 0; i < cs.len_q.size(); ++i) {
    cu_q.push_back(cu_q.back() + cs.len_q[i]);
    cu_k.push_back(cu_k.back() + cs.len_k[i]);
    doc_q.insert(doc_q.end(), cs.len_q[i], (int)i);
    doc_k.insert(doc_k.end(), cs.len_k[i], (int)i);
  }
  DeviceBuffer<float> dq_(q.size()), dk_(k.size()), dv_(v.size()), ddo(dout.size());
  DeviceBuffer<float> out(q.size()), lse((size_t)Tq * cs.hq), delta((size_t)Tq * cs.hq), gq(q.size()),
      gk(k.size()), gv(v.size());
  DeviceBuffer<int> dcq(cu_q.size()), dck(cu_k.size()), ddq(doc_q.size()), ddk(doc_k.size());
  dq_.upload(q), dk_.upload(k), dv_.upload(v), ddo.upload(dout);
  dcq.upload(cu_q), dck.upload(cu_k), ddq.upload(doc_q), ddk.upload(doc_k);
  RefArgs a{dq_.ptr, dk_.ptr, dv_.ptr, ddo.ptr, dcq.ptr, dck.ptr, ddq.ptr, ddk.ptr, Tq, Tk, cs.hq, cs.hkv, cs.d,
            scale, cs.causal, out.ptr, lse.ptr, delta.ptr, gq.ptr, gk.ptr, gv.ptr};
  const int rows_q = Tq * cs.hq, rows_k = Tk * cs.hkv;
  ref_forward_kernel<<<(rows_q + 7) / 8, 256>>>(a);
  KESTREL_CUDA_CHECK_LAUNCH();
  ref_dq_kernel<<<(rows_q + 7) / 8, 256>>>(a);
  KESTREL_CUDA_CHECK_LAUNCH();
  ref_dkdv_kernel<<<(rows_k + 7) / 8, 256>>>(a);
  KESTREL_CUDA_CHECK_LAUNCH();
  KESTREL_CUDA_CHECK(cudaDeviceSynchronize());
  auto to_d = [](const std::vector<float>& f) { return std::vector<double>(f.begin(), f.end()); };
  return Reference{to_d(out.download()), to_d(lse.download()), to_d(gq.download()), to_d(gk.download()),
                   to_d(gv.download())};
}

// ---- running the kernels ----
// Kernel choice and backward options of every run_flash in scope (RunOptionsScope), so that a test
// can run the same cases on another kernel.
struct RunOptions {
  FlashKernel kernel = FlashKernel::Auto;
  bool deterministic = false;
  int window = 0;
  FlashBwdLayout bwd_layout = FlashBwdLayout::Auto;
};
RunOptions g_run;
struct RunOptionsScope {
  RunOptions saved;
  explicit RunOptionsScope(RunOptions o) : saved(g_run) { g_run = o; }
  ~RunOptionsScope() { g_run = saved; }
};

struct Result {
  std::vector<uint16_t> out, dq, dk, dv;
  std::vector<float> lse;
};

struct Problem {
  Case cs;
  LowTensor q, k, v, dout;
  float scale;
};

// q_std > 1 spreads the scores (std ~ q_std), so row maxima move between key tiles and the
// online-softmax rescaling of O is exercised.
Problem make_problem(const Case& cs, uint32_t seed, float q_std = 1.f) {
  std::mt19937 rng(seed);
  const size_t nq = (size_t)cs.total_q() * cs.hq * cs.d, nk = (size_t)cs.total_k() * cs.hkv * cs.d;
  Problem p{cs, random_tensor(nq, q_std, cs.dtype, rng), random_tensor(nk, 1.f, cs.dtype, rng),
            random_tensor(nk, 1.f, cs.dtype, rng), random_tensor(nq, 1.f, cs.dtype, rng),
            1.f / std::sqrt(static_cast<float>(cs.d))};
  return p;
}

Result run_flash(const Problem& pr) {
  const Case& cs = pr.cs;
  std::vector<int> cu_q{0}, cu_k{0};
  int mq = 0, mk = 0;
  for (size_t i = 0; i < cs.len_q.size(); ++i) {
    cu_q.push_back(cu_q.back() + cs.len_q[i]);
    cu_k.push_back(cu_k.back() + cs.len_k[i]);
    mq = std::max(mq, cs.len_q[i]);
    mk = std::max(mk, cs.len_k[i]);
  }
  const int Tq = cs.total_q();
  DeviceBuffer<uint16_t> q(pr.q.bits.size()), k(pr.k.bits.size()), v(pr.v.bits.size()), dout(pr.dout.bits.size());
  DeviceBuffer<uint16_t> out(q.n), dq(q.n), dk(k.n), dv(v.n);
  DeviceBuffer<float> lse((size_t)Tq * cs.hq);
  DeviceBuffer<int> dcq(cu_q.size()), dck(cu_k.size());
  q.upload(pr.q.bits), k.upload(pr.k.bits), v.upload(pr.v.bits), dout.upload(pr.dout.bits);
  dcq.upload(cu_q), dck.upload(cu_k);
  out.poison(), dq.poison(), dk.poison(), dv.poison(), lse.poison();
  FlashAttentionParams p{q.ptr, k.ptr, v.ptr, out.ptr, lse.ptr, dcq.ptr, dck.ptr, (int)cs.len_q.size(), mq, mk,
                         cs.hq, cs.hkv, cs.d, pr.scale, cs.causal, cs.dtype, Tq, cs.total_k()};
  p.kernel = g_run.kernel;
  p.deterministic = g_run.deterministic;
  p.window = g_run.window;
  p.bwd_layout = g_run.bwd_layout;
  kestrel::cuda::flash_attention_forward(p, nullptr);
  const size_t ws_bytes = kestrel::cuda::flash_attention_backward_workspace_bytes(p);
  DeviceBuffer<unsigned char> ws(ws_bytes);
  ws.poison();
  FlashAttentionBackwardParams bp{p, dout.ptr, dq.ptr, dk.ptr, dv.ptr, ws.ptr, ws_bytes};
  kestrel::cuda::flash_attention_backward(bp, nullptr);
  KESTREL_CUDA_CHECK(cudaDeviceSynchronize());
  return Result{out.download(), dq.download(), dk.download(), dv.download(), lse.download()};
}

// Error budgets (rel. L2 against a float64/float32 reference). The kernel rounds P and dS to the
// input precision before the second matmul and rounds outputs; the measured errors are printed.
struct Tol {
  double out, grad;
};
Tol tolerance(AttnDType t) { return t == AttnDType::BF16 ? Tol{1e-2, 2e-2} : Tol{4e-3, 8e-3}; }

void check_against(const Problem& pr, const Result& r, const Reference& ref) {
  const Case& cs = pr.cs;
  const AttnDType t = cs.dtype;
  const auto out = to_float(r.out, t), dq = to_float(r.dq, t), dk = to_float(r.dk, t), dv = to_float(r.dv, t);
  EXPECT_EQ(count_nonfinite(out), 0u) << "out has NaN/inf or unwritten elements";
  EXPECT_EQ(count_nonfinite(dq), 0u) << "dq";
  EXPECT_EQ(count_nonfinite(dk), 0u) << "dk";
  EXPECT_EQ(count_nonfinite(dv), 0u) << "dv";
  // lse: -inf exactly where the reference has no visible key, close elsewhere.
  double lse_err = 0;
  size_t lse_bad = 0;
  for (size_t i = 0; i < ref.lse.size(); ++i) {
    if (std::isinf(ref.lse[i])) {
      lse_bad += !(std::isinf(r.lse[i]) && r.lse[i] < 0);
    } else {
      if (!std::isfinite(r.lse[i])) ++lse_bad;
      else lse_err = std::max(lse_err, std::abs(r.lse[i] - ref.lse[i]) / (1.0 + std::abs(ref.lse[i])));
    }
  }
  const Tol tol = tolerance(t);
  const double e_out = rel_l2(out, ref.out), e_dq = rel_l2(dq, ref.dq), e_dk = rel_l2(dk, ref.dk),
               e_dv = rel_l2(dv, ref.dv);
  std::printf("[flash] %-58s out %.2e lse %.1e dq %.2e dk %.2e dv %.2e\n", cs.name().c_str(), e_out, lse_err, e_dq,
              e_dk, e_dv);
  EXPECT_EQ(lse_bad, 0u) << "lse not finite where it should be, or not -inf for rows without keys";
  EXPECT_LE(lse_err, 1e-4);
  EXPECT_LE(e_out, tol.out);
  EXPECT_LE(e_dq, tol.grad);
  EXPECT_LE(e_dk, tol.grad);
  EXPECT_LE(e_dv, tol.grad);
}

void run_case(const Case& cs, bool cpu_ref, uint32_t seed, float q_std = 1.f) {
  const Problem pr = make_problem(cs, seed, q_std);
  const Result r = run_flash(pr);
  const Reference ref = cpu_ref ? cpu_reference(cs, pr.q.val, pr.k.val, pr.v.val, pr.dout.val, pr.scale)
                                : gpu_reference(cs, pr.q.val, pr.k.val, pr.v.val, pr.dout.val, pr.scale);
  check_against(pr, r, ref);
}

Case single(int t, int hq, int hkv, int d, bool causal, AttnDType dt) { return Case{{t}, {t}, hq, hkv, d, causal, dt}; }
constexpr AttnDType BF = AttnDType::BF16, F16 = AttnDType::F16;

TEST(FlashAttentionCuda, SmallShapesMatchFloat64) {
  KESTREL_REQUIRE_GPU();
  uint32_t seed = 1;
  for (bool causal : {true, false}) {
    run_case(single(1, 2, 2, 64, causal, BF), true, seed++);
    run_case(single(17, 4, 1, 64, causal, BF), true, seed++);        // GQA 4
    run_case(single(100, 8, 1, 128, causal, F16), true, seed++);     // GQA 8
    run_case(single(130, 2, 2, 128, causal, BF), true, seed++);
    run_case(Case{{1, 17, 5, 64, 1, 33, 1}, {1, 17, 5, 64, 1, 33, 1}, 4, 2, 72, causal, F16}, true, seed++);
    // len_q != len_k: bottom-right causal alignment; doc 3 has queries that see no key.
    run_case(Case{{3, 20, 1, 40}, {10, 7, 5, 25}, 4, 4, 64, causal, BF}, true, seed++);
    run_case(single(70, 2, 1, 256, causal, BF), true, seed++);
    run_case(single(45, 2, 2, 32, causal, F16), true, seed++);
  }
}

TEST(FlashAttentionCuda, LargeShapesMatchNaiveGpu) {
  KESTREL_REQUIRE_GPU();
  uint32_t seed = 100;
  run_case(single(1000, 8, 2, 128, true, BF), false, seed++);
  run_case(single(1000, 8, 2, 128, false, BF), false, seed++);
  run_case(single(4097, 4, 4, 64, false, BF), false, seed++);
  run_case(single(4097, 4, 1, 128, true, BF), false, seed++);
  run_case(Case{{1000, 1, 4097, 17, 1, 255}, {1000, 1, 4097, 17, 1, 255}, 8, 1, 128, true, F16}, false, seed++);
  run_case(Case{{1000, 1, 4097, 17, 1, 255}, {1000, 1, 4097, 17, 1, 255}, 4, 1, 64, false, BF}, false, seed++);
  run_case(single(1000, 4, 4, 72, false, BF), false, seed++);  // SigLIP so400m head dim
  run_case(single(1000, 4, 2, 72, true, F16), false, seed++);
  run_case(single(777, 2, 2, 256, true, BF), false, seed++);
}

const char* kernel_name(FlashKernel k) {
  return k == FlashKernel::Hopper         ? "hopper"
         : k == FlashKernel::HopperPadded ? "hopper_padded"
         : k == FlashKernel::MmaSync      ? "mma_sync"
                                          : "auto";
}

// Both kernel families (FlashAttentionParams::kernel: the Hopper kernels, the mma.sync kernels
// zero-padded to head dim 256) against the references, whatever the default is.
TEST(FlashAttentionCuda, BackwardKernelVariantsMatch) {
  KESTREL_REQUIRE_GPU();
  uint32_t seed = 300;
  for (FlashKernel kind : {FlashKernel::MmaSync, FlashKernel::Hopper}) {
    RunOptionsScope scope({kind});
    std::printf("[flash] kernel=%s\n", kernel_name(kind));
    for (bool causal : {true, false}) {
      run_case(Case{{3, 20, 1, 40}, {10, 7, 5, 25}, 4, 4, 64, causal, BF}, true, seed++);
      run_case(single(130, 4, 2, 128, causal, F16), true, seed++);
      run_case(Case{{1000, 1, 300}, {1000, 1, 300}, 4, 1, 64, causal, BF}, false, seed++);
      run_case(single(700, 4, 2, 128, causal, BF), false, seed++);
    }
  }
}

// The wgmma backward (64-key warpgroup tiles, 64-query tiles at head dim 128 and 128-query tiles at
// 64) on the issue's shapes: odd lengths (1, 17, 1000, 4097), packs with length-1 documents,
// len_q != len_k, GQA 1/4/8, padded head dims, causal and bidirectional, bf16 and f16; then dK/dV
// bitwise reproducible across runs.
TEST(FlashAttentionCuda, WgmmaBackwardShapes) {
  KESTREL_REQUIRE_GPU();
  RunOptionsScope scope({FlashKernel::Hopper});
  uint32_t seed = 400;
  for (bool causal : {true, false}) {
    run_case(Case{{1, 17, 5, 64, 1, 33, 1}, {1, 17, 5, 64, 1, 33, 1}, 8, 1, 128, causal, BF}, true, seed++);
    run_case(Case{{1, 17, 130, 1, 257}, {1, 17, 130, 1, 257}, 8, 2, 64, causal, F16}, true, seed++);
    run_case(Case{{3, 200, 1, 129}, {150, 7, 300, 129}, 2, 1, 128, causal, F16}, true, seed++);
    run_case(Case{{3, 200, 1, 129}, {150, 7, 300, 129}, 4, 4, 64, causal, BF}, true, seed++);
    run_case(single(385, 2, 2, 72, causal, BF), true, seed++, 3.f);
    run_case(Case{{1000, 1, 4097, 17, 1}, {1000, 1, 4097, 17, 1}, 8, 1, 128, causal, BF}, false, seed++);
    run_case(Case{{1000, 1, 4097, 17, 1}, {1000, 1, 4097, 17, 1}, 8, 2, 64, causal, F16}, false, seed++);
    run_case(single(4097, 4, 4, 128, causal, F16), false, seed++);
  }
  const Problem pr = make_problem(Case{{1000, 1, 2049}, {1000, 1, 2049}, 8, 2, 128, true, BF}, seed++);
  const Result a = run_flash(pr), b = run_flash(pr);
  EXPECT_EQ(a.dk, b.dk);
  EXPECT_EQ(a.dv, b.dv);
}

// Both layouts of the Hopper backward (FlashBwdLayout: Plain, and Specialised with its producer
// warpgroup, two-deep Q/dO ring and dQ by TMA bulk reductions) on every mask they serve: causal
// and bidirectional (windows and prefix-LM: test_flash_attention_window.cpp and
// test_flash_attention_prefix.cpp, whose cases take Specialised under Auto), packs with length-1 documents and documents that
// end inside a query tile (the rows past a document add exact zeros to the next one's dq),
// len_q != len_k, GQA, head dims 128 and the narrow 72 -> 80 / 112, bf16 and f16.
TEST(FlashAttentionCuda, BackwardLayoutsMatch) {
  KESTREL_REQUIRE_GPU();
  uint32_t seed = 1500;
  for (FlashBwdLayout layout : {FlashBwdLayout::Plain, FlashBwdLayout::Specialised}) {
    RunOptionsScope scope({FlashKernel::Hopper, false, 0, layout});
    std::printf("[flash] bwd_layout=%s\n", layout == FlashBwdLayout::Plain ? "plain" : "specialised");
    for (bool causal : {true, false}) {
      run_case(Case{{1, 17, 130, 1, 257}, {1, 17, 130, 1, 257}, 8, 2, 128, causal, BF}, true, seed++);
      run_case(Case{{3, 200, 1, 129}, {150, 7, 300, 129}, 4, 1, 112, causal, F16}, true, seed++);
      run_case(single(385, 2, 2, 72, causal, BF), true, seed++, 3.f);
      run_case(Case{{1000, 1, 4097, 17, 1}, {1000, 1, 4097, 17, 1}, 8, 2, 128, causal, BF}, false, seed++);
    }
  }
}

// The backward layout rule (choose_kernel): Specialised wherever it is built (causal or not,
// prefix-LM; not deterministic or block masks), Plain otherwise or when asked for; an explicit
// Specialised where it is not built is refused with the reason.
TEST(FlashAttentionCuda, BackwardLayoutChoice) {
  using kestrel::cuda::fa::choose_kernel;
  using kestrel::cuda::fa::DeviceProps;
  const DeviceProps h100{9, 0, 132}, a100{8, 0, 108};
  FlashAttentionParams p{};
  p.head_dim = 128;
  p.causal = true;
  auto ws = [&] { return choose_kernel(p, h100, /*backward=*/true).bwd_specialised; };
  EXPECT_TRUE(ws());
  EXPECT_FALSE(choose_kernel(p, h100, /*backward=*/false).bwd_specialised);
  p.head_dim = 72;  // narrow 80
  EXPECT_TRUE(ws());
  p.head_dim = 64;  // the 64-column kernels load Q/dO by cp.async: plain only
  EXPECT_FALSE(ws());
  p.bwd_layout = FlashBwdLayout::Specialised;
  EXPECT_THROW(ws(), kestrel::Error);
  p.head_dim = 128;
  p.deterministic = true;
  EXPECT_THROW(ws(), kestrel::Error);
  p.bwd_layout = FlashBwdLayout::Auto;
  EXPECT_FALSE(ws());
  p.deterministic = false;
  p.causal = false;  // without a mask too
  EXPECT_TRUE(ws());
  kestrel::cuda::FlashBlockMask block_mask{};  // a block mask: Plain (Specialised refused)
  p.block_mask = &block_mask;
  EXPECT_FALSE(ws());
  p.bwd_layout = FlashBwdLayout::Specialised;
  EXPECT_THROW(ws(), kestrel::Error);
  p.bwd_layout = FlashBwdLayout::Auto;
  p.block_mask = nullptr;
  const int32_t prefix_len[1] = {0};  // prefix-LM: Specialised (kernel head dim 128)
  p.prefix_len = prefix_len;
  p.causal = true;
  EXPECT_TRUE(ws());
  p.head_dim = 72;  // prefix-LM runs the 128 kernels (no narrow variant)
  EXPECT_TRUE(ws());
  p.prefix_len = nullptr;
  p.causal = false;
  p.head_dim = 96;
  EXPECT_TRUE(ws());
  p.bwd_layout = FlashBwdLayout::Plain;
  EXPECT_FALSE(ws());
  p.bwd_layout = FlashBwdLayout::Specialised;
  EXPECT_TRUE(ws());
  p.head_dim = 128;
  p.causal = true;
  p.bwd_layout = FlashBwdLayout::Plain;
  EXPECT_FALSE(ws());
  p.bwd_layout = FlashBwdLayout::Specialised;
  try {
    choose_kernel(p, a100, /*backward=*/true);
    ADD_FAILURE() << "expected kestrel::Error";
  } catch (const kestrel::Error& e) {
    EXPECT_NE(std::string(e.what()).find("bwd_layout Specialised"), std::string::npos) << e.what();
  }
}

// Edge cases of the wgmma forward's tiles (128 query rows at head dim 128, 192 at 64; 128-key
// tiles): documents shorter than one tile, lengths that are not multiples of 64/128/192, document
// boundaries inside a tile, len_q != len_k both ways, and spread scores (rescaling across tiles).
TEST(FlashAttentionCuda, WgmmaForwardTileEdges) {
  KESTREL_REQUIRE_GPU();
  uint32_t seed = 500;
  for (bool causal : {true, false}) {
    for (int d : {64, 128}) {
      run_case(Case{{5, 130, 191, 193, 64, 1, 257}, {5, 130, 191, 193, 64, 1, 257}, 4, 2, d, causal, BF}, true, seed++);
      run_case(Case{{3, 200, 1, 129}, {150, 7, 300, 129}, 2, 1, d, causal, F16}, true, seed++);
      run_case(single(385, 2, 2, d, causal, F16), true, seed++, 4.f);
      run_case(Case{{1500, 63, 700}, {1500, 63, 700}, 8, 1, d, causal, BF}, false, seed++, 3.f);
    }
  }
}

// The persistent forward at head dim 128 (one block per SM, flash_fwd_ws_kernel) walks several work
// items per block: here 16 query tiles x 16 heads x 3 documents = 768 items (about 6 rounds on 132
// SMs), items of 1 to 16 key tiles and empty ones (the short document's tiles past its end), so the
// K/V ring and the Q barrier carry their phases across items of different lengths.
TEST(FlashAttentionCuda, PersistentForwardWalksManyItemsPerBlock) {
  KESTREL_REQUIRE_GPU();
  uint32_t seed = 550;
  for (bool causal : {true, false}) {
    run_case(Case{{2000, 129, 1931}, {2000, 129, 1931}, 16, 4, 128, causal, BF}, false, seed++, 3.f);
    run_case(Case{{1, 2048, 300}, {1, 2048, 300}, 12, 12, 128, causal, F16}, false, seed++);
  }
}

// The mma.sync kernels at the Hopper kernels' head dims (zero-padded to 256) against the references,
// and the two forwards against each other on the same inputs.
TEST(FlashAttentionCuda, ForwardKernelVariantsMatch) {
  KESTREL_REQUIRE_GPU();
  uint32_t seed = 600;
  {
    RunOptionsScope scope({FlashKernel::MmaSync});
    std::printf("[flash] kernel=mma_sync\n");
    for (bool causal : {true, false}) {
      run_case(Case{{3, 20, 1, 40}, {10, 7, 5, 25}, 4, 4, 64, causal, BF}, true, seed++);
      run_case(single(130, 4, 2, 128, causal, F16), true, seed++);
      run_case(Case{{5, 130, 191, 193, 1, 257}, {5, 130, 191, 193, 1, 257}, 4, 2, 128, causal, BF}, true, seed++, 3.f);
      run_case(Case{{3, 200, 1, 129}, {150, 7, 300, 129}, 2, 1, 128, causal, F16}, true, seed++);
      run_case(Case{{1000, 1, 300}, {1000, 1, 300}, 4, 1, 64, causal, F16}, false, seed++);
      run_case(single(700, 4, 2, 128, causal, BF), false, seed++);
    }
  }
  for (int d : {64, 128}) {
    for (AttnDType t : {BF, F16}) {
      const Problem pr = make_problem(Case{{900, 1, 333}, {900, 1, 333}, 4, 2, d, true, t}, seed++);
      Result a;
      {
        RunOptionsScope scope({FlashKernel::MmaSync});
        a = run_flash(pr);
      }
      for (FlashKernel kind : {FlashKernel::Hopper}) {
        RunOptionsScope scope({kind});
        const Result b = run_flash(pr);
        const double e_out = rel_l2(to_float(b.out, t), to_float(a.out, t));
        double lse_diff = 0;
        for (size_t i = 0; i < a.lse.size(); ++i) lse_diff = std::max(lse_diff, (double)std::abs(a.lse[i] - b.lse[i]));
        std::printf("[flash] %s vs mma_sync D=%d %s: out rel %.2e, lse max abs diff %.2e\n", kernel_name(kind), d,
                    t == BF ? "bf16" : "f16", e_out, lse_diff);
        EXPECT_EQ(count_nonfinite(to_float(b.out, t)), 0u);
        EXPECT_LE(e_out, t == BF ? 1e-2 : 2e-3);
        EXPECT_LE(lse_diff, 1e-4);
      }
    }
  }
}

// Packed documents share one K/V buffer, so a key tile at the end of a document can hold the next
// document's rows (the TMA kernels load whole boxes). Those rows must not reach the output even when
// their V is non-finite: the first document's out/lse must be bitwise unchanged by an inf in the
// second document's V, for every forward kernel.
TEST(FlashAttentionCuda, NextDocumentValuesDoNotLeak) {
  KESTREL_REQUIRE_GPU();
  uint32_t seed = 900;
  for (FlashKernel kind : {FlashKernel::MmaSync, FlashKernel::Hopper}) {
    RunOptionsScope scope({kind});
    for (int d : {64, 72, 128}) {  // 72: the narrow Hopper forward (kernel head dim 80)
      for (bool causal : {true, false}) {
        const Case cs{{100, 77}, {100, 200}, 4, 2, d, causal, BF};
        Problem pr = make_problem(cs, seed++);
        const Result clean = run_flash(pr);
        const size_t row = (size_t)cs.hkv * d;  // elements per key token
        for (size_t i = 100 * row; i < pr.v.bits.size(); i += 7) pr.v.bits[i] = 0x7F80;  // +inf in doc 2's V
        const Result dirty = run_flash(pr);
        const size_t n_out = (size_t)100 * cs.hq * d, n_lse = (size_t)100 * cs.hq;
        size_t diff = 0;
        for (size_t i = 0; i < n_out; ++i) diff += clean.out[i] != dirty.out[i];
        for (size_t i = 0; i < n_lse; ++i) diff += clean.lse[i] != dirty.lse[i];
        EXPECT_EQ(diff, 0u) << kernel_name(kind) << " D=" << d << (causal ? " causal" : " bidirectional");
        EXPECT_EQ(count_nonfinite(to_float(std::vector<uint16_t>(clean.out.begin(), clean.out.begin() + n_out), BF)), 0u);
      }
    }
  }
}

// The backward's last query tile of a document also spans the next document's rows (the Hopper
// backward loads whole Q / dO boxes by TMA and zeroes the rows past the document in shared memory):
// +inf in the second document's Q and dO must leave the first document's dk / dv bitwise unchanged
// and its dq finite and equal up to the f32 atomics' arrival order.
TEST(FlashAttentionCuda, BackwardNextDocumentValuesDoNotLeak) {
  KESTREL_REQUIRE_GPU();
  uint32_t seed = 950;
  for (FlashKernel kind : {FlashKernel::MmaSync, FlashKernel::Hopper}) {
    RunOptionsScope scope({kind});
    for (int d : {64, 72, 128}) {
      for (bool causal : {true, false}) {
        const Case cs{{100, 77}, {100, 200}, 4, 2, d, causal, BF};
        Problem pr = make_problem(cs, seed++);
        const Result clean = run_flash(pr);
        const size_t qrow = (size_t)cs.hq * d;  // elements per query token
        for (size_t i = 100 * qrow; i < pr.q.bits.size(); i += 5) pr.q.bits[i] = 0x7F80;
        for (size_t i = 100 * qrow + 2; i < pr.dout.bits.size(); i += 5) pr.dout.bits[i] = 0x7F80;
        const Result dirty = run_flash(pr);
        const size_t n_kv = (size_t)100 * cs.hkv * d, n_q = 100 * qrow;
        size_t diff = 0;
        for (size_t i = 0; i < n_kv; ++i) diff += (clean.dk[i] != dirty.dk[i]) + (clean.dv[i] != dirty.dv[i]);
        EXPECT_EQ(diff, 0u) << kernel_name(kind) << " D=" << d << (causal ? " causal" : " bidirectional");
        const std::vector<uint16_t> dq_clean(clean.dq.begin(), clean.dq.begin() + n_q),
            dq_dirty(dirty.dq.begin(), dirty.dq.begin() + n_q);
        EXPECT_EQ(count_nonfinite(to_float(dq_dirty, BF)), 0u) << kernel_name(kind) << " D=" << d;
        EXPECT_LE(rel_l2(to_float(dq_dirty, BF), to_float(dq_clean, BF)), 1e-2) << kernel_name(kind) << " D=" << d;
      }
    }
  }
}

TEST(FlashAttentionCuda, RepeatedRunsAreReproducible) {
  KESTREL_REQUIRE_GPU();
  const Problem pr = make_problem(Case{{1000, 1, 2049}, {1000, 1, 2049}, 8, 2, 128, true, BF}, 7);
  const Result a = run_flash(pr), b = run_flash(pr);
  EXPECT_EQ(a.out, b.out);
  EXPECT_EQ(a.dk, b.dk);
  EXPECT_EQ(a.dv, b.dv);
  EXPECT_EQ(0, std::memcmp(a.lse.data(), b.lse.data(), a.lse.size() * sizeof(float)));
  // dq: f32 atomics in varying order; after rounding, at most one ulp apart.
  const auto qa = to_float(a.dq, BF), qb = to_float(b.dq, BF);
  size_t differ = 0, beyond_ulp = 0;
  for (size_t i = 0; i < qa.size(); ++i) {
    if (qa[i] == qb[i]) continue;
    ++differ;
    beyond_ulp += std::abs(qa[i] - qb[i]) > std::ldexp(std::max(std::abs(qa[i]), std::abs(qb[i])), -7);
  }
  std::printf("[flash] dq repeat: %zu of %zu elements differ (max 1 bf16 ulp expected)\n", differ, qa.size());
  EXPECT_EQ(beyond_ulp, 0u);
}

// FlashAttentionParams::deterministic: the backward adds the key blocks' dq partials in a fixed order,
// so two runs give bitwise-equal dq (and dk, dv, out, lse as always). Shapes with many key blocks
// per query tile (4097 keys = 33 blocks), packed documents of odd lengths, GQA (a block walks the
// tiles of several heads), causal and bidirectional, head dims 64/128 and a padded one, and a sliding
// window (the first key block of a tile is not block 0); then the values against the references.
TEST(FlashAttentionCuda, DeterministicBackwardIsBitwiseReproducible) {
  KESTREL_REQUIRE_GPU();
  uint32_t seed = 1000;
  struct DetCase {
    Case cs;
    int window;
  };
  const std::vector<DetCase> cases = {
      {Case{{4097}, {4097}, 4, 1, 128, true, BF}, 0},
      {Case{{4097}, {4097}, 4, 2, 64, false, BF}, 0},
      {Case{{1000, 1, 2049, 17}, {1000, 1, 2049, 17}, 8, 2, 128, true, F16}, 0},
      {Case{{3, 200, 1, 1029}, {150, 7, 300, 1029}, 4, 4, 64, true, BF}, 0},  // len_q != len_k
      {Case{{1500, 63, 700}, {1500, 63, 700}, 4, 2, 72, false, BF}, 0},
      {Case{{3000, 129}, {3000, 129}, 4, 2, 128, true, BF}, 300},
      {Case{{3000, 129}, {3000, 129}, 4, 1, 64, true, F16}, 129},
  };
  for (const DetCase& dc : cases) {
    const Problem pr = make_problem(dc.cs, seed++);
    Result free_order;
    {
      RunOptionsScope scope({FlashKernel::Auto, false, dc.window});
      free_order = run_flash(pr);
    }
    RunOptionsScope scope({FlashKernel::Auto, true, dc.window});
    const Result a = run_flash(pr), b = run_flash(pr);
    size_t dq_diff = 0;
    for (size_t i = 0; i < a.dq.size(); ++i) dq_diff += a.dq[i] != b.dq[i];
    EXPECT_EQ(dq_diff, 0u) << dc.cs.name() << " window " << dc.window << ": dq not bitwise reproducible";
    EXPECT_EQ(a.dk, b.dk);
    EXPECT_EQ(a.dv, b.dv);
    EXPECT_EQ(a.out, b.out);
    EXPECT_EQ(count_nonfinite(to_float(a.dq, dc.cs.dtype)), 0u);
    // Same sum in another order: within f32 rounding of the free-order (atomic) result.
    const double e = rel_l2(to_float(a.dq, dc.cs.dtype), to_float(free_order.dq, dc.cs.dtype));
    std::printf("[flash] deterministic %-58s window %4d: dq differs in %zu elements between runs, rel vs atomic %.2e\n",
                dc.cs.name().c_str(), dc.window, dq_diff, e);
    EXPECT_LE(e, dc.cs.dtype == BF ? 4e-3 : 5e-4);
    EXPECT_EQ(a.dk, free_order.dk);  // dk, dv do not depend on the dq order
    EXPECT_EQ(a.dv, free_order.dv);
  }
  // Values against the float64 / naive references with the deterministic order (no window: the
  // references here have none; the window cases are checked against the atomic-order result above).
  RunOptionsScope scope({FlashKernel::Auto, true, 0});
  run_case(Case{{1, 17, 5, 64, 1, 33, 1}, {1, 17, 5, 64, 1, 33, 1}, 8, 1, 128, true, BF}, true, seed++);
  run_case(Case{{3, 200, 1, 129}, {150, 7, 300, 129}, 4, 4, 64, false, F16}, true, seed++);
  run_case(Case{{1000, 1, 4097, 17, 1}, {1000, 1, 4097, 17, 1}, 8, 2, 128, true, BF}, false, seed++);
}

// deterministic on the mma.sync backward (head dim > 128) is refused before anything runs.
TEST(FlashAttentionCuda, DeterministicBackwardRefusedWhereNotImplemented) {
  KESTREL_REQUIRE_GPU();
  RunOptionsScope scope({FlashKernel::Auto, true, 0});
  const Problem pr = make_problem(single(70, 2, 1, 256, true, BF), 77);
  try {
    run_flash(pr);
    ADD_FAILURE() << "expected kestrel::Error";
  } catch (const kestrel::Error& e) {
    EXPECT_NE(std::string(e.what()).find("deterministic"), std::string::npos) << e.what();
  }
}

// ---- wgmma primitives (flash_attention_wgmma.cuh) on one warpgroup, against a CPU GEMM ----
// S[64,128] = Q[64,128] K[128,128]^T with both operands K-major in swizzled shared tiles, and
// O[64,128] = P[64,128] V[128,128] with P in registers (A fragment layout) and V read MN-major.
// The V descriptor's leading/stride byte offsets come from the caller, so a failure can say which
// convention the hardware wants.
template <typename T>
__global__ void wgmma_probe_kernel(const T* q, const T* km, const T* pm, const T* vm, float* s_out, float* o_out,
                                   uint32_t v_lbo, uint32_t v_sbo) {
  using namespace kestrel::cuda::fa;
  extern __shared__ unsigned char raw[];
  const uint32_t sQ = (smem_u32(raw) + 1023u) & ~1023u, sK = sQ + 64 * 128 * 2, sV = sK + 128 * 128 * 2;
  const int tid = threadIdx.x, w = tid / 32, g = (tid % 32) / 4, c = tid % 4;
  load_tile_sw128<64, 128, 128>(sQ, q, 128, 64, 128, tid);
  load_tile_sw128<128, 128, 128>(sK, km, 128, 128, 128, tid);
  load_tile_sw128<128, 128, 128>(sV, vm, 128, 128, 128, tid);
  cp_async_commit();
  cp_async_wait<0>();
  fence_proxy_async();
  __syncthreads();
  float s[64], o[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) o[i] = 0.f;
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < 8; ++kk)
    WgmmaSS<T, 128>::run(s, wgmma_desc(sQ + (kk / 4) * 64 * 128 + (kk % 4) * 32, 16, 1024),
                         wgmma_desc(sK + (kk / 4) * 128 * 128 + (kk % 4) * 32, 16, 1024), kk > 0);
  wgmma_commit();
  wgmma_wait<0>();
  fence_regs(s);
  uint32_t pa[8][4];
  const uint32_t* p32 = reinterpret_cast<const uint32_t*>(pm);  // [64][64] pairs
#pragma unroll
  for (int kk = 0; kk < 8; ++kk) {
    const int r0 = 16 * w + g, c0 = (16 * kk + 2 * c) / 2;
    pa[kk][0] = p32[r0 * 64 + c0];
    pa[kk][1] = p32[(r0 + 8) * 64 + c0];
    pa[kk][2] = p32[r0 * 64 + c0 + 4];
    pa[kk][3] = p32[(r0 + 8) * 64 + c0 + 4];
  }
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < 8; ++kk) WgmmaRS<T, 128>::run(o, pa[kk], wgmma_desc(sV + kk * 2048, v_lbo, v_sbo));
  wgmma_commit();
  wgmma_wait<0>();
  fence_regs(o);
#pragma unroll
  for (int i = 0; i < 64; ++i) {
    const int row = 16 * w + g + 8 * ((i / 2) % 2), col = 8 * (i / 4) + 2 * c + (i % 2);
    s_out[row * 128 + col] = s[i];
    o_out[row * 128 + col] = o[i];
  }
}

// D[64,64] = A[64,128] B[128,64] with A stored transposed ([k][m]) and B [k][n], both MN-major
// in swizzled [128][64] tiles (WgmmaSST: the backward's dQ = dS K from dS^T and K).
template <typename T>
__global__ void wgmma_sst_probe_kernel(const T* at, const T* bm, float* d_out) {
  using namespace kestrel::cuda::fa;
  extern __shared__ unsigned char raw[];
  const uint32_t sA = (smem_u32(raw) + 1023u) & ~1023u, sB = sA + 128 * 64 * 2;
  const int tid = threadIdx.x, w = tid / 32, g = (tid % 32) / 4, c = tid % 4;
  load_tile_sw128<128, 64, 128>(sA, at, 64, 128, 64, tid);
  load_tile_sw128<128, 64, 128>(sB, bm, 64, 128, 64, tid);
  cp_async_commit();
  cp_async_wait<0>();
  fence_proxy_async();
  __syncthreads();
  float d[32];
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < 8; ++kk)
    WgmmaSST<T, 64>::run(d, wgmma_desc(sA + kk * 2048, 128 * 128, 1024), wgmma_desc(sB + kk * 2048, 128 * 128, 1024),
                         kk > 0);
  wgmma_commit();
  wgmma_wait<0>();
  fence_regs(d);
#pragma unroll
  for (int i = 0; i < 32; ++i) d_out[(16 * w + g + 8 * ((i / 2) % 2)) * 64 + 8 * (i / 4) + 2 * c + (i % 2)] = d[i];
}

TEST(FlashAttentionCuda, WgmmaPrimitivesMatchCpuGemm) {
  KESTREL_REQUIRE_GPU();
  for (AttnDType t : {AttnDType::BF16, AttnDType::F16}) {
    std::mt19937 rng(42);
    const LowTensor q = random_tensor(64 * 128, 1.f, t, rng), km = random_tensor(128 * 128, 1.f, t, rng),
                    pm = random_tensor(64 * 128, 1.f, t, rng), vm = random_tensor(128 * 128, 1.f, t, rng);
    std::vector<double> s_ref(64 * 128, 0.0), o_ref(64 * 128, 0.0);
    for (int i = 0; i < 64; ++i)
      for (int j = 0; j < 128; ++j)
        for (int d = 0; d < 128; ++d) {
          s_ref[i * 128 + j] += (double)q.val[i * 128 + d] * km.val[j * 128 + d];
          o_ref[i * 128 + j] += (double)pm.val[i * 128 + d] * vm.val[d * 128 + j];
        }
    DeviceBuffer<uint16_t> dq(q.bits.size()), dk(km.bits.size()), dp(pm.bits.size()), dv(vm.bits.size());
    dq.upload(q.bits), dk.upload(km.bits), dp.upload(pm.bits), dv.upload(vm.bits);
    DeviceBuffer<float> ds(64 * 128), dout(64 * 128);
    const size_t smem = (64 + 2 * 128) * 128 * 2 + 1024;
    // (leading, stride) byte offsets of V: ours (64-column slab stride, 8-key group stride), then swapped.
    const uint32_t conv[2][2] = {{128 * 128, 1024}, {1024, 128 * 128}};
    for (int v = 0; v < 2; ++v) {
      ds.poison(), dout.poison();
      if (t == AttnDType::BF16) {
        auto kern = wgmma_probe_kernel<__nv_bfloat16>;
        KESTREL_CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
        kern<<<1, 128, smem>>>((const __nv_bfloat16*)dq.ptr, (const __nv_bfloat16*)dk.ptr,
                               (const __nv_bfloat16*)dp.ptr, (const __nv_bfloat16*)dv.ptr, ds.ptr, dout.ptr,
                               conv[v][0], conv[v][1]);
      } else {
        auto kern = wgmma_probe_kernel<__half>;
        KESTREL_CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
        kern<<<1, 128, smem>>>((const __half*)dq.ptr, (const __half*)dk.ptr, (const __half*)dp.ptr,
                               (const __half*)dv.ptr, ds.ptr, dout.ptr, conv[v][0], conv[v][1]);
      }
      KESTREL_CUDA_CHECK_LAUNCH();
      KESTREL_CUDA_CHECK(cudaDeviceSynchronize());
      const double e_s = rel_l2(ds.download(), s_ref), e_o = rel_l2(dout.download(), o_ref);
      std::printf("[flash] wgmma probe %s V(lbo %u, sbo %u): S rel %.2e, O rel %.2e\n",
                  t == AttnDType::BF16 ? "bf16" : "f16", conv[v][0], conv[v][1], e_s, e_o);
      if (v == 0) {  // the convention the kernel uses
        EXPECT_LE(e_s, 1e-4);
        EXPECT_LE(e_o, 1e-4);
      }
    }
    // Both operands MN-major (transpose immediates): D = At^T Bm, At [128][64], Bm [128][64].
    const LowTensor at = random_tensor(128 * 64, 1.f, t, rng), bm = random_tensor(128 * 64, 1.f, t, rng);
    std::vector<double> d_ref(64 * 64, 0.0);
    for (int m = 0; m < 64; ++m)
      for (int n = 0; n < 64; ++n)
        for (int kx = 0; kx < 128; ++kx) d_ref[m * 64 + n] += (double)at.val[kx * 64 + m] * bm.val[kx * 64 + n];
    DeviceBuffer<uint16_t> dat(at.bits.size()), dbm(bm.bits.size());
    dat.upload(at.bits), dbm.upload(bm.bits);
    DeviceBuffer<float> dd(64 * 64);
    dd.poison();
    const size_t smem2 = 2 * 128 * 64 * 2 + 1024;
    if (t == AttnDType::BF16) {
      auto kern = wgmma_sst_probe_kernel<__nv_bfloat16>;
      KESTREL_CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem2));
      kern<<<1, 128, smem2>>>((const __nv_bfloat16*)dat.ptr, (const __nv_bfloat16*)dbm.ptr, dd.ptr);
    } else {
      auto kern = wgmma_sst_probe_kernel<__half>;
      KESTREL_CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem2));
      kern<<<1, 128, smem2>>>((const __half*)dat.ptr, (const __half*)dbm.ptr, dd.ptr);
    }
    KESTREL_CUDA_CHECK_LAUNCH();
    KESTREL_CUDA_CHECK(cudaDeviceSynchronize());
    const double e_d = rel_l2(dd.download(), d_ref);
    std::printf("[flash] wgmma SST probe %s: D rel %.2e\n", t == AttnDType::BF16 ? "bf16" : "f16", e_d);
    EXPECT_LE(e_d, 1e-4);
  }
}

TEST(FlashAttentionCuda, InvalidParamsThrow) {
  FlashAttentionParams p{};
  int dummy[4] = {};
  p.q = p.k = p.v = p.out = dummy;
  p.lse = reinterpret_cast<float*>(dummy);
  p.cu_seqlens_q = p.cu_seqlens_k = dummy;
  p.num_docs = 1, p.max_seqlen_q = p.max_seqlen_k = 4, p.total_q = p.total_k = 4;
  p.num_heads_q = 6, p.num_heads_kv = 4, p.head_dim = 64, p.softmax_scale = 0.125f;
  EXPECT_THROW(kestrel::cuda::flash_attention_forward(p, nullptr), kestrel::Error);  // 6 % 4 != 0
  p.num_heads_q = 8, p.head_dim = 12;
  EXPECT_THROW(kestrel::cuda::flash_attention_forward(p, nullptr), kestrel::Error);  // not a multiple of 8
  p.head_dim = 264;
  EXPECT_THROW(kestrel::cuda::flash_attention_forward(p, nullptr), kestrel::Error);  // > 256
  p.head_dim = 64, p.total_q = p.total_k = 0;
  EXPECT_THROW(kestrel::cuda::flash_attention_forward(p, nullptr), kestrel::Error);  // total_q/total_k missing
  p.total_q = 4, p.total_k = 3;
  EXPECT_THROW(kestrel::cuda::flash_attention_forward(p, nullptr), kestrel::Error);  // total_k < max_seqlen_k
  p.total_k = 4, p.causal = false, p.window = 2;
  EXPECT_THROW(kestrel::cuda::flash_attention_forward(p, nullptr), kestrel::Error);  // window needs causal
}

// ---- narrow head dims (traits.h: kernel head dims 80, 96, 112 for head dims in (64, 128)) ----

// The kernel choice, without a device (DeviceProps of an H100/H200): the narrow widths for head dims
// in (64, 128) except 120, the padded 128 kernel for the variants not built narrow and for
// FlashKernel::HopperPadded, 64 below. A choice that silently went back to 128 fails here.
TEST(FlashAttentionCuda, NarrowHeadDimChoice) {
  using kestrel::cuda::fa::choose_kernel;
  using kestrel::cuda::fa::DeviceProps;
  const DeviceProps h100{9, 0, 132}, a100{8, 0, 108};
  FlashAttentionParams p{};
  auto dim = [&](int d, bool backward) {
    p.head_dim = d;
    return choose_kernel(p, h100, backward).kernel_head_dim;
  };
  for (bool bwd : {false, true}) {
    EXPECT_EQ(dim(72, bwd), 80);
    EXPECT_EQ(dim(80, bwd), 80);
    EXPECT_EQ(dim(88, bwd), 96);
    EXPECT_EQ(dim(96, bwd), 96);
    EXPECT_EQ(dim(104, bwd), 112);
    EXPECT_EQ(dim(112, bwd), 112);
    EXPECT_EQ(dim(120, bwd), 128);
    EXPECT_EQ(dim(128, bwd), 128);
    EXPECT_EQ(dim(64, bwd), 64);
    EXPECT_EQ(dim(40, bwd), 64);
  }
  p.head_dim = 72;
  EXPECT_EQ(choose_kernel(p, h100, false).kernel, FlashKernel::Hopper);
  p.kernel = FlashKernel::HopperPadded;
  EXPECT_EQ(choose_kernel(p, h100, false).kernel, FlashKernel::Hopper);
  EXPECT_EQ(choose_kernel(p, h100, false).kernel_head_dim, 128);
  EXPECT_THROW(choose_kernel(p, a100, false), kestrel::Error);
  p.kernel = FlashKernel::Auto;
  p.deterministic = true;  // no deterministic narrow backward: padded; the forward stays narrow
  EXPECT_EQ(choose_kernel(p, h100, true).kernel_head_dim, 128);
  EXPECT_EQ(choose_kernel(p, h100, false).kernel_head_dim, 80);
  p.deterministic = false;
  const int32_t* fake_prefix = reinterpret_cast<const int32_t*>(&p);  // only compared with nullptr
  p.prefix_len = fake_prefix;  // no prefix-LM narrow kernels: padded both ways
  EXPECT_EQ(choose_kernel(p, h100, false).kernel_head_dim, 128);
  EXPECT_EQ(choose_kernel(p, h100, true).kernel_head_dim, 128);
  p.prefix_len = nullptr;
  EXPECT_EQ(choose_kernel(p, a100, false).kernel, FlashKernel::MmaSync);
  EXPECT_EQ(choose_kernel(p, a100, false).kernel_head_dim, 256);
}

// Forward and backward of the narrow kernels against the float64 reference (small shapes) and the
// naive GPU reference (large): every head dim they serve (72..112, 120 on the padded 128), packs with
// length-1 documents and len_q != len_k (rows without keys), GQA 1/2/4/8, causal and bidirectional,
// bf16 and f16, spread scores (O rescaled across key tiles), and the so400m shape (16 heads of 72,
// 729-token images, bidirectional).
TEST(FlashAttentionCuda, NarrowHeadDimsMatchReferences) {
  KESTREL_REQUIRE_GPU();
  uint32_t seed = 1300;
  for (bool causal : {true, false}) {
    for (int d : {72, 80, 88, 96, 104, 112, 120}) {
      const AttnDType t = (d / 8) % 2 ? BF : F16;
      run_case(Case{{1, 17, 5, 64, 1, 33, 1}, {1, 17, 5, 64, 1, 33, 1}, 4, 2, d, causal, t}, true, seed++);
      run_case(Case{{3, 200, 1, 129}, {150, 7, 300, 129}, 2, 1, d, causal, t == BF ? F16 : BF}, true, seed++);
      run_case(Case{{5, 130, 191, 193, 64, 1, 257}, {5, 130, 191, 193, 64, 1, 257}, 8, 1, d, causal, t}, true,
               seed++, 3.f);
    }
    for (int d : {72, 96, 112}) {
      run_case(Case{{1500, 63, 700}, {1500, 63, 700}, 8, 2, d, causal, BF}, false, seed++, 3.f);
      run_case(Case{{1000, 1, 4097, 17, 1}, {1000, 1, 4097, 17, 1}, 4, 4, d, causal, F16}, false, seed++);
    }
  }
  run_case(Case{{729, 729, 729}, {729, 729, 729}, 16, 16, 72, false, BF}, false, seed++);  // so400m
  run_case(Case{{729, 729, 729}, {729, 729, 729}, 16, 16, 72, false, F16}, false, seed++);
}

// The narrow kernels compute the padded kernels' sums without the zero columns: S's extra k-steps
// add exact zeros and O / dK / dV columns are independent of the GEMM width, so out, lse, dk and dv
// must be bitwise those of FlashKernel::HopperPadded on the same inputs (dq: f32 atomics in
// arrival order, compared within rounding).
TEST(FlashAttentionCuda, NarrowHeadDimsMatchPaddedKernels) {
  KESTREL_REQUIRE_GPU();
  uint32_t seed = 1400;
  for (int d : {72, 88, 112}) {
    for (AttnDType t : {BF, F16}) {
      for (bool causal : {true, false}) {
        const Problem pr = make_problem(Case{{900, 1, 333}, {900, 1, 333}, 4, 2, d, causal, t}, seed++, 2.f);
        Result padded, narrow;
        {
          RunOptionsScope scope({FlashKernel::HopperPadded});
          padded = run_flash(pr);
        }
        {
          RunOptionsScope scope({FlashKernel::Hopper});
          narrow = run_flash(pr);
        }
        auto differ = [](const auto& a, const auto& b) {
          size_t n = 0;
          for (size_t i = 0; i < a.size(); ++i) n += std::memcmp(&a[i], &b[i], sizeof(a[i])) != 0;
          return n;
        };
        const size_t d_out = differ(narrow.out, padded.out), d_lse = differ(narrow.lse, padded.lse),
                     d_dk = differ(narrow.dk, padded.dk), d_dv = differ(narrow.dv, padded.dv);
        const double e_dq = rel_l2(to_float(narrow.dq, t), to_float(padded.dq, t));
        std::printf("[flash] narrow vs padded D=%d %s %s: differing out %zu lse %zu dk %zu dv %zu, dq rel %.2e\n", d,
                    t == BF ? "bf16" : "f16", causal ? "causal" : "bidir", d_out, d_lse, d_dk, d_dv, e_dq);
        EXPECT_EQ(d_out, 0u);
        EXPECT_EQ(d_lse, 0u);
        EXPECT_EQ(d_dk, 0u);
        EXPECT_EQ(d_dv, 0u);
        EXPECT_LE(e_dq, t == BF ? 4e-3 : 5e-4);
        EXPECT_EQ(count_nonfinite(to_float(narrow.dq, t)), 0u);
      }
    }
  }
}

}  // namespace
