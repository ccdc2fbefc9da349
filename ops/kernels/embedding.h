// Private: row gather/scatter kernel slots behind embedding, index_select_rows and splice_rows.
// Row tensors are contiguous [rows, R] (R = elements per row) in one dtype; indices [M] are
// contiguous i32/i64 and already range-checked by the op.
#pragma once

#include "kernels/registry.h"
#include "kestrel/runtime/tensor.h"

namespace kestrel::kernels {

// First position in idx whose value is outside [0, n), or -1.
using FirstBadIndexFn = int64_t(const Tensor& idx, int64_t n);
// out[m] = x[idx[m]].
using GatherRowsFn = void(const Tensor& out, const Tensor& x, const Tensor& idx);
// dst[idx[m]] += src[m] for every m (repeated indices sum). Deterministic when asked (the CPU always is).
using ScatterAddRowsFn = void(const Tensor& dst, const Tensor& src, const Tensor& idx, bool deterministic);
// dst[idx[m]] = src[m] (idx unique).
using ScatterRowsFn = void(const Tensor& dst, const Tensor& src, const Tensor& idx);

inline KernelSlot<FirstBadIndexFn> first_bad_index;
inline KernelSlot<GatherRowsFn> gather_rows;
inline KernelSlot<ScatterAddRowsFn> scatter_add_rows;
inline KernelSlot<ScatterRowsFn> scatter_rows;

}  // namespace kestrel::kernels
