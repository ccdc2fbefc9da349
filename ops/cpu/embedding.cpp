// CPU row gather/scatter kernels (reference). scatter-add is deterministic: positions are sorted by
// destination row (stable), and each destination row sums its sources in position order in f64.
#include <algorithm>
#include <numeric>
#include <vector>

#include "kernels/embedding.h"
#include "kestrel/runtime/dtype_dispatch.h"
#include "kestrel/runtime/parallel.h"

namespace kestrel::cpu {
namespace {

int64_t index_at(const Tensor& idx, int64_t m) {
  return idx.dtype() == DType::I32 ? idx.data<int32_t>()[m] : idx.data<int64_t>()[m];
}

int64_t first_bad_index_cpu(const Tensor& idx, int64_t n) {
  for (int64_t m = 0; m < idx.numel(); ++m) {
    int64_t v = index_at(idx, m);
    if (v < 0 || v >= n) return m;
  }
  return -1;
}

// Row copies are byte copies: no conversion is involved.
void gather_rows_cpu(const Tensor& out, const Tensor& x, const Tensor& idx) {
  int64_t M = out.shape()[0];
  size_t row_bytes = static_cast<size_t>(out.shape()[1]) * dtype_size(out.dtype());
  const char* px = static_cast<const char*>(x.data_ptr());
  char* po = static_cast<char*>(out.data_ptr());
  parallel_for(0, M, std::max<int64_t>(1, static_cast<int64_t>(65536 / std::max<size_t>(row_bytes, 1))),
               [&](int64_t b, int64_t e) {
                 for (int64_t m = b; m < e; ++m)
                   std::copy_n(px + index_at(idx, m) * row_bytes, row_bytes, po + m * row_bytes);
               });
}

void scatter_rows_cpu(const Tensor& dst, const Tensor& src, const Tensor& idx) {
  int64_t M = src.shape()[0];
  size_t row_bytes = static_cast<size_t>(src.shape()[1]) * dtype_size(src.dtype());
  const char* ps = static_cast<const char*>(src.data_ptr());
  char* pd = static_cast<char*>(dst.data_ptr());
  for (int64_t m = 0; m < M; ++m) std::copy_n(ps + m * row_bytes, row_bytes, pd + index_at(idx, m) * row_bytes);
}

void scatter_add_rows_cpu(const Tensor& dst, const Tensor& src, const Tensor& idx, bool) {
  int64_t M = src.shape()[0], R = src.shape()[1];
  std::vector<int64_t> order(static_cast<size_t>(M));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return index_at(idx, a) < index_at(idx, b); });
  std::vector<int64_t> group_start;  // positions in `order` where a new destination row begins
  for (int64_t k = 0; k < M; ++k)
    if (k == 0 || index_at(idx, order[k]) != index_at(idx, order[k - 1])) group_start.push_back(k);
  int64_t groups = static_cast<int64_t>(group_start.size());
  group_start.push_back(M);
  dispatch_floating(dst.dtype(), "scatter_add_rows", [&](auto tag) {
    using T = decltype(tag);
    const T* ps = src.data<T>();
    T* pd = dst.data<T>();
    parallel_for(0, groups, std::max<int64_t>(1, 8192 / std::max<int64_t>(R, 1)), [&](int64_t b, int64_t e) {
      std::vector<double> acc(static_cast<size_t>(R));
      for (int64_t gi = b; gi < e; ++gi) {
        int64_t row = index_at(idx, order[group_start[gi]]);
        for (int64_t c = 0; c < R; ++c) acc[c] = elem_to_double(pd[row * R + c]);
        for (int64_t k = group_start[gi]; k < group_start[gi + 1]; ++k)
          for (int64_t c = 0; c < R; ++c) acc[c] += elem_to_double(ps[order[k] * R + c]);
        for (int64_t c = 0; c < R; ++c) pd[row * R + c] = elem_from_double<T>(acc[c]);
      }
    });
  });
}

}  // namespace

KESTREL_REGISTER_KERNEL(first_bad_index, cpu, first_bad_index_cpu);
KESTREL_REGISTER_KERNEL(gather_rows, cpu, gather_rows_cpu);
KESTREL_REGISTER_KERNEL(scatter_rows, cpu, scatter_rows_cpu);
KESTREL_REGISTER_KERNEL(scatter_add_rows, cpu, scatter_add_rows_cpu);

}  // namespace kestrel::cpu
