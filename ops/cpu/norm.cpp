// CPU normalisation kernels (reference): one row per task, computed in f32 (f64 for f64) with row
// statistics accumulated in f64. Weight/bias gradients are column sums done deterministically: each
// fixed block of rows writes its own f64 partial, then the partials are added in block order.
#include <cmath>
#include <vector>

#include "kernels/norm.h"
#include "kestrel/runtime/dtype_dispatch.h"
#include "kestrel/runtime/parallel.h"

namespace kestrel::cpu {
namespace {

constexpr int64_t kRowsPerBlock = 32;  // fixed, so column sums do not depend on the thread count

template <typename F>
void for_rows(int64_t rows, int64_t C, F&& fn) {
  parallel_for(0, rows, std::max<int64_t>(1, 8192 / C), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) fn(r);
  });
}

// Column sums of per-row contributions: contrib(r, acc) adds row r's terms into acc[0..k*C).
// Returns k*C f64 sums, independent of scheduling.
template <typename F>
std::vector<double> column_sums(int64_t rows, int64_t width, F&& contrib) {
  int64_t blocks = (rows + kRowsPerBlock - 1) / kRowsPerBlock;
  std::vector<double> partial(static_cast<size_t>(blocks * width), 0.0);
  parallel_for(0, blocks, 1, [&](int64_t b, int64_t e) {
    for (int64_t blk = b; blk < e; ++blk) {
      double* acc = partial.data() + blk * width;
      for (int64_t r = blk * kRowsPerBlock; r < std::min(rows, (blk + 1) * kRowsPerBlock); ++r) contrib(r, acc);
    }
  });
  std::vector<double> total(static_cast<size_t>(width), 0.0);
  for (int64_t blk = 0; blk < blocks; ++blk)
    for (int64_t c = 0; c < width; ++c) total[c] += partial[blk * width + c];
  return total;
}

template <typename T>
void store(const Tensor& t, const std::vector<double>& v, int64_t from) {
  T* p = t.data<T>();
  for (int64_t c = 0; c < t.numel(); ++c) p[c] = elem_from_double<T>(v[from + c]);
}

template <typename T, typename S>
void rms_rows(T* py, S* prstd, const T* px, const T* pres, T* ph, const T* pw, int64_t rows, int64_t C, double eps) {
  using Cm = compute_t<T>;
  for_rows(rows, C, [&](int64_t r) {
    const T* xr = px + r * C;
    double ss = 0;
    if (pres) {
      // h = x + res, rounded to storage first: the norm sees exactly the h that is returned.
      T* hr = ph + r * C;
      for (int64_t c = 0; c < C; ++c) hr[c] = from_compute<T>(to_compute(xr[c]) + to_compute(pres[r * C + c]));
      xr = hr;
    }
    for (int64_t c = 0; c < C; ++c) {
      double v = to_compute(xr[c]);
      ss += v * v;
    }
    Cm rs = static_cast<Cm>(1.0 / std::sqrt(ss / static_cast<double>(C) + eps));
    prstd[r] = static_cast<S>(rs);
    for (int64_t c = 0; c < C; ++c) py[r * C + c] = from_compute<T>(to_compute(xr[c]) * rs * to_compute(pw[c]));
  });
}

void rms_norm_cpu(const Tensor& y, const Tensor& rstd, const Tensor& x, const Tensor& w, double eps) {
  dispatch_floating(x.dtype(), "rms_norm", [&](auto tag) {
    using T = decltype(tag);
    using S = std::conditional_t<std::is_same_v<T, double>, double, float>;
    rms_rows<T, S>(y.data<T>(), rstd.data<S>(), x.data<T>(), nullptr, nullptr, w.data<T>(), x.shape()[0],
                   x.shape()[1], eps);
  });
}

void add_rms_norm_cpu(const Tensor& y, const Tensor& h, const Tensor& rstd, const Tensor& x, const Tensor& res,
                      const Tensor& w, double eps) {
  dispatch_floating(x.dtype(), "add_rms_norm", [&](auto tag) {
    using T = decltype(tag);
    using S = std::conditional_t<std::is_same_v<T, double>, double, float>;
    rms_rows<T, S>(y.data<T>(), rstd.data<S>(), x.data<T>(), res.data<T>(), h.data<T>(), w.data<T>(), x.shape()[0],
                   x.shape()[1], eps);
  });
}

void rms_norm_backward_cpu(const Tensor& dx, const Tensor& dw, const Tensor& dy, const Tensor& x, const Tensor& w,
                           const Tensor& rstd) {
  dispatch_floating(x.dtype(), "rms_norm", [&](auto tag) {
    using T = decltype(tag);
    using S = std::conditional_t<std::is_same_v<T, double>, double, float>;
    using Cm = compute_t<T>;
    int64_t rows = x.shape()[0], C = x.shape()[1];
    const T *px = x.data<T>(), *pg = dy.data<T>(), *pw = w.data<T>();
    const S* prs = rstd.data<S>();
    T* pdx = dx.data<T>();
    for_rows(rows, C, [&](int64_t r) {
      Cm rs = static_cast<Cm>(prs[r]);
      double dot = 0;  // sum(dy * w * xhat)
      for (int64_t c = 0; c < C; ++c)
        dot += static_cast<double>(to_compute(pg[r * C + c]) * to_compute(pw[c])) * (to_compute(px[r * C + c]) * rs);
      Cm m = static_cast<Cm>(dot / static_cast<double>(C));
      for (int64_t c = 0; c < C; ++c) {
        Cm xhat = to_compute(px[r * C + c]) * rs;
        pdx[r * C + c] = from_compute<T>(rs * (to_compute(pg[r * C + c]) * to_compute(pw[c]) - xhat * m));
      }
    });
    if (dw.defined()) {
      auto sums = column_sums(rows, C, [&](int64_t r, double* acc) {
        Cm rs = static_cast<Cm>(prs[r]);
        for (int64_t c = 0; c < C; ++c) acc[c] += to_compute(pg[r * C + c]) * (to_compute(px[r * C + c]) * rs);
      });
      store<T>(dw, sums, 0);
    }
  });
}

void layer_norm_cpu(const Tensor& y, const Tensor& mean, const Tensor& rstd, const Tensor& x, const Tensor& w,
                    const Tensor& b, double eps) {
  dispatch_floating(x.dtype(), "layer_norm", [&](auto tag) {
    using T = decltype(tag);
    using S = std::conditional_t<std::is_same_v<T, double>, double, float>;
    using Cm = compute_t<T>;
    int64_t rows = x.shape()[0], C = x.shape()[1];
    const T* px = x.data<T>();
    const T* pw = w.defined() ? w.data<T>() : nullptr;
    const T* pb = b.defined() ? b.data<T>() : nullptr;
    T* py = y.data<T>();
    for_rows(rows, C, [&](int64_t r) {
      const T* xr = px + r * C;
      double s = 0;
      for (int64_t c = 0; c < C; ++c) s += to_compute(xr[c]);
      double mu = s / static_cast<double>(C), var = 0;
      for (int64_t c = 0; c < C; ++c) {
        double d = to_compute(xr[c]) - mu;
        var += d * d;
      }
      double rs = 1.0 / std::sqrt(var / static_cast<double>(C) + eps);
      mean.data<S>()[r] = static_cast<S>(mu);
      rstd.data<S>()[r] = static_cast<S>(rs);
      Cm m = static_cast<Cm>(mu), q = static_cast<Cm>(rs);
      for (int64_t c = 0; c < C; ++c) {
        Cm v = (to_compute(xr[c]) - m) * q;
        if (pw) v *= to_compute(pw[c]);
        if (pb) v += to_compute(pb[c]);
        py[r * C + c] = from_compute<T>(v);
      }
    });
  });
}

void layer_norm_backward_cpu(const Tensor& dx, const Tensor& dw, const Tensor& db, const Tensor& dy, const Tensor& x,
                             const Tensor& w, const Tensor& mean, const Tensor& rstd) {
  dispatch_floating(x.dtype(), "layer_norm", [&](auto tag) {
    using T = decltype(tag);
    using S = std::conditional_t<std::is_same_v<T, double>, double, float>;
    using Cm = compute_t<T>;
    int64_t rows = x.shape()[0], C = x.shape()[1];
    const T *px = x.data<T>(), *pg = dy.data<T>();
    const T* pw = w.defined() ? w.data<T>() : nullptr;
    const S *pm = mean.data<S>(), *prs = rstd.data<S>();
    T* pdx = dx.data<T>();
    for_rows(rows, C, [&](int64_t r) {
      Cm m = static_cast<Cm>(pm[r]), rs = static_cast<Cm>(prs[r]);
      double sg = 0, sgx = 0;  // sum(g), sum(g * xhat), g = dy * w
      for (int64_t c = 0; c < C; ++c) {
        Cm g = to_compute(pg[r * C + c]) * (pw ? to_compute(pw[c]) : Cm(1));
        sg += g;
        sgx += static_cast<double>(g) * ((to_compute(px[r * C + c]) - m) * rs);
      }
      Cm mg = static_cast<Cm>(sg / static_cast<double>(C)), mgx = static_cast<Cm>(sgx / static_cast<double>(C));
      for (int64_t c = 0; c < C; ++c) {
        Cm g = to_compute(pg[r * C + c]) * (pw ? to_compute(pw[c]) : Cm(1));
        Cm xhat = (to_compute(px[r * C + c]) - m) * rs;
        pdx[r * C + c] = from_compute<T>(rs * (g - mg - xhat * mgx));
      }
    });
    if (dw.defined() || db.defined()) {
      // Layout of the partials: [0, C) = sum(dy * xhat), [C, 2C) = sum(dy).
      auto sums = column_sums(rows, 2 * C, [&](int64_t r, double* acc) {
        Cm m = static_cast<Cm>(pm[r]), rs = static_cast<Cm>(prs[r]);
        for (int64_t c = 0; c < C; ++c) {
          Cm g = to_compute(pg[r * C + c]);
          acc[c] += g * ((to_compute(px[r * C + c]) - m) * rs);
          acc[C + c] += g;
        }
      });
      if (dw.defined()) store<T>(dw, sums, 0);
      if (db.defined()) store<T>(db, sums, C);
    }
  });
}

}  // namespace

KESTREL_REGISTER_KERNEL(rms_norm_forward, cpu, rms_norm_cpu);
KESTREL_REGISTER_KERNEL(add_rms_norm_forward, cpu, add_rms_norm_cpu);
KESTREL_REGISTER_KERNEL(rms_norm_backward, cpu, rms_norm_backward_cpu);
KESTREL_REGISTER_KERNEL(layer_norm_forward, cpu, layer_norm_cpu);
KESTREL_REGISTER_KERNEL(layer_norm_backward, cpu, layer_norm_backward_cpu);

}  // namespace kestrel::cpu
