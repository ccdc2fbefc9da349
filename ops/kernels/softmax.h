// Private: softmax-family kernel slots. The reduced dimension is addressed as [outer, n, inner]
// over a contiguous tensor (element (o, j, i) at o*n*inner + j*inner + i), so no transpose is needed.
#pragma once

#include "kernels/registry.h"
#include "kestrel/runtime/tensor.h"

namespace kestrel::kernels {

struct ReduceDim {
  int64_t outer, n, inner;
};

// out = softmax(x) (log_softmax when `log`), out/x contiguous, same dtype.
using SoftmaxFn = void(const Tensor& out, const Tensor& x, ReduceDim r, bool log);
// dx = y * (dy - sum(dy * y))  (softmax)  or  dx = dy - exp(y) * sum(dy)  (log_softmax; y = log-probs).
using SoftmaxBackwardFn = void(const Tensor& dx, const Tensor& y, const Tensor& dy, ReduceDim r, bool log);
// out [outer*inner] = log(sum(exp(x))) along n (max subtracted).
using LogsumexpFn = void(const Tensor& out, const Tensor& x, ReduceDim r);
// out [outer*inner] = max along n; idx (i64) = first index holding the maximum (NaN counts as max).
using AmaxFn = void(const Tensor& out, const Tensor& idx, const Tensor& x, ReduceDim r);
// dx (zero-filled by the caller) at idx += dy.
using AmaxBackwardFn = void(const Tensor& dx, const Tensor& dy, const Tensor& idx, ReduceDim r);

inline KernelSlot<SoftmaxFn> softmax_forward;
inline KernelSlot<SoftmaxBackwardFn> softmax_backward;
inline KernelSlot<LogsumexpFn> logsumexp_forward;
inline KernelSlot<AmaxFn> amax_forward;
inline KernelSlot<AmaxBackwardFn> amax_backward;

}  // namespace kestrel::kernels
