// embedding / index_select_rows / splice_rows / concat / split: validation, row views, tape recording.
// Gathers go backward as scatter-adds; concat and split are each other's backward (narrow copies).
#include "kestrel/ops/embedding.h"

#include <algorithm>
#include <unordered_set>

#include "kernels/embedding.h"
#include "kestrel/autograd/tape.h"

namespace kestrel {
namespace ag = autograd;
namespace {

void check_index_tensor(const Tensor& idx, const Tensor& x, const char* what, const char* op) {
  KESTREL_CHECK(idx.defined(), op, what, " is undefined");
  KESTREL_CHECK(idx.dtype() == DType::I32 || idx.dtype() == DType::I64, op, what, " must be i32 or i64, got ",
                idx.str());
  KESTREL_CHECK(idx.device() == x.device(), op, what, " ", idx.str(), " is not on the device of ", x.str());
}

void check_range(const Tensor& flat_idx, int64_t n, const char* what, const char* op) {
  if (flat_idx.numel() == 0) return;
  int64_t bad = kernels::dispatch(kernels::first_bad_index, op, flat_idx.device(), flat_idx, n);
  if (bad >= 0) {
    int64_t v = flat_idx.narrow_view(0, bad, 1).to(Device::cpu()).to_int_vector()[0];
    KESTREL_CHECK(false, op, what, " at position ", bad, " is ", v, ", outside [0, ", n, ")");
  }
}

// x [N, ...] viewed as [N, R].
Tensor rows(const Tensor& x) { return x.contiguous().view({x.shape()[0], x.dim() == 1 ? 1 : numel(x.shape()) / std::max<int64_t>(x.shape()[0], 1)}); }

// dst zero [N, R]; dst[idx] += g rows.
Tensor scatter_add_grad(const Shape& shape, DType dt, const Tensor& g, const Tensor& idx, bool det) {
  Tensor dx = Tensor::zeros(shape, dt, g.device());
  Tensor gg = g.dtype() == dt ? g.contiguous() : g.to(dt);
  if (idx.numel() > 0 && dx.numel() > 0)
    kernels::dispatch(kernels::scatter_add_rows, "scatter_add_rows", dx.device(), rows(dx), rows(gg.view({idx.numel(), -1})), idx, det);
  return dx;
}

Tensor gather(const Tensor& x, const Tensor& idx, const Shape& out_shape, const char* op) {
  Tensor out = Tensor::empty(out_shape, x.dtype(), x.device());
  if (out.numel() > 0) kernels::dispatch(kernels::gather_rows, op, x.device(), out.view({idx.numel(), -1}), rows(x), idx);
  return out;
}

}  // namespace

Tensor embedding(const Tensor& weight, const Tensor& ids, bool deterministic) {
  KESTREL_CHECK(weight.defined() && weight.dim() == 2, "embedding", "weight must be [V, C], got ",
                weight.defined() ? weight.str() : std::string("undefined"));
  check_index_tensor(ids, weight, "ids", "embedding");
  Tensor flat = ids.contiguous().view({ids.numel()});  // [M]
  check_range(flat, weight.shape()[0], "id", "embedding");
  Shape out_shape = ids.shape();
  out_shape.push_back(weight.shape()[1]);
  Tensor out = gather(weight, flat, out_shape, "embedding");
  if (!ag::should_record({weight})) return out;
  // A leaf weight that already holds a gradient (accumulation over micro-batches) gets the rows added
  // into it in place: no second [V, C] buffer (the scatter kernels add into their destination).
  Tensor leaf = weight.is_leaf() ? weight : Tensor();
  ag::record("embedding", {weight}, out,
             [flat, leaf, ws = weight.shape(), dt = weight.dtype(), deterministic](const std::vector<Tensor>& g) -> std::vector<Tensor> {
               Tensor acc = leaf.defined() ? leaf.grad() : Tensor();
               if (acc.defined() && acc.is_contiguous() && acc.dtype() == dt && acc.shape() == ws &&
                   acc.device() == g[0].device()) {
                 Tensor gg = g[0].dtype() == dt ? g[0].contiguous() : g[0].to(dt);
                 if (flat.numel() > 0 && acc.numel() > 0)
                   kernels::dispatch(kernels::scatter_add_rows, "scatter_add_rows", acc.device(), rows(acc),
                                     rows(gg.view({flat.numel(), -1})), flat, deterministic);
                 return {Tensor()};
               }
               return {scatter_add_grad(ws, dt, g[0], flat, deterministic)};
             });
  return out;
}

Tensor index_select_rows(const Tensor& x, const Tensor& idx) {
  KESTREL_CHECK(x.defined() && x.dim() >= 1, "index_select_rows", "x must be [N, ...]");
  check_index_tensor(idx, x, "idx", "index_select_rows");
  KESTREL_CHECK(idx.dim() == 1, "index_select_rows", "idx must be 1-D, got ", idx.str());
  Tensor flat = idx.contiguous();
  check_range(flat, x.shape()[0], "idx", "index_select_rows");
  Shape out_shape = x.shape();
  out_shape[0] = idx.numel();
  Tensor out = gather(x, flat, out_shape, "index_select_rows");
  if (!ag::should_record({x})) return out;
  KESTREL_CHECK(is_floating(x.dtype()), "index_select_rows", "cannot differentiate ", x.str());
  ag::record("index_select_rows", {x}, out,
             [flat, xs = x.shape(), dt = x.dtype()](const std::vector<Tensor>& g) -> std::vector<Tensor> {
               return {scatter_add_grad(xs, dt, g[0], flat, true)};
             });
  return out;
}

Tensor splice_rows(const Tensor& base, const Tensor& idx, const Tensor& src) {
  KESTREL_CHECK(base.defined() && base.dim() == 2, "splice_rows", "base must be [N, C], got ",
                base.defined() ? base.str() : std::string("undefined"));
  check_index_tensor(idx, base, "idx", "splice_rows");
  KESTREL_CHECK(idx.dim() == 1, "splice_rows", "idx must be 1-D, got ", idx.str());
  KESTREL_CHECK(src.defined() && src.dim() == 2 && src.shape()[0] == idx.shape()[0] && src.shape()[1] == base.shape()[1],
                "splice_rows", "src must be [", idx.shape()[0], ", ", base.shape()[1], "], got ",
                src.defined() ? src.str() : std::string("undefined"));
  KESTREL_CHECK(src.dtype() == base.dtype() && src.device() == base.device(), "splice_rows", "src ", src.str(),
                " differs in dtype or device from base ", base.str());
  // idx is short (one entry per image token): check range and uniqueness on the host.
  std::vector<int64_t> host = idx.to(Device::cpu()).to_int_vector();
  std::unordered_set<int64_t> seen;
  for (size_t m = 0; m < host.size(); ++m) {
    KESTREL_CHECK(host[m] >= 0 && host[m] < base.shape()[0], "splice_rows", "idx at position ", m, " is ", host[m],
                  ", outside [0, ", base.shape()[0], ")");
    KESTREL_CHECK(seen.insert(host[m]).second, "splice_rows", "idx at position ", m, " repeats row ", host[m]);
  }
  Tensor flat = idx.contiguous();
  Tensor out = base.clone();
  if (flat.numel() > 0 && out.numel() > 0)
    kernels::dispatch(kernels::scatter_rows, "splice_rows", out.device(), out, src.contiguous(), flat);
  if (!ag::should_record({base, src})) return out;
  ag::record("splice_rows", {base, src}, out,
             [flat, gb = base.requires_grad(), gs = src.requires_grad()](const std::vector<Tensor>& g) -> std::vector<Tensor> {
               Tensor go = g[0].contiguous();
               Tensor db, ds;
               if (gb) {
                 db = go.clone();
                 Tensor zeros = Tensor::zeros({flat.numel(), go.shape()[1]}, go.dtype(), go.device());
                 if (flat.numel() > 0 && db.numel() > 0)
                   kernels::dispatch(kernels::scatter_rows, "splice_rows", db.device(), db, zeros, flat);
               }
               if (gs) ds = gather(go, flat, {flat.numel(), go.shape()[1]}, "splice_rows");
               return {db, ds};
             });
  return out;
}

Tensor concat(const std::vector<Tensor>& xs, int64_t dim) {
  KESTREL_CHECK(!xs.empty(), "concat", "no tensors to concatenate");
  const Tensor& x0 = xs[0];
  KESTREL_CHECK(x0.defined() && x0.dim() >= 1, "concat", "inputs must be at least 1-D");
  int d = normalize_dim(dim, x0.dim(), "concat");
  Shape out_shape = x0.shape();
  out_shape[d] = 0;
  for (size_t i = 0; i < xs.size(); ++i) {
    const Tensor& x = xs[i];
    KESTREL_CHECK(x.defined() && x.dim() == x0.dim(), "concat", "input ", i, " has rank ",
                  x.defined() ? x.dim() : -1, ", expected ", x0.dim());
    KESTREL_CHECK(x.dtype() == x0.dtype() && x.device() == x0.device(), "concat", "input ", i, " ", x.str(),
                  " differs in dtype or device from input 0 ", x0.str());
    for (int64_t k = 0; k < x.dim(); ++k)
      KESTREL_CHECK(k == d || x.shape()[k] == x0.shape()[k], "concat", "input ", i, " ", x.str(),
                    " does not match input 0 ", x0.str(), " outside dim ", d);
    out_shape[d] += x.shape()[d];
  }
  Tensor out = Tensor::empty(out_shape, x0.dtype(), x0.device());
  std::vector<int64_t> sizes;
  int64_t off = 0;
  for (const Tensor& x : xs) {
    if (x.numel() > 0) out.narrow_view(d, off, x.shape()[d]).copy_(x);
    sizes.push_back(x.shape()[d]);
    off += x.shape()[d];
  }
  if (!ag::should_record(xs)) return out;
  std::vector<bool> need;
  for (const Tensor& x : xs) need.push_back(x.requires_grad());
  ag::record("concat", xs, out, [d, sizes, need](const std::vector<Tensor>& g) -> std::vector<Tensor> {
    std::vector<Tensor> dx(sizes.size());
    int64_t o = 0;
    for (size_t i = 0; i < sizes.size(); ++i) {
      if (need[i]) dx[i] = g[0].narrow_view(d, o, sizes[i]).contiguous();
      o += sizes[i];
    }
    return dx;
  });
  return out;
}

std::vector<Tensor> split(const Tensor& x, const std::vector<int64_t>& sizes, int64_t dim) {
  KESTREL_CHECK(x.defined() && x.dim() >= 1, "split", "input must be at least 1-D");
  int d = normalize_dim(dim, x.dim(), "split");
  int64_t total = 0;
  for (int64_t s : sizes) {
    KESTREL_CHECK(s >= 0, "split", "negative size ", s);
    total += s;
  }
  KESTREL_CHECK(total == x.shape()[d], "split", "sizes sum to ", total, " but dim ", d, " of ", x.str(), " has ",
                x.shape()[d]);
  std::vector<Tensor> outs;
  int64_t off = 0;
  for (int64_t s : sizes) {
    outs.push_back(x.narrow_view(d, off, s).detach());
    off += s;
  }
  if (!ag::should_record({x})) return outs;
  ag::record("split", {x}, outs, [d](const std::vector<Tensor>& g) -> std::vector<Tensor> { return {concat(g, d)}; });
  return outs;
}

}  // namespace kestrel
