// The op harness's checks: forward vs the f64 reference, gradcheck, device vs CPU.
#include "support/op_table.h"

#include <sstream>

#include "kestrel/autograd/grad_mode.h"
#include "kestrel/ops/embedding.h"
#include "kestrel/ops/shape.h"

namespace kestrel::testing {

double OpTolerance::for_dtype(DType dt) const {
  switch (dt) {
    case DType::F64: return f64;
    case DType::F32: return f32;
    case DType::F16: return f16;
    case DType::BF16: return bf16;
    default: return 0;
  }
}

OpInputs to_reference_inputs(const OpInputs& inputs) {
  OpInputs out;
  for (const Tensor& t : inputs) {
    if (!t.defined()) {
      out.push_back(t);
      continue;
    }
    Tensor c = t.to(Device::cpu());
    out.push_back(is_floating(c.dtype()) ? c.to(DType::F64) : c);
  }
  return out;
}

namespace {

std::vector<Tensor> run_reference(const OpCase& c, const OpInputs& inputs) {
  autograd::NoGradGuard ng;
  OpInputs ref_in = to_reference_inputs(inputs);
  return c.reference ? c.reference(ref_in) : c.op(ref_in);
}

::testing::AssertionResult compare(const std::vector<Tensor>& got, const std::vector<Tensor>& want, double tol,
                                   const std::string& what, double rms_floor = 0) {
  if (got.size() != want.size())
    return ::testing::AssertionFailure() << what << ": " << got.size() << " outputs, reference has " << want.size();
  for (size_t k = 0; k < got.size(); ++k) {
    if (got[k].shape() != want[k].shape())
      return ::testing::AssertionFailure() << what << ": output " << k << " is " << got[k].str() << ", reference "
                                           << want[k].str();
    double err = rms_floor > 0 ? rel_l2_floored(got[k], want[k], rms_floor) : rel_l2(got[k], want[k]);
    if (!(err <= tol))
      return ::testing::AssertionFailure() << what << ": output " << k << " " << got[k].str() << " rel_l2 " << err
                                           << " > " << tol;
  }
  return ::testing::AssertionSuccess();
}

}  // namespace

::testing::AssertionResult check_forward(const OpCase& c, DType dtype, Device device) {
  OpInputs inputs = c.make_inputs(dtype, device);
  std::vector<Tensor> got;
  {
    autograd::NoGradGuard ng;
    got = c.op(inputs);
  }
  for (const Tensor& t : got)
    if (t.dtype() != dtype && is_floating(t.dtype()))
      return ::testing::AssertionFailure() << c.id() << ": output " << t.str() << " not in input dtype " << dtype_name(dtype);
  std::ostringstream what;
  what << c.id() << " [" << dtype_name(dtype) << "]";
  return compare(got, run_reference(c, inputs), c.tol.for_dtype(dtype), what.str(), c.rms_floor);
}

::testing::AssertionResult check_backward(const OpCase& c) {
  OpInputs inputs = c.make_inputs(DType::F64, Device::cpu());
  auto f = [&](const std::vector<Tensor>& in) -> Tensor {
    std::vector<Tensor> outs = c.op(in);
    if (outs.size() == 1) return outs[0];
    std::vector<Tensor> flat;
    for (const Tensor& o : outs) flat.push_back(reshape(o, {-1}));
    return concat(flat, 0);
  };
  auto r = gradcheck(f, inputs, c.grad_opts);
  if (!r) return ::testing::AssertionFailure() << c.id() << ": " << r.message();
  return r;
}

::testing::AssertionResult check_device_matches_cpu(const OpCase& c, DType dtype, Device device) {
  OpInputs dev_in = c.make_inputs(dtype, device);
  OpInputs cpu_in;
  for (const Tensor& t : dev_in) cpu_in.push_back(t.defined() ? t.to(Device::cpu()) : t);
  autograd::NoGradGuard ng;
  std::vector<Tensor> got = c.op(dev_in), want = c.op(cpu_in);
  // Both sides round to `dtype`; allow twice the dtype's tolerance.
  return compare(got, want, 2 * c.tol.for_dtype(dtype), c.id() + " [" + std::string(dtype_name(dtype)) + ", device vs cpu]",
                 c.rms_floor);
}

// Not Tensor::to_double_vector: that goes through float and would round f64 references.
std::vector<double> host_values(const Tensor& t) {
  Tensor h = t.to(Device::cpu()).to(DType::F64).contiguous();
  return std::vector<double>(h.data<double>(), h.data<double>() + h.numel());
}

Tensor f64_tensor(const std::vector<double>& values, const Shape& shape) {
  Tensor t = Tensor::empty(shape, DType::F64);
  EXPECT_EQ(static_cast<int64_t>(values.size()), t.numel());
  std::copy(values.begin(), values.end(), t.data<double>());
  return t;
}

Tensor index_tensor(const std::vector<int64_t>& values, const Shape& shape, DType dtype, Device device) {
  return Tensor::from_vector(values, shape, dtype, device);
}

std::vector<int64_t> unravel(int64_t i, const Shape& shape) {
  std::vector<int64_t> idx(shape.size());
  for (int d = static_cast<int>(shape.size()) - 1; d >= 0; --d) {
    idx[d] = i % shape[d];
    i /= shape[d];
  }
  return idx;
}

int64_t ravel(const std::vector<int64_t>& idx, const Shape& shape) {
  int64_t i = 0;
  for (size_t d = 0; d < shape.size(); ++d) i = i * shape[d] + idx[d];
  return i;
}

Tensor gather_reference(const Tensor& x, const Shape& out_shape,
                        const std::function<int64_t(const std::vector<int64_t>&)>& src) {
  std::vector<double> xv = host_values(x), out(static_cast<size_t>(numel(out_shape)));
  for (int64_t i = 0; i < numel(out_shape); ++i) out[i] = xv[src(unravel(i, out_shape))];
  return f64_tensor(out, out_shape);
}

}  // namespace kestrel::testing
