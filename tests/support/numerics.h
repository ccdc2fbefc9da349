// Test numerics: fresh random inputs, float64 references, relative errors, and the shared
// finite-difference gradient checker every op test uses.
#pragma once

#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <vector>

#include "kestrel/runtime/random.h"
#include "kestrel/runtime/tensor.h"

namespace kestrel::testing {

// A fresh random tensor (normal(0, std) by default); each call draws new values.
Tensor randn(const Shape& shape, DType dtype = DType::F32, Device device = Device::cpu(), double std = 1.0);
Tensor randu(const Shape& shape, double lo, double hi, DType dtype = DType::F32, Device device = Device::cpu());

// ||a - b|| / max(||b||, tiny), both converted to f64 on the host.
double rel_l2(const Tensor& a, const Tensor& b);
// rel_l2 with the reference's RMS floored at rms_floor: a reference that is (nearly) zero is then
// judged in absolute terms against elements of size rms_floor instead of dividing by ~0.
double rel_l2_floored(const Tensor& a, const Tensor& b, double rms_floor);
double max_abs_diff(const Tensor& a, const Tensor& b);
// A tensor's values as f64 on the host (any device; Tensor::to_double_vector and item() go through f32).
std::vector<double> host_f64(const Tensor& t);
bool all_finite(const Tensor& t);

// Typical error bound for results stored in `dtype` (relative L2).
double dtype_tolerance(DType dtype);

struct GradcheckOptions {
  double eps = 1e-6;    // central-difference step (inputs are f64)
  double atol = 1e-6;
  double rtol = 1e-4;
  // Inputs (by index) that are not differentiated (e.g. integer labels).
  std::vector<int> skip_inputs;
};

// Checks the tape's gradients of f at `inputs` against central finite differences, in float64 on
// the CPU, with a random upstream gradient (so every output element matters). Floating inputs are
// converted to f64 and marked requires_grad. f may return any shape.
::testing::AssertionResult gradcheck(const std::function<Tensor(const std::vector<Tensor>&)>& f,
                                     const std::vector<Tensor>& inputs, const GradcheckOptions& opts = {});

}  // namespace kestrel::testing
