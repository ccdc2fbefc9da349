// swiglu_mlp_tiled: the SwiGLU MLP over row tiles, saving only its input (see kestrel/ops/mlp.h).
#include "kestrel/ops/mlp.h"

#include <algorithm>

#include "kernels/activation.h"
#include "kestrel/autograd/tape.h"
#include "src/gemm.h"

namespace kestrel {
namespace ag = autograd;
namespace {
constexpr const char* kOp = "swiglu_mlp_tiled";

// Scratch for one tile: [rows, I] buffers allocated once and narrowed for the last, shorter tile.
struct TileBuffers {
  std::vector<Tensor> bufs;
  TileBuffers(int count, int64_t rows, int64_t I, DType dt, Device dev) {
    for (int i = 0; i < count; ++i) bufs.push_back(Tensor::empty({rows, I}, dt, dev));
  }
  Tensor get(int i, int64_t rows) const { return bufs[i].narrow_view(0, 0, rows); }
};

// The weight gradient a backward writes into: the leaf's held gradient (added in place) when it has a
// matching one, else a fresh tensor. `in_place` says which.
Tensor weight_grad_target(const Tensor& leaf, const Tensor& w, bool& in_place) {
  Tensor acc = leaf.defined() ? leaf.grad() : Tensor();
  in_place = acc.defined() && acc.is_contiguous() && acc.dtype() == w.dtype() && acc.shape() == w.shape() &&
             acc.device() == w.device();
  return in_place ? acc : Tensor::empty(w.shape(), w.dtype(), w.device());
}

}  // namespace

Tensor swiglu_mlp_tiled(const Tensor& x, const Tensor& gate_w, const Tensor& up_w, const Tensor& down_w,
                        int64_t tile_rows) {
  KESTREL_CHECK(x.defined() && gate_w.defined() && up_w.defined() && down_w.defined(), kOp, "undefined input");
  KESTREL_CHECK(tile_rows > 0, kOp, "tile_rows must be positive, got ", tile_rows);
  KESTREL_CHECK(x.dim() == 2 && gate_w.dim() == 2, kOp, "x must be [T, C] and gate_w [I, C], got ", x.str(), " and ",
                gate_w.str());
  const int64_t T = x.shape()[0], C = x.shape()[1], I = gate_w.shape()[0];
  KESTREL_CHECK(gate_w.shape() == Shape({I, C}) && up_w.shape() == Shape({I, C}) && down_w.shape() == Shape({C, I}),
                kOp, "weights must be gate/up [I, C] and down [C, I] for x ", x.str(), ", got ", gate_w.str(), ", ",
                up_w.str(), ", ", down_w.str());
  for (const Tensor* t : {&gate_w, &up_w, &down_w})
    KESTREL_CHECK(t->dtype() == x.dtype() && t->device() == x.device(), kOp, "weight ", t->str(),
                  " must match x ", x.str(), " in dtype and device");
  KESTREL_CHECK(is_floating(x.dtype()), kOp, "expected floating tensors, got ", x.str());

  const Tensor xd = x.detach().contiguous(), wg = gate_w.detach(), wu = up_w.detach(), wd = down_w.detach();
  const int64_t tile = std::min(tile_rows, std::max<int64_t>(T, 1));
  Tensor out = Tensor::empty({T, C}, x.dtype(), x.device());
  if (T > 0) {
    TileBuffers buf(3, tile, I, x.dtype(), x.device());  // gate, up, product
    for (int64_t r0 = 0; r0 < T; r0 += tile) {
      const int64_t n = std::min(tile, T - r0);
      Tensor xt = xd.narrow_view(0, r0, n), g = buf.get(0, n), u = buf.get(1, n), a = buf.get(2, n);
      detail::gemm_into(g, xt, wg, false, true, 0.0);
      detail::gemm_into(u, xt, wu, false, true, 0.0);
      kernels::dispatch(kernels::swiglu_forward, kOp, x.device(), a, g, u);
      detail::gemm_into(out.narrow_view(0, r0, n), a, wd, false, true, 0.0);
    }
  }
  if (!ag::should_record({x, gate_w, up_w, down_w})) return out;

  const bool gx = x.requires_grad();
  const bool need[3] = {gate_w.requires_grad(), up_w.requires_grad(), down_w.requires_grad()};
  Tensor leaves[3];
  const Tensor* ws[3] = {&gate_w, &up_w, &down_w};
  for (int i = 0; i < 3; ++i)
    if (need[i] && ws[i]->is_leaf()) leaves[i] = *ws[i];
  ag::record(kOp, {x, gate_w, up_w, down_w}, out, [=](const std::vector<Tensor>& grads) -> std::vector<Tensor> {
    const Tensor go = grads[0].dtype() == xd.dtype() ? grads[0].contiguous() : grads[0].to(xd.dtype());
    const Tensor wsd[3] = {wg, wu, wd};
    Tensor dw[3];
    bool in_place[3] = {false, false, false};
    for (int i = 0; i < 3; ++i)
      if (need[i]) dw[i] = weight_grad_target(leaves[i], wsd[i], in_place[i]);
    Tensor dx = gx ? Tensor::empty({T, C}, xd.dtype(), xd.device()) : Tensor();
    if (T == 0) {
      for (int i = 0; i < 3; ++i)
        if (dw[i].defined() && !in_place[i]) dw[i].zero_();
      return {dx, in_place[0] ? Tensor() : dw[0], in_place[1] ? Tensor() : dw[1], in_place[2] ? Tensor() : dw[2]};
    }
    TileBuffers buf(5, tile, I, xd.dtype(), xd.device());  // gate, up, product then its gradient, dgate, dup
    for (int64_t r0 = 0; r0 < T; r0 += tile) {
      const int64_t n = std::min(tile, T - r0);
      const bool first = r0 == 0;
      Tensor xt = xd.narrow_view(0, r0, n), gt = go.narrow_view(0, r0, n);
      Tensor g = buf.get(0, n), u = buf.get(1, n), a = buf.get(2, n), dg = buf.get(3, n), du = buf.get(4, n);
      // Recompute the tile's gate, up and product.
      detail::gemm_into(g, xt, wg, false, true, 0.0);
      detail::gemm_into(u, xt, wu, false, true, 0.0);
      if (need[2]) {
        kernels::dispatch(kernels::swiglu_forward, kOp, xd.device(), a, g, u);
        detail::gemm_into(dw[2], gt, a, true, false, first && !in_place[2] ? 0.0 : 1.0);  // d down += gt^T a
      }
      detail::gemm_into(a, gt, wd, false, false, 0.0);  // d product = gt down
      kernels::dispatch(kernels::swiglu_backward, kOp, xd.device(), dg, du, g, u, a);
      if (need[0]) detail::gemm_into(dw[0], dg, xt, true, false, first && !in_place[0] ? 0.0 : 1.0);
      if (need[1]) detail::gemm_into(dw[1], du, xt, true, false, first && !in_place[1] ? 0.0 : 1.0);
      if (gx) {
        Tensor dxt = dx.narrow_view(0, r0, n);
        detail::gemm_into(dxt, dg, wg, false, false, 0.0);
        detail::gemm_into(dxt, du, wu, false, false, 1.0);
      }
    }
    return {dx, in_place[0] ? Tensor() : dw[0], in_place[1] ? Tensor() : dw[1], in_place[2] ? Tensor() : dw[2]};
  });
  return out;
}

}  // namespace kestrel
