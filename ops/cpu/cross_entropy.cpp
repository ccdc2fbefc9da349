// CPU reference for fused linear + cross-entropy: logits exist only one [chunk_tokens, chunk_vocab]
// block at a time (computed with the CPU GEMM kernel), reduced per row by an online log-sum-exp.
//
// Forward, per token chunk: for each vocab chunk Z = X_c W_c^T, then per row the running max m and
// scaled sum s (s <- s e^(m - m') + sum_j e^(z_j - m')), the sum of logits (label smoothing) and the
// label's logit. lse = m + log s gives the loss terms (formula in kestrel/ops/cross_entropy.h).
// Backward, per token chunk and vocab chunk: recompute Z, turn it into
//   G_ij = c_i [ e^(z_ij - lse_i) (1 + 2 z_loss lse_i) - eps / V - (1 - eps) [j = y_i] ],
// c_i = upstream * w_i / (sum of weights | 1), and fold it into d_hidden_c += G W_c and
// d_weight_c += G^T X_c. Compute type f32 (f64 for f64 inputs); 16-bit inputs are converted one chunk
// at a time; per-row statistics in f64.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "kernels/cross_entropy.h"
#include "kernels/matmul.h"
#include "kestrel/runtime/dtype_dispatch.h"
#include "kestrel/runtime/memory.h"
#include "kestrel/runtime/parallel.h"

namespace kestrel::cpu {
namespace {

DType compute_dtype(DType t) { return t == DType::F64 ? DType::F64 : DType::F32; }

// Rows [start, start + n) of a contiguous [R, H] matrix, in the compute dtype.
Tensor rows_as(const Tensor& x, int64_t start, int64_t n, DType ct) {
  Tensor r = x.narrow_view(0, start, n);
  return r.dtype() == ct ? r : r.to(ct);
}

// out[1, M, N] = a[M, K] @ b (+ beta * out), through the CPU matmul kernel.
void gemm(const Tensor& out, const Tensor& a, const Tensor& b, double beta) {
  kernels::dispatch(kernels::matmul, "fused_linear_cross_entropy", Device::cpu(), out, a, b, Tensor(), 1.0, beta);
}
Tensor as_batch(const Tensor& m) {  // [M, K] view -> [1, M, K]
  return m.as_strided({1, m.shape()[0], m.shape()[1]}, {0, m.strides()[0], m.strides()[1]}, m.offset());
}
Tensor as_batch_t(const Tensor& m) {  // [M, K] view -> [1, K, M] (transposed)
  return m.as_strided({1, m.shape()[1], m.shape()[0]}, {0, m.strides()[1], m.strides()[0]}, m.offset());
}

struct TokenInfo {
  std::vector<double> weight;  // [N], 0 for ignored tokens
  double denom = 0;            // sum of weights over non-ignored tokens
};

TokenInfo token_info(const Tensor& labels, const Tensor& token_weights, const kernels::CrossEntropyParams& p) {
  int64_t N = labels.numel();
  const int64_t* y = labels.data<int64_t>();
  TokenInfo t;
  t.weight.assign(N, 0.0);
  std::vector<double> w;
  if (token_weights.defined()) w = [&] {
      Tensor h = token_weights.to(DType::F64).contiguous();
      return std::vector<double>(h.data<double>(), h.data<double>() + N);
    }();
  for (int64_t i = 0; i < N; ++i) {
    if (y[i] == p.ignore_index) continue;
    t.weight[i] = w.empty() ? 1.0 : w[i];
    t.denom += t.weight[i];
  }
  return t;
}

template <typename C>
void forward_typed(const Tensor& loss, const Tensor& lse, const Tensor& hidden, const Tensor& weight,
                   const Tensor& labels, const Tensor& token_weights, const kernels::CrossEntropyParams& p) {
  const int64_t N = hidden.shape()[0], V = weight.shape()[0];
  const int64_t Nc = p.chunk_tokens, Vc = p.chunk_vocab;
  const DType ct = compute_dtype(hidden.dtype());
  const int64_t* y = labels.data<int64_t>();
  C* plse = lse.data<C>();  // [N]
  TokenInfo info = token_info(labels, token_weights, p);
  const double eps = p.label_smoothing, zl = p.z_loss;

  TagScope scratch(MemoryTag::Workspace);  // chunk buffers and converted chunks are kernel scratch
  Tensor zbuf = Tensor::empty({Nc * Vc}, ct);  // one logits block [Nc, Vc]
  std::vector<double> m(Nc), s(Nc), zsum(Nc), zy(Nc);
  double total = 0;
  for (int64_t n0 = 0; n0 < N; n0 += Nc) {
    const int64_t nc = std::min(Nc, N - n0);
    Tensor xc = rows_as(hidden, n0, nc, ct);  // [nc, H]
    std::fill(m.begin(), m.end(), -std::numeric_limits<double>::infinity());
    std::fill(s.begin(), s.end(), 0.0);
    std::fill(zsum.begin(), zsum.end(), 0.0);
    std::fill(zy.begin(), zy.end(), 0.0);
    for (int64_t v0 = 0; v0 < V; v0 += Vc) {
      const int64_t vc = std::min(Vc, V - v0);
      Tensor wc = rows_as(weight, v0, vc, ct);  // [vc, H]
      Tensor z = zbuf.narrow_view(0, 0, nc * vc).view({1, nc, vc});
      gemm(z, as_batch(xc), as_batch_t(wc), 0.0);
      const C* pz = z.data<C>();
      parallel_for(0, nc, std::max<int64_t>(1, 16384 / vc), [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) {
          const C* row = pz + i * vc;
          double cm = m[i], zs = 0;
          for (int64_t j = 0; j < vc; ++j) cm = std::max(cm, static_cast<double>(row[j]));
          double acc = s[i] * std::exp(m[i] - cm);  // m[i] = -inf and s = 0 on the first chunk: 0 * 0
          if (s[i] == 0) acc = 0;
          for (int64_t j = 0; j < vc; ++j) {
            acc += std::exp(static_cast<double>(row[j]) - cm);
            zs += row[j];
          }
          m[i] = cm;
          s[i] = acc;
          zsum[i] += zs;
          int64_t yi = y[n0 + i];
          if (yi >= v0 && yi < v0 + vc) zy[i] = row[yi - v0];
        }
      });
    }
    for (int64_t i = 0; i < nc; ++i) {
      double l = m[i] + std::log(s[i]);
      plse[n0 + i] = static_cast<C>(l);
      double w = info.weight[n0 + i];
      if (w == 0) continue;
      double li = (1 - eps) * (l - zy[i]) + eps * (l - zsum[i] / static_cast<double>(V)) + zl * l * l;
      total += w * li;
    }
  }
  double r = p.reduction == Reduction::Sum ? total : (info.denom != 0 ? total / info.denom : 0.0);
  *loss.data<C>() = static_cast<C>(r);
}

template <typename C>
void backward_typed(const Tensor& d_hidden, const Tensor& d_weight, const Tensor& grad_loss, const Tensor& hidden,
                    const Tensor& weight, const Tensor& labels, const Tensor& token_weights, const Tensor& lse,
                    const kernels::CrossEntropyParams& p) {
  const int64_t N = hidden.shape()[0], H = hidden.shape()[1], V = weight.shape()[0];
  const int64_t Nc = p.chunk_tokens, Vc = p.chunk_vocab;
  const DType ct = compute_dtype(hidden.dtype());
  const int64_t* y = labels.data<int64_t>();
  const C* plse = lse.data<C>();
  TokenInfo info = token_info(labels, token_weights, p);
  const double up = *grad_loss.to(DType::F64).contiguous().data<double>();  // item() rounds to f32
  const double scale = p.reduction == Reduction::Sum ? up : (info.denom != 0 ? up / info.denom : 0.0);
  const double eps = p.label_smoothing, zl = p.z_loss, smooth = eps / static_cast<double>(V);

  TagScope scratch(MemoryTag::Workspace);  // accumulators, chunk buffers and converted chunks
  // d_weight accumulates over token chunks in the compute dtype: [V, H].
  Tensor dw_acc;
  if (d_weight.defined()) {
    dw_acc = d_weight.dtype() == ct ? d_weight : Tensor::empty({V, H}, ct);
    if (!p.accumulate_d_weight)
      dw_acc.zero_();
    else if (!dw_acc.same_as(d_weight))
      dw_acc.copy_(d_weight);
  }
  if (d_hidden.defined()) Tensor(d_hidden).zero_();  // handles are cheap; the data is shared
  Tensor dx_buf = d_hidden.defined() && d_hidden.dtype() != ct ? Tensor::empty({Nc, H}, ct) : Tensor();
  Tensor zbuf = Tensor::empty({Nc * Vc}, ct);  // one logits/gradient block [Nc, Vc]
  std::vector<double> coef(Nc), lse_scale(Nc);

  for (int64_t n0 = 0; n0 < N; n0 += Nc) {
    const int64_t nc = std::min(Nc, N - n0);
    bool any = false;
    for (int64_t i = 0; i < nc; ++i) {
      coef[i] = scale * info.weight[n0 + i];
      lse_scale[i] = 1.0 + 2.0 * zl * static_cast<double>(plse[n0 + i]);
      any = any || coef[i] != 0;
    }
    if (!any) continue;  // every token ignored (or weight 0): zero gradients, nothing to compute
    Tensor xc = rows_as(hidden, n0, nc, ct);  // [nc, H]
    Tensor dxc;                               // [nc, H] compute dtype
    if (d_hidden.defined()) {
      dxc = dx_buf.defined() ? dx_buf.narrow_view(0, 0, nc) : d_hidden.narrow_view(0, n0, nc);
      if (dx_buf.defined()) dxc.zero_();
    }
    for (int64_t v0 = 0; v0 < V; v0 += Vc) {
      const int64_t vc = std::min(Vc, V - v0);
      Tensor wc = rows_as(weight, v0, vc, ct);  // [vc, H]
      Tensor g = zbuf.narrow_view(0, 0, nc * vc).view({nc, vc});
      gemm(g.view({1, nc, vc}), as_batch(xc), as_batch_t(wc), 0.0);
      C* pg = g.data<C>();
      parallel_for(0, nc, std::max<int64_t>(1, 16384 / vc), [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) {
          C* row = pg + i * vc;
          const double c = coef[i], l = static_cast<double>(plse[n0 + i]);
          if (c == 0) {
            std::fill(row, row + vc, C(0));
            continue;
          }
          for (int64_t j = 0; j < vc; ++j)
            row[j] = static_cast<C>(c * (std::exp(static_cast<double>(row[j]) - l) * lse_scale[i] - smooth));
          int64_t yi = y[n0 + i];
          if (yi >= v0 && yi < v0 + vc) row[yi - v0] = static_cast<C>(row[yi - v0] - c * (1 - eps));
        }
      });
      if (d_hidden.defined()) gemm(dxc.view({1, nc, H}), g.view({1, nc, vc}), as_batch(wc), 1.0);
      if (d_weight.defined())
        gemm(dw_acc.narrow_view(0, v0, vc).view({1, vc, H}), as_batch_t(g), as_batch(xc), 1.0);
    }
    if (dx_buf.defined()) d_hidden.narrow_view(0, n0, nc).copy_(dxc);
  }
  if (d_weight.defined() && !dw_acc.same_as(d_weight)) Tensor(d_weight).copy_(dw_acc);
}

void forward_cpu(const Tensor& loss, const Tensor& lse, const Tensor& hidden, const Tensor& weight,
                 const Tensor& labels, const Tensor& token_weights, const kernels::CrossEntropyParams& p) {
  if (hidden.dtype() == DType::F64)
    forward_typed<double>(loss, lse, hidden, weight, labels, token_weights, p);
  else
    forward_typed<float>(loss, lse, hidden, weight, labels, token_weights, p);
}

void backward_cpu(const Tensor& d_hidden, const Tensor& d_weight, const Tensor& grad_loss, const Tensor& hidden,
                  const Tensor& weight, const Tensor& labels, const Tensor& token_weights, const Tensor& lse,
                  const kernels::CrossEntropyParams& p) {
  if (hidden.dtype() == DType::F64)
    backward_typed<double>(d_hidden, d_weight, grad_loss, hidden, weight, labels, token_weights, lse, p);
  else
    backward_typed<float>(d_hidden, d_weight, grad_loss, hidden, weight, labels, token_weights, lse, p);
}

// The CPU has no single pass: the forward, then the backward from its lse (scratch for this call).
void forward_backward_cpu(const Tensor& loss, const Tensor& d_hidden, const Tensor& d_weight, const Tensor& grad_loss,
                          const Tensor& hidden, const Tensor& weight, const Tensor& labels,
                          const Tensor& token_weights, const kernels::CrossEntropyParams& p) {
  Tensor lse = Tensor::empty({hidden.shape()[0]}, loss.dtype(), hidden.device());
  forward_cpu(loss, lse, hidden, weight, labels, token_weights, p);
  backward_cpu(d_hidden, d_weight, grad_loss, hidden, weight, labels, token_weights, lse, p);
}

}  // namespace

KESTREL_REGISTER_KERNEL(fused_linear_cross_entropy_forward, cpu, forward_cpu);
KESTREL_REGISTER_KERNEL(fused_linear_cross_entropy_forward_backward, cpu, forward_backward_cpu);
KESTREL_REGISTER_KERNEL(fused_linear_cross_entropy_backward, cpu, backward_cpu);

}  // namespace kestrel::cpu
