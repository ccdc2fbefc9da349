// CPU softmax-family kernels (reference): one lane = one (outer, inner) pair reading n elements at
// stride `inner`; computed in f32 (f64 for f64) with the max subtracted, sums accumulated in f64.
#include <cmath>
#include <limits>

#include "kernels/softmax.h"
#include "kestrel/runtime/dtype_dispatch.h"
#include "kestrel/runtime/parallel.h"

namespace kestrel::cpu {
namespace {
using kernels::ReduceDim;

// fn(base, stride) for every lane, in parallel; base is the lane's first element.
template <typename F>
void for_each_lane(ReduceDim r, F&& fn) {
  int64_t lanes = r.outer * r.inner;
  parallel_for(0, lanes, std::max<int64_t>(1, 16384 / std::max<int64_t>(r.n, 1)), [&](int64_t b, int64_t e) {
    for (int64_t l = b; l < e; ++l) {
      int64_t o = l / r.inner, i = l % r.inner;
      fn(l, o * r.n * r.inner + i, r.inner);
    }
  });
}

void softmax_cpu(const Tensor& out, const Tensor& x, ReduceDim r, bool log) {
  dispatch_floating(x.dtype(), "softmax", [&](auto tag) {
    using T = decltype(tag);
    using C = compute_t<T>;
    const T* px = x.data<T>();
    T* po = out.data<T>();
    for_each_lane(r, [&](int64_t, int64_t base, int64_t st) {
      C mx = -std::numeric_limits<C>::infinity();
      for (int64_t j = 0; j < r.n; ++j) mx = std::max(mx, to_compute(px[base + j * st]));
      if (mx == -std::numeric_limits<C>::infinity()) mx = 0;  // all -inf: avoid inf - inf
      double s = 0;
      for (int64_t j = 0; j < r.n; ++j) s += std::exp(to_compute(px[base + j * st]) - mx);
      if (log) {
        C lse = mx + static_cast<C>(std::log(s));
        for (int64_t j = 0; j < r.n; ++j) po[base + j * st] = from_compute<T>(to_compute(px[base + j * st]) - lse);
      } else {
        C inv = static_cast<C>(1.0 / s);
        for (int64_t j = 0; j < r.n; ++j)
          po[base + j * st] = from_compute<T>(std::exp(to_compute(px[base + j * st]) - mx) * inv);
      }
    });
  });
}

void softmax_backward_cpu(const Tensor& dx, const Tensor& y, const Tensor& dy, ReduceDim r, bool log) {
  dispatch_floating(y.dtype(), "softmax", [&](auto tag) {
    using T = decltype(tag);
    using C = compute_t<T>;
    const T* py = y.data<T>();
    const T* pg = dy.data<T>();
    T* pd = dx.data<T>();
    for_each_lane(r, [&](int64_t, int64_t base, int64_t st) {
      double s = 0;
      if (log) {
        for (int64_t j = 0; j < r.n; ++j) s += to_compute(pg[base + j * st]);
        for (int64_t j = 0; j < r.n; ++j) {
          int64_t k = base + j * st;
          pd[k] = from_compute<T>(to_compute(pg[k]) - std::exp(to_compute(py[k])) * static_cast<C>(s));
        }
      } else {
        for (int64_t j = 0; j < r.n; ++j) s += static_cast<double>(to_compute(pg[base + j * st])) * to_compute(py[base + j * st]);
        for (int64_t j = 0; j < r.n; ++j) {
          int64_t k = base + j * st;
          pd[k] = from_compute<T>(to_compute(py[k]) * (to_compute(pg[k]) - static_cast<C>(s)));
        }
      }
    });
  });
}

void logsumexp_cpu(const Tensor& out, const Tensor& x, ReduceDim r) {
  dispatch_floating(x.dtype(), "logsumexp", [&](auto tag) {
    using T = decltype(tag);
    using C = compute_t<T>;
    const T* px = x.data<T>();
    T* po = out.data<T>();
    for_each_lane(r, [&](int64_t lane, int64_t base, int64_t st) {
      C mx = -std::numeric_limits<C>::infinity();
      for (int64_t j = 0; j < r.n; ++j) mx = std::max(mx, to_compute(px[base + j * st]));
      if (std::isinf(mx)) {
        po[lane] = from_compute<T>(mx);
        return;
      }
      double s = 0;
      for (int64_t j = 0; j < r.n; ++j) s += std::exp(to_compute(px[base + j * st]) - mx);
      po[lane] = from_compute<T>(mx + static_cast<C>(std::log(s)));
    });
  });
}

void amax_cpu(const Tensor& out, const Tensor& idx, const Tensor& x, ReduceDim r) {
  dispatch_floating(x.dtype(), "amax", [&](auto tag) {
    using T = decltype(tag);
    using C = compute_t<T>;
    const T* px = x.data<T>();
    T* po = out.data<T>();
    int64_t* pi = idx.data<int64_t>();
    for_each_lane(r, [&](int64_t lane, int64_t base, int64_t st) {
      int64_t best = 0;
      C mx = to_compute(px[base]);
      for (int64_t j = 1; j < r.n && !std::isnan(mx); ++j) {
        C v = to_compute(px[base + j * st]);
        if (v > mx || std::isnan(v)) {
          mx = v;
          best = j;
        }
      }
      po[lane] = px[base + best * st];
      pi[lane] = best;
    });
  });
}

void amax_backward_cpu(const Tensor& dx, const Tensor& dy, const Tensor& idx, ReduceDim r) {
  dispatch_floating(dx.dtype(), "amax", [&](auto tag) {
    using T = decltype(tag);
    const T* pg = dy.data<T>();
    const int64_t* pi = idx.data<int64_t>();
    T* pd = dx.data<T>();
    for_each_lane(r, [&](int64_t lane, int64_t base, int64_t st) { pd[base + pi[lane] * st] = pg[lane]; });
  });
}

}  // namespace

KESTREL_REGISTER_KERNEL(softmax_forward, cpu, softmax_cpu);
KESTREL_REGISTER_KERNEL(softmax_backward, cpu, softmax_backward_cpu);
KESTREL_REGISTER_KERNEL(logsumexp_forward, cpu, logsumexp_cpu);
KESTREL_REGISTER_KERNEL(amax_forward, cpu, amax_cpu);
KESTREL_REGISTER_KERNEL(amax_backward, cpu, amax_backward_cpu);

}  // namespace kestrel::cpu
