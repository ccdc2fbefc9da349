// The table-driven op harness: one OpCase per op and shape class. Each case builds fresh random
// inputs for a device/dtype, runs the op, and has a float64 reference (plain loops, or the op itself
// run in f64 on the CPU). The CPU test (tests/ops/test_op_table.cpp) checks every case's forward
// against its reference in f64, f32 and bf16 and its backward with the finite-difference checker;
// the CUDA test runs the same table on the device and compares with the CPU result.
//
// Adding cases: each op family registers its cases in tests/support/op_cases_<family>.cpp through
// one function `void add_<family>_cases(std::vector<OpCase>&)`, listed once in op_cases.cpp.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "support/numerics.h"

namespace kestrel::testing {

using OpInputs = std::vector<Tensor>;
using OpFn = std::function<std::vector<Tensor>(const OpInputs&)>;

// Relative L2 bound of the op's output against the f64 reference, per dtype of the inputs.
struct OpTolerance {
  double f64 = 1e-9;
  double f32 = 2e-5;
  double f16 = 4e-3;
  double bf16 = 1.6e-2;
  double for_dtype(DType dt) const;
};

struct OpCase {
  std::string name;         // the op, e.g. "rms_norm"
  std::string shape_class;  // e.g. "rows127_c1000" (letters, digits and '_')
  // Fresh random inputs: floating inputs in `dtype` on `device`; index inputs i32/i64 on `device`.
  std::function<OpInputs(DType dtype, Device device)> make_inputs;
  OpFn op;
  // Receives the same inputs as f64 (floating) CPU tensors; returns f64 outputs. Empty = run `op`
  // itself in f64 on the CPU (for ops whose f64 path is already checked elsewhere).
  OpFn reference;
  OpTolerance tol;
  // Outputs whose values can cancel (a difference of terms of this size) are judged against a
  // reference RMS of at least this much (rel_l2_floored); 0 = plain relative L2.
  double rms_floor = 0;
  std::vector<DType> dtypes = {DType::F64, DType::F32, DType::BF16};  // forward checks
  bool gradcheck = false;  // finite differences in f64 (keep the inputs small: 2 evaluations per element)
  GradcheckOptions grad_opts;

  std::string id() const { return name + "_" + shape_class; }
};

// All registered cases, family by family (op_cases.cpp).
std::vector<OpCase> all_op_cases();

// Floating inputs converted to f64, everything moved to the CPU.
OpInputs to_reference_inputs(const OpInputs& inputs);
// Forward of `c` on `device` with `dtype` inputs vs the f64 reference on the same (rounded) inputs.
::testing::AssertionResult check_forward(const OpCase& c, DType dtype, Device device = Device::cpu());
// The tape's gradients vs central finite differences, f64 on the CPU (multi-output ops flattened).
::testing::AssertionResult check_backward(const OpCase& c);
// The op on `device` vs the same op on the CPU with the same inputs (for device kernels).
::testing::AssertionResult check_device_matches_cpu(const OpCase& c, DType dtype, Device device);

// ---- helpers for writing references ----
std::vector<double> host_values(const Tensor& t);                      // row-major f64 copy
Tensor f64_tensor(const std::vector<double>& values, const Shape& shape);  // new f64 CPU tensor
Tensor index_tensor(const std::vector<int64_t>& values, const Shape& shape, DType dtype, Device device);
// Row-major multi-index of flat position i in `shape`.
std::vector<int64_t> unravel(int64_t i, const Shape& shape);
int64_t ravel(const std::vector<int64_t>& idx, const Shape& shape);
// A reference that maps each output element to one input element (views, copies): out[i] = x[src(i)].
Tensor gather_reference(const Tensor& x, const Shape& out_shape,
                        const std::function<int64_t(const std::vector<int64_t>& out_idx)>& src);

}  // namespace kestrel::testing
