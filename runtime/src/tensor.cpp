// Tensor handle: factories, raw views, raw copies/casts/transfers and autograd field accessors.
#include "kestrel/runtime/tensor.h"

#include <atomic>
#include <cstring>
#include <numeric>

#include "backend.h"
#include "kestrel/runtime/autograd_meta.h"

namespace kestrel {

uint64_t AutogradMeta::next_id() {
  static std::atomic<uint64_t> counter{1};
  return counter.fetch_add(1, std::memory_order_relaxed);
}

namespace {
std::shared_ptr<TensorImpl> make_impl(const Shape& shape, DType dtype, Device device) {
  for (int64_t d : shape) KESTREL_CHECK(d >= 0, "tensor", "negative dimension in shape ", shape_str(shape));
  auto impl = std::make_shared<TensorImpl>();
  size_t bytes = static_cast<size_t>(kestrel::numel(shape)) * dtype_size(dtype);
  if (device.is_cuda()) {
    (void)detail::cuda_backend();  // clear error when CUDA is absent
    KESTREL_CHECK(dtype != DType::F64, "tensor", "f64 tensors are CPU-only (the test oracle dtype); use f32 on ",
                  device.str());
  }
  impl->storage = std::make_shared<Storage>(bytes, device, current_memory_tag());
  impl->shape = shape;
  impl->strides = contiguous_strides(shape);
  impl->dtype = dtype;
  return impl;
}
}  // namespace

Tensor Tensor::empty(const Shape& shape, DType dtype, Device device) {
  return Tensor(make_impl(shape, dtype, device));
}

Tensor Tensor::zeros(const Shape& shape, DType dtype, Device device) {
  Tensor t = empty(shape, dtype, device);
  t.zero_();
  return t;
}

Tensor Tensor::full(const Shape& shape, double value, DType dtype, Device device) {
  Tensor t = empty(shape, dtype, device);
  t.fill_(value);
  return t;
}

Tensor Tensor::arange(int64_t n, DType dtype, Device device) {
  std::vector<int64_t> v(n);
  std::iota(v.begin(), v.end(), 0);
  return from_vector(v, {n}, dtype, device);
}

namespace {
// Copies host values of type T (stored as `host_dtype`) into a new tensor of `dtype` on `device`.
template <typename T>
Tensor tensor_from_values(const std::vector<T>& values, DType host_dtype, const Shape& shape, DType dtype,
                          Device device) {
  KESTREL_CHECK(static_cast<int64_t>(values.size()) == kestrel::numel(shape), "tensor", "from_vector: ",
                values.size(), " values for shape ", shape_str(shape));
  Tensor host = Tensor::from_blob(const_cast<T*>(values.data()), shape, host_dtype, Device::cpu());
  Tensor out = Tensor::empty(shape, dtype, device);
  out.copy_(host);
  return out;
}
}  // namespace

Tensor Tensor::from_vector(const std::vector<float>& values, const Shape& shape, DType dtype, Device device) {
  return tensor_from_values(values, DType::F32, shape, dtype, device);
}

Tensor Tensor::from_vector(const std::vector<int64_t>& values, const Shape& shape, DType dtype, Device device) {
  return tensor_from_values(values, DType::I64, shape, dtype, device);
}

Tensor Tensor::from_blob(void* data, const Shape& shape, DType dtype, Device device, std::shared_ptr<void> keep_alive) {
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = std::make_shared<Storage>(data, static_cast<size_t>(kestrel::numel(shape)) * dtype_size(dtype),
                                            device, std::move(keep_alive));
  impl->shape = shape;
  impl->strides = contiguous_strides(shape);
  impl->dtype = dtype;
  return Tensor(std::move(impl));
}

int64_t Tensor::size(int64_t d) const { return shape()[normalize_dim(d, dim(), "tensor")]; }

bool Tensor::is_contiguous() const {
  int64_t expected = 1;
  for (int i = static_cast<int>(dim()) - 1; i >= 0; --i) {
    if (shape()[i] == 1) continue;
    if (strides()[i] != expected) return false;
    expected *= shape()[i];
  }
  return true;
}

std::string Tensor::str() const {
  if (!defined()) return "undefined";
  return std::string(dtype_name(dtype())) + shape_str(shape()) + " " + device().str();
}

void* Tensor::data_ptr() const {
  return static_cast<char*>(impl().storage->data()) + impl().offset * static_cast<int64_t>(dtype_size(dtype()));
}

Tensor Tensor::as_strided(const Shape& shape, const Strides& strides, int64_t offset) const {
  KESTREL_CHECK(shape.size() == strides.size(), "as_strided", "shape ", shape_str(shape), " and strides ",
                shape_str(strides), " differ in rank");
  // Bounds: the furthest element reached must lie inside the storage.
  int64_t hi = offset, lo = offset;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] == 0) { hi = lo = offset; break; }
    int64_t ext = (shape[i] - 1) * strides[i];
    (ext >= 0 ? hi : lo) += ext;
  }
  int64_t cap = static_cast<int64_t>(storage()->bytes() / dtype_size(dtype()));
  KESTREL_CHECK(lo >= 0 && (kestrel::numel(shape) == 0 || hi < cap), "as_strided", "view ", shape_str(shape),
                " strides ", shape_str(strides), " offset ", offset, " exceeds storage of ", cap, " elements");
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = storage();
  impl->shape = shape;
  impl->strides = strides;
  impl->offset = offset;
  impl->dtype = dtype();
  return Tensor(std::move(impl));
}

Tensor Tensor::view(const Shape& shape_in) const {
  Shape shape = shape_in;
  int64_t known = 1, infer = -1;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] == -1) {
      KESTREL_CHECK(infer < 0, "view", "only one dimension may be -1 in ", shape_str(shape_in));
      infer = static_cast<int64_t>(i);
    } else {
      known *= shape[i];
    }
  }
  if (infer >= 0) {
    KESTREL_CHECK(known > 0 && numel() % known == 0, "view", "cannot view ", str(), " as ", shape_str(shape_in));
    shape[infer] = numel() / known;
  }
  KESTREL_CHECK(kestrel::numel(shape) == numel(), "view", "cannot view ", str(), " as ", shape_str(shape_in),
                " (element counts differ)");
  KESTREL_CHECK(is_contiguous(), "view", "tensor ", str(), " is not contiguous; call contiguous() first");
  return as_strided(shape, contiguous_strides(shape), offset());
}

Tensor Tensor::permute_view(const std::vector<int64_t>& dims) const {
  KESTREL_CHECK(static_cast<int64_t>(dims.size()) == dim(), "permute", "got ", dims.size(), " dims for a ",
                dim(), "-D tensor");
  Shape s(dims.size());
  Strides st(dims.size());
  std::vector<bool> seen(dims.size(), false);
  for (size_t i = 0; i < dims.size(); ++i) {
    int d = normalize_dim(dims[i], dim(), "permute");
    KESTREL_CHECK(!seen[d], "permute", "dimension ", d, " repeated");
    seen[d] = true;
    s[i] = shape()[d];
    st[i] = strides()[d];
  }
  return as_strided(s, st, offset());
}

Tensor Tensor::narrow_view(int64_t d, int64_t start, int64_t length) const {
  int dd = normalize_dim(d, dim(), "narrow");
  KESTREL_CHECK(start >= 0 && length >= 0 && start + length <= shape()[dd], "narrow", "range [", start, ", ",
                start + length, ") out of bounds for dim ", dd, " of size ", shape()[dd]);
  Shape s = shape();
  s[dd] = length;
  return as_strided(s, strides(), offset() + start * strides()[dd]);
}

Tensor Tensor::expand_view(const Shape& target) const {
  KESTREL_CHECK(static_cast<int64_t>(target.size()) >= dim(), "expand", "cannot expand ", str(), " to ",
                shape_str(target));
  size_t lead = target.size() - shape().size();
  Strides st(target.size(), 0);
  for (size_t i = 0; i < shape().size(); ++i) {
    int64_t src = shape()[i], dst = target[lead + i];
    KESTREL_CHECK(src == dst || src == 1, "expand", "cannot expand ", str(), " to ", shape_str(target));
    st[lead + i] = src == 1 && dst != 1 ? 0 : strides()[i];
  }
  return as_strided(target, st, offset());
}

Tensor Tensor::contiguous() const { return is_contiguous() ? *this : clone(); }

Tensor Tensor::clone() const {
  Tensor out = empty(shape(), dtype(), device());
  out.copy_(*this);
  return out;
}

Tensor Tensor::to(DType dt) const {
  if (dt == dtype()) return *this;
  Tensor out = empty(shape(), dt, device());
  out.copy_(*this);
  return out;
}

Tensor Tensor::to(Device dev) const {
  if (dev == device()) return *this;
  Tensor out = empty(shape(), dtype(), dev);
  out.copy_(*this);
  return out;
}

void Tensor::copy_(const Tensor& src) {
  KESTREL_CHECK(src.shape() == shape(), "copy", "shape mismatch: destination ", str(), ", source ", src.str());
  if (numel() == 0) return;
  Device dd = device(), sd = src.device();
  if (dd == sd) {
    if (dd.is_cpu())
      detail::cpu_strided_copy(*this, src);
    else
      detail::cuda_backend().strided_copy(*this, src);
    return;
  }
  // Across devices: make a contiguous source of the destination dtype on the source device,
  // move the bytes, then scatter into the (possibly strided) destination.
  Tensor s = src.dtype() == dtype() ? src.contiguous() : src.to(dtype());
  Tensor staging = is_contiguous() ? *this : empty(shape(), dtype(), dd);
  detail::cuda_backend().copy_bytes(staging.data_ptr(), dd, s.data_ptr(), sd, nbytes());
  if (!staging.same_as(*this)) copy_(staging);
}

void Tensor::fill_(double value) {
  if (numel() == 0) return;
  if (device().is_cpu())
    detail::cpu_fill(*this, value);
  else
    detail::cuda_backend().fill(*this, value);
}

void Tensor::zero_() { fill_(0.0); }

std::vector<float> Tensor::to_float_vector() const {
  Tensor h = to(Device::cpu()).to(DType::F32).contiguous();
  const float* p = h.data<float>();
  return std::vector<float>(p, p + h.numel());
}

std::vector<double> Tensor::to_double_vector() const {
  Tensor h = to(Device::cpu()).to(DType::F64).contiguous();
  const double* p = h.data<double>();
  return std::vector<double>(p, p + h.numel());
}

std::vector<int64_t> Tensor::to_int_vector() const {
  Tensor h = to(Device::cpu()).to(DType::I64).contiguous();
  const int64_t* p = h.data<int64_t>();
  return std::vector<int64_t>(p, p + h.numel());
}

double Tensor::item() const {
  KESTREL_CHECK(numel() == 1, "item", "tensor ", str(), " has ", numel(), " elements, expected 1");
  if (dtype() == DType::I64 || dtype() == DType::I32) return static_cast<double>(to_int_vector()[0]);
  return to_double_vector()[0];
}

// ---- autograd fields ----
bool Tensor::requires_grad() const { return impl().autograd && impl().autograd->requires_grad; }

Tensor& Tensor::set_requires_grad(bool on) {
  auto& meta = impl().autograd;
  if (!meta) {
    if (!on) return *this;
    meta = std::make_shared<AutogradMeta>();
    meta->id = AutogradMeta::next_id();
  }
  KESTREL_CHECK(meta->is_leaf, "autograd", "set_requires_grad on a non-leaf tensor ", str(),
                "; detach() it first");
  KESTREL_CHECK(!on || is_floating(dtype()), "autograd", "only floating tensors can require grad, got ", str());
  meta->requires_grad = on;
  return *this;
}

Tensor Tensor::grad() const { return impl().autograd ? impl().autograd->grad : Tensor(); }

void Tensor::set_grad(const Tensor& g) {
  KESTREL_CHECK(!g.defined() || g.shape() == shape(), "autograd", "gradient ", g.str(), " does not match ", str());
  auto& meta = impl().autograd;
  if (!meta) {
    meta = std::make_shared<AutogradMeta>();
    meta->id = AutogradMeta::next_id();
  }
  meta->grad = g;
}

void Tensor::zero_grad() {
  if (impl().autograd) impl().autograd->grad = Tensor();
}

bool Tensor::is_leaf() const { return !impl().autograd || impl().autograd->is_leaf; }

const std::string& Tensor::name() const {
  static const std::string empty_name;
  return impl().autograd ? impl().autograd->name : empty_name;
}

Tensor& Tensor::set_name(const std::string& n) {
  auto& meta = impl().autograd;
  if (!meta) {
    meta = std::make_shared<AutogradMeta>();
    meta->id = AutogradMeta::next_id();
  }
  meta->name = n;
  return *this;
}

Tensor Tensor::detach() const {
  auto impl2 = std::make_shared<TensorImpl>(impl());
  impl2->autograd = nullptr;
  return Tensor(std::move(impl2));
}

}  // namespace kestrel
