// matmul/linear: shape validation, batching by views, and the backward GEMMs.
#include "kestrel/ops/matmul.h"

#include "kernels/matmul.h"
#include "kestrel/autograd/tape.h"
#include "src/gemm.h"
#include "kestrel/ops/reduce.h"
#include "kestrel/ops/shape.h"

namespace kestrel {
namespace ag = autograd;
namespace {

// View x ([..., R, C] after the optional transpose) as [B, R, C] with B the batch product.
Tensor as_batched(const Tensor& x, bool trans, int64_t batch) {
  Tensor t = trans ? x.permute_view([&] {
    std::vector<int64_t> d(x.dim());
    for (int64_t i = 0; i < x.dim(); ++i) d[i] = i;
    std::swap(d[x.dim() - 1], d[x.dim() - 2]);
    return d;
  }()) : x;
  int64_t r = t.shape()[t.dim() - 2], c = t.shape()[t.dim() - 1];
  if (t.dim() == 2) return t.as_strided({batch, r, c}, {0, t.strides()[0], t.strides()[1]}, t.offset());
  // Collapse batch dims when they are contiguous with each other; otherwise copy.
  bool collapsible = true;
  for (int64_t i = 0; i + 1 < t.dim() - 2; ++i)
    if (t.strides()[i] != t.strides()[i + 1] * t.shape()[i + 1]) collapsible = false;
  if (!collapsible) t = t.contiguous();
  return t.as_strided({batch, r, c}, {t.strides()[t.dim() - 3], t.strides()[t.dim() - 2], t.strides()[t.dim() - 1]},
                      t.offset());
}

Tensor matmul_raw(const Tensor& a, const Tensor& b, bool ta, bool tb, const Tensor& bias) {
  KESTREL_CHECK(a.dim() >= 2 && b.dim() >= 2, "matmul", "operands must be at least 2-D, got ", a.str(), " and ", b.str());
  KESTREL_CHECK(a.dtype() == b.dtype(), "matmul", "dtype mismatch: ", a.str(), " and ", b.str());
  KESTREL_CHECK(a.device() == b.device(), "matmul", "device mismatch: ", a.str(), " and ", b.str());
  int64_t M = a.shape()[a.dim() - (ta ? 1 : 2)], K = a.shape()[a.dim() - (ta ? 2 : 1)];
  int64_t Kb = b.shape()[b.dim() - (tb ? 1 : 2)], N = b.shape()[b.dim() - (tb ? 2 : 1)];
  KESTREL_CHECK(K == Kb, "matmul", "inner dimensions differ: ", a.str(), (ta ? "^T" : ""), " @ ", b.str(),
                (tb ? "^T" : ""), " (", K, " vs ", Kb, ")");
  Shape batch(a.shape().begin(), a.shape().end() - 2);
  if (b.dim() > 2) {
    Shape bb(b.shape().begin(), b.shape().end() - 2);
    KESTREL_CHECK(bb == batch, "matmul", "batch dimensions differ: ", a.str(), " and ", b.str());
  }
  if (bias.defined()) {
    KESTREL_CHECK(bias.dim() == 1 && bias.shape()[0] == N, "matmul", "bias must be [", N, "], got ", bias.str());
    KESTREL_CHECK(bias.dtype() == a.dtype(), "matmul", "bias dtype ", dtype_name(bias.dtype()), " differs from ",
                  dtype_name(a.dtype()));
  }
  int64_t B = numel(batch);
  Shape out_shape = batch;
  out_shape.push_back(M);
  out_shape.push_back(N);
  Tensor out = Tensor::empty(out_shape, a.dtype(), a.device());
  if (out.numel() == 0) return out;
  if (K == 0) {
    out.zero_();
    if (bias.defined()) out.copy_(bias.expand_view(out_shape));
    return out;
  }
  kernels::dispatch(kernels::matmul, "matmul", a.device(), out.view({B, M, N}), as_batched(a, ta, B),
                    as_batched(b, tb, B), bias, 1.0, 0.0);
  return out;
}

}  // namespace

namespace detail {

void gemm_into(const Tensor& out, const Tensor& a, const Tensor& b, bool ta, bool tb, double beta) {
  KESTREL_CHECK(out.dim() == 2 && a.dim() == 2 && b.dim() == 2, "matmul", "gemm_into takes 2-D tensors, got ",
                out.str(), ", ", a.str(), ", ", b.str());
  KESTREL_CHECK(a.dtype() == b.dtype() && out.dtype() == a.dtype(), "matmul", "dtype mismatch: ", out.str(), " = ",
                a.str(), " @ ", b.str());
  KESTREL_CHECK(a.device() == b.device() && out.device() == a.device(), "matmul", "device mismatch: ", out.str(),
                " = ", a.str(), " @ ", b.str());
  const int64_t M = a.shape()[ta ? 1 : 0], K = a.shape()[ta ? 0 : 1];
  const int64_t Kb = b.shape()[tb ? 1 : 0], N = b.shape()[tb ? 0 : 1];
  KESTREL_CHECK(K == Kb && out.shape()[0] == M && out.shape()[1] == N, "matmul", "gemm_into shapes: ", out.str(),
                " = ", a.str(), (ta ? "^T" : ""), " @ ", b.str(), (tb ? "^T" : ""));
  KESTREL_CHECK(out.is_contiguous(), "matmul", "gemm_into needs a contiguous output, got ", out.str());
  if (M == 0 || N == 0) return;
  if (K == 0) {
    if (beta == 0.0) {
      Tensor o = out;
      o.zero_();
    }
    return;
  }
  kernels::dispatch(kernels::matmul, "matmul", a.device(), out.view({1, M, N}), as_batched(a, ta, 1),
                    as_batched(b, tb, 1), Tensor(), 1.0, beta);
}

}  // namespace detail

Tensor matmul(const Tensor& a, const Tensor& b, bool ta, bool tb) {
  Tensor out = matmul_raw(a, b, ta, tb, Tensor());
  if (!ag::should_record({a, b})) return out;
  bool ga = a.requires_grad(), gb = b.requires_grad();
  Tensor sa = gb ? a.detach() : Tensor(), sb = ga ? b.detach() : Tensor();
  int64_t a_dim = a.dim(), b_dim = b.dim();
  ag::record("matmul", {a, b}, out, [=](const std::vector<Tensor>& g) -> std::vector<Tensor> {
    const Tensor& go = g[0];  // [..., M, N]
    Tensor da, db;
    // C = op(A) op(B).  d op(A) = G op(B)^T,  d op(B) = op(A)^T G.
    if (ga) {
      if (!ta) da = matmul(go, sb, false, !tb);
      // A^T with a shared 2-D B: op(B) G^T would need a batched right operand, so form G op(B)^T.
      else if (b_dim == 2 && a_dim > 2) da = contiguous(transpose(matmul(go, sb, false, !tb), -1, -2));
      else da = matmul(sb, go, tb, true);
    }
    if (gb) {
      if (b_dim == 2 && a_dim > 2) {
        // Shared 2-D weight: d op(B) = sum over the batch, done as one GEMM over flattened rows.
        int64_t n = go.shape().back();
        Tensor gcat = reshape(contiguous(go), {-1, n});  // [B*M, N]
        Tensor acat = ta ? reshape(permute(reshape(contiguous(sa), {-1, sa.shape()[a_dim - 2], sa.shape()[a_dim - 1]}),
                                           {1, 0, 2}),
                                   {sa.shape()[a_dim - 2], -1})          // [K, B*M]
                         : reshape(contiguous(sa), {-1, sa.shape().back()});  // [B*M, K]
        if (ta)
          db = tb ? matmul(gcat, acat, true, true) : matmul(acat, gcat);
        else
          db = tb ? matmul(gcat, acat, true, false) : matmul(acat, gcat, true, false);
      } else {
        db = tb ? matmul(go, sa, true, ta) : matmul(sa, go, !ta, false);
      }
    }
    return {da, db};
  });
  return out;
}

Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias) {
  KESTREL_CHECK(weight.dim() == 2, "linear", "weight must be [out, in], got ", weight.str());
  KESTREL_CHECK(x.dim() >= 1 && x.shape().back() == weight.shape()[1], "linear", "input ", x.str(),
                " does not match weight ", weight.str());
  Shape out_shape = x.shape();
  out_shape.back() = weight.shape()[0];
  Tensor x2 = x.dim() == 2 ? x : reshape(x, {-1, x.shape().back()});
  Tensor out = matmul_raw(x2.detach(), weight.detach(), false, true, bias.defined() ? bias.detach() : Tensor());
  if (ag::should_record({x2, weight, bias})) {
    bool gx = x2.requires_grad(), gw = weight.requires_grad(), gbias = bias.defined() && bias.requires_grad();
    Tensor sx = gw ? x2.detach() : Tensor(), sw = gx ? weight.detach() : Tensor();
    ag::record("linear", {x2, weight, bias}, out, [=](const std::vector<Tensor>& g) -> std::vector<Tensor> {
      const Tensor& go = g[0];  // [rows, out]
      Tensor dx = gx ? matmul(go, sw) : Tensor();                 // [rows, in]
      Tensor dw = gw ? matmul(go, sx, true, false) : Tensor();    // [out, in]
      Tensor db = gbias ? sum(go, {0}) : Tensor();
      return {dx, dw, db};
    });
  }
  return x.dim() == 2 ? out : reshape(out, out_shape);
}

}  // namespace kestrel
