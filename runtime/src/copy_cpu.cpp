// CPU strided, converting copy and fill: the raw data movement under Tensor::copy_/fill_.
#include <cstring>

#include "backend.h"
#include "kestrel/runtime/dtype_dispatch.h"
#include "kestrel/runtime/parallel.h"

namespace kestrel::detail {
namespace {

// Calls fn(dst_offset, src_offset, count) for each innermost row, in parallel over rows.
template <typename F>
void for_each_row(const Shape& shape, const Strides& ds, const Strides& ss, int64_t d0, int64_t s0, F&& fn) {
  int rank = static_cast<int>(shape.size());
  if (rank == 0) {
    fn(d0, s0, 1, 1, 1);
    return;
  }
  int64_t inner = shape[rank - 1];
  int64_t rows = numel(shape) / std::max<int64_t>(inner, 1);
  if (inner == 0) return;
  parallel_for(0, rows, std::max<int64_t>(1, 16384 / inner), [&](int64_t rb, int64_t re) {
    for (int64_t r = rb; r < re; ++r) {
      int64_t rem = r, doff = d0, soff = s0;
      for (int d = rank - 2; d >= 0; --d) {
        int64_t idx = rem % shape[d];
        rem /= shape[d];
        doff += idx * ds[d];
        soff += idx * ss[d];
      }
      fn(doff, soff, inner, ds[rank - 1], ss[rank - 1]);
    }
  });
}

}  // namespace

void cpu_strided_copy(const Tensor& dst, const Tensor& src) {
  char* dbase = static_cast<char*>(dst.storage()->data());
  const char* sbase = static_cast<const char*>(src.storage()->data());
  if (dst.dtype() == src.dtype() && dst.is_contiguous() && src.is_contiguous()) {
    size_t es = dtype_size(dst.dtype());
    int64_t n = dst.numel();
    parallel_for(0, n, 1 << 18, [&](int64_t b, int64_t e) {
      std::memcpy(dbase + (dst.offset() + b) * es, sbase + (src.offset() + b) * es, (e - b) * es);
    });
    return;
  }
  dispatch_dtype(dst.dtype(), [&](auto dtag) {
    using D = decltype(dtag);
    dispatch_dtype(src.dtype(), [&](auto stag) {
      using S = decltype(stag);
      D* d = reinterpret_cast<D*>(dbase);
      const S* s = reinterpret_cast<const S*>(sbase);
      for_each_row(dst.shape(), dst.strides(), src.strides(), dst.offset(), src.offset(),
                   [&](int64_t doff, int64_t soff, int64_t n, int64_t dstep, int64_t sstep) {
                     for (int64_t i = 0; i < n; ++i) {
                       if constexpr ((std::is_same_v<S, float> || std::is_same_v<S, bf16> ||
                                      std::is_same_v<S, f16>) && !std::is_same_v<D, double>)
                         d[doff + i * dstep] = elem_from_float<D>(elem_to_float(s[soff + i * sstep]));
                       else
                         d[doff + i * dstep] = elem_from_double<D>(elem_to_double(s[soff + i * sstep]));
                     }
                   });
    });
  });
}

void cpu_fill(const Tensor& dst, double value) {
  dispatch_dtype(dst.dtype(), [&](auto tag) {
    using T = decltype(tag);
    T v = elem_from_double<T>(value);
    T* d = static_cast<T*>(dst.storage()->data());
    for_each_row(dst.shape(), dst.strides(), dst.strides(), dst.offset(), dst.offset(),
                 [&](int64_t doff, int64_t, int64_t n, int64_t step, int64_t) {
                   for (int64_t i = 0; i < n; ++i) d[doff + i * step] = v;
                 });
  });
}

}  // namespace kestrel::detail

namespace kestrel::detail {
void cpu_add_into(const Tensor& dst, const Tensor& src) {
  dispatch_floating(dst.dtype(), "add_into", [&](auto dtag) {
    using D = decltype(dtag);
    dispatch_floating(src.dtype(), "add_into", [&](auto stag) {
      using S = decltype(stag);
      D* d = static_cast<D*>(dst.storage()->data());
      const S* s = static_cast<const S*>(src.storage()->data());
      for_each_row(dst.shape(), dst.strides(), src.strides(), dst.offset(), src.offset(),
                   [&](int64_t doff, int64_t soff, int64_t n, int64_t dstep, int64_t sstep) {
                     for (int64_t i = 0; i < n; ++i) {
                       D& x = d[doff + i * dstep];
                       x = elem_from_double<D>(elem_to_double(x) + elem_to_double(s[soff + i * sstep]));
                     }
                   });
    });
  });
}
}  // namespace kestrel::detail

namespace kestrel {
void add_into(const Tensor& dst, const Tensor& src) {
  KESTREL_CHECK(dst.shape() == src.shape(), "add_into", "shape mismatch ", dst.str(), " += ", src.str());
  KESTREL_CHECK(dst.device() == src.device(), "add_into", "device mismatch ", dst.str(), " += ", src.str());
  if (dst.numel() == 0) return;
  if (dst.device().is_cpu())
    detail::cpu_add_into(dst, src);
  else
    detail::cuda_backend().add_into(dst, src);
}
void synchronize(Device device) {
  if (device.is_cuda()) detail::cuda_backend().synchronize(device);
}
}  // namespace kestrel
