// CPU GEMM: cache-blocked, packed panels, a 4x32 register tile, parallel over row blocks and batch.
//
// Operands of any dtype/strides are packed into contiguous compute-type panels (so transposes and
// bf16 storage cost one pass), then a register-blocked kernel accumulates C in f32 (f64 for f64).
// The micro-kernel is compiled for AVX-512 (x86-64-v4), AVX2+FMA (v3) and baseline x86-64
// (target_clones), so a binary built here runs on any x86-64 machine and uses the widest units it
// has. Adding the v4 clone took 2 threads on the AVX-512 EPYC dev box from ~23-29 to ~31-89 GFLOP/s
// (bench/notes/cpu_ops.md).
#include <algorithm>
#include <cstring>
#include <vector>

#include "cpu/loops.h"
#include "kernels/matmul.h"
#include "kestrel/runtime/dtype_dispatch.h"

namespace kestrel::cpu {
namespace {

constexpr int64_t kMR = 4, kNR = 32;        // register tile
constexpr int64_t kMC = 64, kKC = 256, kNC = 512;  // cache blocks

// C[mr x nr] += A_panel[kc][kMR] * B_panel[kc][kNR]; c has row stride ldc.
template <typename C>
#if defined(__x86_64__) && !defined(__clang__)
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
void micro_kernel(int64_t kc, const C* __restrict ap, const C* __restrict bp, C* __restrict c, int64_t ldc,
                  int64_t mr, int64_t nr) {
  C acc[kMR][kNR] = {};
  for (int64_t k = 0; k < kc; ++k) {
    const C* brow = bp + k * kNR;
    const C* acol = ap + k * kMR;
    for (int64_t i = 0; i < kMR; ++i) {
      C av = acol[i];
      for (int64_t j = 0; j < kNR; ++j) acc[i][j] += av * brow[j];
    }
  }
  for (int64_t i = 0; i < mr; ++i)
    for (int64_t j = 0; j < nr; ++j) c[i * ldc + j] += acc[i][j];
}

template <typename C, typename TA, typename TB, typename TO, typename TBias>
void gemm_typed(const Tensor& out, const Tensor& a, const Tensor& b, const Tensor& bias, double alpha, double beta) {
  int64_t B = out.shape()[0], M = out.shape()[1], N = out.shape()[2], K = a.shape()[2];
  const TA* pa = static_cast<const TA*>(a.storage()->data());
  const TB* pb = static_cast<const TB*>(b.storage()->data());
  TO* po = static_cast<TO*>(out.data_ptr());
  const TBias* pbias = bias.defined() ? static_cast<const TBias*>(bias.data_ptr()) : nullptr;
  int64_t bias_stride = bias.defined() ? bias.strides()[0] : 0;
  int64_t sa0 = a.strides()[0], sa1 = a.strides()[1], sa2 = a.strides()[2];
  int64_t sb0 = b.strides()[0], sb1 = b.strides()[1], sb2 = b.strides()[2];
  int64_t mblocks = (M + kMC - 1) / kMC;

  parallel_for(0, B * mblocks, 1, [&](int64_t wb, int64_t we) {
    std::vector<C> apack(kKC * kMC), bpack(kKC * ((kNC + kNR - 1) / kNR) * kNR), cbuf(kMC * kNC);
    for (int64_t w = wb; w < we; ++w) {
      int64_t bi = w / mblocks, m0 = (w % mblocks) * kMC, mc = std::min(kMC, M - m0);
      const TA* ab = pa + a.offset() + bi * sa0;
      const TB* bb = pb + b.offset() + bi * sb0;
      TO* ob = po + bi * M * N;
      for (int64_t n0 = 0; n0 < N; n0 += kNC) {
        int64_t nc = std::min(kNC, N - n0);
        int64_t npanels = (nc + kNR - 1) / kNR;
        std::fill(cbuf.begin(), cbuf.begin() + mc * nc, C(0));
        for (int64_t k0 = 0; k0 < K; k0 += kKC) {
          int64_t kc = std::min(kKC, K - k0);
          // Pack B[k0:k0+kc, n0:n0+nc] into panels of kNR columns: bpack[p][k][j].
          for (int64_t p = 0; p < npanels; ++p) {
            C* dst = bpack.data() + p * kc * kNR;
            for (int64_t k = 0; k < kc; ++k)
              for (int64_t j = 0; j < kNR; ++j) {
                int64_t n = n0 + p * kNR + j;
                dst[k * kNR + j] = n < n0 + nc ? static_cast<C>(to_compute(bb[(k0 + k) * sb1 + n * sb2])) : C(0);
              }
          }
          // Pack A[m0:m0+mc, k0:k0+kc] into panels of kMR rows: apack[q][k][i].
          int64_t mpanels = (mc + kMR - 1) / kMR;
          for (int64_t q = 0; q < mpanels; ++q) {
            C* dst = apack.data() + q * kc * kMR;
            for (int64_t k = 0; k < kc; ++k)
              for (int64_t i = 0; i < kMR; ++i) {
                int64_t m = m0 + q * kMR + i;
                dst[k * kMR + i] = m < m0 + mc ? static_cast<C>(to_compute(ab[m * sa1 + (k0 + k) * sa2])) : C(0);
              }
          }
          for (int64_t q = 0; q < mpanels; ++q)
            for (int64_t p = 0; p < npanels; ++p)
              micro_kernel<C>(kc, apack.data() + q * kc * kMR, bpack.data() + p * kc * kNR,
                              cbuf.data() + q * kMR * nc + p * kNR, nc, std::min(kMR, mc - q * kMR),
                              std::min(kNR, nc - p * kNR));
        }
        for (int64_t i = 0; i < mc; ++i)
          for (int64_t j = 0; j < nc; ++j) {
            C v = static_cast<C>(alpha) * cbuf[i * nc + j];
            if (pbias) v += static_cast<C>(to_compute(pbias[(n0 + j) * bias_stride]));
            TO& o = ob[(m0 + i) * N + n0 + j];
            if (beta != 0.0) v += static_cast<C>(beta) * static_cast<C>(to_compute(o));
            o = from_compute<TO>(static_cast<compute_t<TO>>(v));
          }
      }
    }
  });
}

void matmul_cpu(const Tensor& out, const Tensor& a, const Tensor& b, const Tensor& bias, double alpha, double beta) {
  // The op layer guarantees one dtype for a, b, out and bias.
  dispatch_floating(out.dtype(), "matmul", [&](auto tag) {
    using T = decltype(tag);
    gemm_typed<compute_t<T>, T, T, T, T>(out, a, b, bias, alpha, beta);
  });
}

}  // namespace

KESTREL_REGISTER_KERNEL(matmul, cpu, matmul_cpu);

}  // namespace kestrel::cpu
