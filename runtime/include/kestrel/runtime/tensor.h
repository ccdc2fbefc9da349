// Tensor: a cheap handle (shared ownership of an impl) onto a strided view of a Storage.
//
// Member functions here never record on the autograd tape: they are the raw data operations
// (copies, casts, device transfers, strided views) that kernels and the autograd engine use.
// Differentiable operations — including reshape/permute/narrow and casts — are the free functions
// in <kestrel/ops/...>; those are what model code calls.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kestrel/runtime/device.h"
#include "kestrel/runtime/dtype.h"
#include "kestrel/runtime/error.h"
#include "kestrel/runtime/memory.h"
#include "kestrel/runtime/shape.h"
#include "kestrel/runtime/storage.h"

namespace kestrel {

class Tensor;
struct AutogradMeta;  // defined in autograd/

struct TensorImpl {
  std::shared_ptr<Storage> storage;
  Shape shape;
  Strides strides;
  int64_t offset = 0;  // in elements
  DType dtype = DType::F32;
  std::shared_ptr<AutogradMeta> autograd;  // null unless it requires grad or came out of a recorded op
};

class Tensor {
 public:
  Tensor() = default;
  explicit Tensor(std::shared_ptr<TensorImpl> impl) : impl_(std::move(impl)) {}

  // ---- factories (tag: the current TagScope) ----
  static Tensor empty(const Shape& shape, DType dtype = DType::F32, Device device = Device::cpu());
  static Tensor zeros(const Shape& shape, DType dtype = DType::F32, Device device = Device::cpu());
  static Tensor full(const Shape& shape, double value, DType dtype = DType::F32, Device device = Device::cpu());
  static Tensor arange(int64_t n, DType dtype = DType::I64, Device device = Device::cpu());
  // Copies host values into a new tensor of `dtype` on `device`.
  static Tensor from_vector(const std::vector<float>& values, const Shape& shape, DType dtype = DType::F32,
                            Device device = Device::cpu());
  static Tensor from_vector(const std::vector<int64_t>& values, const Shape& shape, DType dtype = DType::I64,
                            Device device = Device::cpu());
  // Borrows memory without copying (not owned, not counted).
  static Tensor from_blob(void* data, const Shape& shape, DType dtype, Device device,
                          std::shared_ptr<void> keep_alive = nullptr);

  // ---- metadata ----
  bool defined() const { return impl_ != nullptr; }
  const Shape& shape() const { return impl().shape; }
  const Strides& strides() const { return impl().strides; }
  int64_t dim() const { return static_cast<int64_t>(impl().shape.size()); }
  int64_t size(int64_t d) const;
  int64_t numel() const { return kestrel::numel(impl().shape); }
  int64_t offset() const { return impl().offset; }
  DType dtype() const { return impl().dtype; }
  Device device() const { return impl().storage->device(); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype()); }
  bool is_contiguous() const;
  const std::shared_ptr<Storage>& storage() const { return impl().storage; }
  std::string str() const;  // "f32[2, 3] cpu"

  void* data_ptr() const;
  template <typename T>
  T* data() const { return static_cast<T*>(data_ptr()); }

  // ---- raw views (share storage; no autograd) ----
  Tensor as_strided(const Shape& shape, const Strides& strides, int64_t offset) const;
  Tensor view(const Shape& shape) const;  // contiguous only; one dim may be -1
  Tensor permute_view(const std::vector<int64_t>& dims) const;
  Tensor narrow_view(int64_t dim, int64_t start, int64_t length) const;
  Tensor expand_view(const Shape& shape) const;  // broadcast by zero strides

  // ---- raw data operations (no autograd) ----
  Tensor contiguous() const;  // self if already contiguous
  Tensor clone() const;       // always a fresh contiguous copy (tag: current scope)
  Tensor to(DType dtype) const;
  Tensor to(Device device) const;
  void copy_(const Tensor& src);  // same shape; any dtypes/devices; strided allowed
  void fill_(double value);
  void zero_();
  // Host copies of the values (converted), in logical (row-major) order.
  std::vector<float> to_float_vector() const;
  std::vector<double> to_double_vector() const;
  std::vector<int64_t> to_int_vector() const;
  double item() const;  // one element

  // ---- autograd fields (see autograd/) ----
  bool requires_grad() const;
  Tensor& set_requires_grad(bool on);  // leaves only
  Tensor grad() const;                 // undefined when none
  void set_grad(const Tensor& g);
  void zero_grad();                    // drops the gradient
  bool is_leaf() const;
  const std::string& name() const;     // parameter name (empty for most tensors)
  Tensor& set_name(const std::string& name);
  Tensor detach() const;               // same data, no autograd identity

  TensorImpl& impl() const {
    KESTREL_CHECK(impl_ != nullptr, "tensor", "use of an undefined tensor");
    return *impl_;
  }
  const std::shared_ptr<TensorImpl>& impl_ptr() const { return impl_; }
  bool same_as(const Tensor& o) const { return impl_ == o.impl_; }

 private:
  std::shared_ptr<TensorImpl> impl_;
};

}  // namespace kestrel
