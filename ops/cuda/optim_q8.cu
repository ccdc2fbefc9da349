// CUDA AdamW on 8-bit block-wise moments (kernels/optim.h adamw_q8; the code in kestrel/ops/adamw_q8.h).
//
// One thread block per quantisation block of 2048 elements: 256 threads x 8 elements, strided by 256
// so loads and stores coalesce. Each thread dequantises its m and v with the block's old scales,
// runs adamw_step's f32 arithmetic (explicitly rounded intrinsics, no FMA contraction, as
// cpu/optim.cpp), writes the parameter (f32 master + optional rounded copy, or a 16-bit parameter in
// place), keeps the new moments in registers; one block-wide NaN-propagating absmax gives the new
// scales, and the codes are written from the registers: one pass over the state, one launch per
// group of up to kMaxTensors tensors. Encoding and decoding are the shared closed forms, so the
// result is bit-identical to the CPU reference, the Philox draws included (word i of the tensor).
#include <vector>

#include "cuda/common.cuh"
#include "cuda/optim_rounding.cuh"
#include "kernels/optim.h"
#include "kestrel/ops/adamw_q8.h"

namespace kestrel::cuda_ops {
namespace {

constexpr int kMaxTensors = 24;
constexpr int kThreads = 256;
constexpr int kPerThread = static_cast<int>(q8::kBlock) / kThreads;  // 8
static_assert(kPerThread * kThreads == q8::kBlock, "a thread block covers one quantisation block");

struct Q8List {
  int count;
  int block_start[kMaxTensors + 1];
  void* p[kMaxTensors];
  const void* g[kMaxTensors];
  void* copy[kMaxTensors];
  uint8_t* mc[kMaxTensors];
  uint8_t* vc[kMaxTensors];
  float* ms[kMaxTensors];
  float* vs[kMaxTensors];
  int64_t n[kMaxTensors];
  uint64_t seed[kMaxTensors], mseed[kMaxTensors], vseed[kMaxTensors];
  DType pt[kMaxTensors], gt[kMaxTensors], ct[kMaxTensors];
};


// NaN-propagating absmax of the block's (non-negative or NaN) partials.
__device__ __forceinline__ float block_absmax(float a, float* sm) {
  for (int o = 16; o > 0; o >>= 1) a = q8::absmax_step(a, __shfl_xor_sync(0xffffffffu, a, o));
  if ((threadIdx.x & 31) == 0) sm[threadIdx.x >> 5] = a;
  __syncthreads();
  float r = 0.0f;
#pragma unroll
  for (int w = 0; w < kThreads / 32; ++w) r = q8::absmax_step(r, sm[w]);
  return r;
}

__global__ __launch_bounds__(kThreads) void adamw_q8_kernel(Q8List L, AdamWConst c) {
  __shared__ float sm_m[kThreads / 32], sm_v[kThreads / 32];
  const int t = find_tensor(L.block_start, L.count);
  const int64_t k = blockIdx.x - L.block_start[t], n = L.n[t], base = k * q8::kBlock;
  void* p = L.p[t];
  const DType pt = L.pt[t];
  uint8_t *mc = L.mc[t], *vc = L.vc[t];
  const float old_ms = L.ms[t][k], old_vs = L.vs[t][k];
  float mi[kPerThread], vi[kPerThread];
  float am = 0.0f, av = 0.0f;
#pragma unroll
  for (int r = 0; r < kPerThread; ++r) {
    const int64_t i = base + r * kThreads + threadIdx.x;
    mi[r] = vi[r] = 0.0f;
    if (i >= n) continue;
    const float gi = load_as_f32(L.g[t], i, L.gt[t]);
    float pi = __fmul_rn(load_as_f32(p, i, pt), c.decay);
    const float m0 = __fmul_rn(q8::decode_m(mc[i]), old_ms), v0 = __fmul_rn(q8::decode_v(vc[i]), old_vs);
    mi[r] = __fadd_rn(__fmul_rn(c.b1, m0), __fmul_rn(c.one_minus_b1, gi));
    vi[r] = __fadd_rn(__fmul_rn(c.b2, v0), __fmul_rn(__fmul_rn(c.one_minus_b2, gi), gi));
    const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi[r]), c.bc2_sqrt), c.eps);
    pi = __fsub_rn(pi, __fdiv_rn(__fmul_rn(c.step_size, mi[r]), denom));
    if (pt == DType::F32) {
      static_cast<float*>(p)[i] = pi;
      if (L.copy[t] != nullptr) store_rounded(L.copy[t], L.ct[t], i, pi, L.seed[t]);
    } else {
      store_rounded(p, pt, i, pi, L.seed[t]);
    }
    am = q8::absmax_step(am, mi[r]);
    av = q8::absmax_step(av, vi[r]);
  }
  am = block_absmax(am, sm_m);
  av = block_absmax(av, sm_v);
  if (threadIdx.x == 0) {
    L.ms[t][k] = am;
    L.vs[t][k] = av;
  }
#pragma unroll
  for (int r = 0; r < kPerThread; ++r) {
    const int64_t i = base + r * kThreads + threadIdx.x;
    if (i >= n) continue;
    mc[i] = am > 0.0f ? q8::encode_m(mi[r], am, q8::uniform_or_half(L.mseed[t], i)) : uint8_t{0};
    vc[i] = av > 0.0f ? q8::encode_v(vi[r], av, q8::uniform_or_half(L.vseed[t], i)) : uint8_t{0};
  }
}

void adamw_q8_cuda(const std::vector<kernels::AdamWQ8Tensors>& tensors, const kernels::AdamWHyper& h) {
  const AdamWConst c = adamw_constants(h);
  cudaStream_t s = cuda::current_stream();
  size_t i = 0;
  while (i < tensors.size()) {
    Q8List L{};
    int64_t blocks = 0;
    for (; i < tensors.size() && L.count < kMaxTensors; ++i) {
      const auto& t = tensors[i];
      check_cuda_dtype(t.param.dtype(), "adamw_step_q8");
      check_cuda_dtype(t.grad.dtype(), "adamw_step_q8");
      if (t.param_copy.defined()) check_cuda_dtype(t.param_copy.dtype(), "adamw_step_q8");
      const int64_t n = t.param.numel();
      if (n == 0) continue;
      const int k = L.count++;
      L.block_start[k] = static_cast<int>(blocks);
      blocks += q8::num_blocks(n);
      KESTREL_CHECK(blocks < (int64_t{1} << 31), "adamw_step_q8", "too many blocks in one launch");
      L.p[k] = t.param.data_ptr();
      L.pt[k] = t.param.dtype();
      L.g[k] = t.grad.data_ptr();
      L.gt[k] = t.grad.dtype();
      L.copy[k] = t.param_copy.defined() ? t.param_copy.data_ptr() : nullptr;
      L.ct[k] = t.param_copy.defined() ? t.param_copy.dtype() : DType::F32;
      L.mc[k] = ptr<uint8_t>(t.m_codes);
      L.vc[k] = ptr<uint8_t>(t.v_codes);
      L.ms[k] = ptr<float>(t.m_scale);
      L.vs[k] = ptr<float>(t.v_scale);
      L.n[k] = n;
      L.seed[k] = t.stochastic_rounding_seed;
      L.mseed[k] = q8::m_stream(t.moment_seed);
      L.vseed[k] = q8::v_stream(t.moment_seed);
    }
    if (L.count == 0) continue;
    L.block_start[L.count] = static_cast<int>(blocks);
    adamw_q8_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, s>>>(L, c);
    KESTREL_CUDA_CHECK_LAUNCH();
  }
}

}  // namespace

KESTREL_REGISTER_KERNEL(adamw_q8, cuda, adamw_q8_cuda);

}  // namespace kestrel::cuda_ops
