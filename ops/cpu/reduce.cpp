// CPU sum over the dims where `out` (keepdim form) has size 1: f64 accumulation, parallel over outputs.
#include "cpu/loops.h"
#include "kernels/reduce.h"
#include "kestrel/runtime/dtype_dispatch.h"

namespace kestrel::cpu {
namespace {

void sum_cpu(const Tensor& out, const Tensor& x) {
  int rank = static_cast<int>(x.dim());
  // Split dims into kept (outer) and reduced (inner) lists.
  Shape kept_shape, red_shape;
  Strides kept_stride, red_stride;
  for (int d = 0; d < rank; ++d) {
    if (out.shape()[d] == 1 && x.shape()[d] != 1) {
      red_shape.push_back(x.shape()[d]);
      red_stride.push_back(x.strides()[d]);
    } else {
      kept_shape.push_back(x.shape()[d]);
      kept_stride.push_back(x.strides()[d]);
    }
  }
  int64_t nout = numel(kept_shape), nred = numel(red_shape);
  dispatch_floating(x.dtype(), "sum", [&](auto tag) {
    using T = decltype(tag);
    const T* px = static_cast<const T*>(x.storage()->data());
    T* po = static_cast<T*>(out.data_ptr());
    parallel_for(0, nout, std::max<int64_t>(1, 65536 / std::max<int64_t>(nred, 1)), [&](int64_t b, int64_t e) {
      for (int64_t o = b; o < e; ++o) {
        int64_t base = x.offset(), rem = o;
        for (int k = static_cast<int>(kept_shape.size()) - 1; k >= 0; --k) {
          base += (rem % kept_shape[k]) * kept_stride[k];
          rem /= kept_shape[k];
        }
        double acc = 0.0;
        int nr = static_cast<int>(red_shape.size());
        if (nr == 0) {
          acc = elem_to_double(px[base]);
        } else {
          int64_t inner = red_shape[nr - 1], istep = red_stride[nr - 1];
          int64_t outer = nred / inner;
          for (int64_t r = 0; r < outer; ++r) {
            int64_t off = base, rr = r;
            for (int k = nr - 2; k >= 0; --k) {
              off += (rr % red_shape[k]) * red_stride[k];
              rr /= red_shape[k];
            }
            for (int64_t i = 0; i < inner; ++i) acc += elem_to_double(px[off + i * istep]);
          }
        }
        po[o] = elem_from_double<T>(acc);  // out is contiguous; kept dims are in order
      }
    });
  });
}

}  // namespace

KESTREL_REGISTER_KERNEL(sum, cpu, sum_cpu);

}  // namespace kestrel::cpu
