// Private: argument checks shared by the communicator backends (comm_inprocess.cpp, cuda/comm_nccl.cpp).
#pragma once

#include "kestrel/runtime/communicator.h"
#include "kestrel/runtime/error.h"

namespace kestrel::comm_detail {

// Contiguous, on `device`, and (for reductions) of a floating dtype the backends add.
inline void check_tensor(const char* what, const Tensor& t, bool reduces, Device device) {
  KESTREL_CHECK(t.defined(), "comm", what, ": undefined tensor");
  KESTREL_CHECK(t.is_contiguous(), "comm", what, ": the tensor must be contiguous, got ", t.str());
  KESTREL_CHECK(t.device() == device, "comm", what, ": this communicator works on ", device.str(),
                " tensors, got ", t.str());
  if (reduces) {
    const DType d = t.dtype();
    KESTREL_CHECK(d == DType::F32 || d == DType::BF16 || d == DType::F16 || d == DType::F64, "comm", what,
                  ": reductions take f32, bf16, f16 or f64 tensors, got ", dtype_name(d));
  }
}

// `whole` holds world * part.numel() elements of part's dtype (reduce_scatter input / all_gather output).
inline void check_split(const char* what, const Tensor& whole, const Tensor& part, int world) {
  KESTREL_CHECK(whole.dtype() == part.dtype(), "comm", what, ": dtypes differ (", dtype_name(whole.dtype()), " vs ",
                dtype_name(part.dtype()), ")");
  KESTREL_CHECK(whole.numel() == part.numel() * world, "comm", what, ": the full tensor must hold world size (",
                world, ") x ", part.numel(), " = ", part.numel() * world, " elements, got ", whole.numel());
}

}  // namespace kestrel::comm_detail
