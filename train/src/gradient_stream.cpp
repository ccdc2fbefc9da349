// GradientStream (gradient_stream.h): hooks, host slices and the host-side norm and clip.
#include "gradient_stream.h"

#include <cstdlib>
#include <cstring>

#include "kestrel/autograd/tape.h"
#include "kestrel/ops/optim.h"
#include "kestrel/runtime/error.h"

namespace kestrel::train {
namespace {

// Parameters on the CPU: plain host memory and a synchronous copy.
class HostCopier final : public GradientStream::Copier {
 public:
  std::shared_ptr<void> allocate(int64_t bytes) override {
    void* p = std::aligned_alloc(64, static_cast<size_t>((bytes + 63) / 64 * 64));
    KESTREL_CHECK(p != nullptr || bytes == 0, "gradient-stream", "cannot allocate ", bytes, " bytes of host memory");
    return std::shared_ptr<void>(p, [](void* q) { std::free(q); });
  }
  void copy(const Tensor& grad, const Tensor& host) override {
    std::memcpy(host.data_ptr(), grad.data_ptr(), grad.nbytes());
  }
  void wait() override {}
};

}  // namespace

GradientStream::GradientStream(models::ParameterList& params) {
  Device dev = Device::cpu();
  std::vector<int64_t> offsets;
  for (auto& [name, p] : params.items()) {
    KESTREL_CHECK(p->is_contiguous(), "gradient-stream", "parameter '", name, "' must be contiguous");
    if (p->requires_grad()) dev = p->device();
    offsets.push_back(host_bytes_);
    host_bytes_ += (static_cast<int64_t>(p->nbytes()) + 255) / 256 * 256;
  }
#if KESTREL_WITH_CUDA
  if (dev.is_cuda()) copier_ = make_cuda_gradient_copier(dev.index);
#endif
  if (!copier_) copier_ = std::make_unique<HostCopier>();
  buffer_ = copier_->allocate(host_bytes_);
  size_t i = 0;
  for (auto& [name, p] : params.items()) {
    char* base = static_cast<char*>(buffer_.get()) + offsets[i];
    host_.push_back(Tensor::from_blob(base, p->shape(), p->dtype(), Device::cpu(), buffer_));
    arrived_.emplace_back();
    if (p->requires_grad()) {
      KESTREL_CHECK(p->device() == dev, "gradient-stream", "parameters on ", dev.str(), " and ", p->device().str(),
                    " ('", name, "'); the stream serves one device");
      std::weak_ptr<bool> alive = alive_;
      autograd::add_grad_ready_hook(*p, [this, alive, i](Tensor& param, Tensor& grad) {
        if (alive.lock()) on_gradient(i, param, grad);
      });
    }
    ++i;
  }
}

GradientStream::~GradientStream() {
  *alive_ = false;
  alive_.reset();
  if (copier_) copier_->wait();  // no copy may still write into the buffer
}

void GradientStream::on_gradient(size_t index, Tensor& param, Tensor& grad) {
  KESTREL_CHECK(!arrived_[index].defined(), "gradient-stream", "a second gradient for '", param.name(),
                "' in one step: optimizer.gradients=\"host\" takes one backward per step (train.grad_accum 1)");
  const Tensor& host = host_[index];
  KESTREL_CHECK(grad.dtype() == host.dtype() && grad.shape() == host.shape() && grad.is_contiguous(),
                "gradient-stream", "gradient of '", param.name(), "' is ", grad.str(), ", expected a contiguous ",
                dtype_name(host.dtype()), " tensor of the parameter's shape");
  copier_->copy(grad, host);
  streamed_bytes_ += static_cast<int64_t>(grad.nbytes());
  arrived_[index] = host;
  param.zero_grad();  // the device block returns to the allocator once the copy has landed
}

double GradientStream::finish(double max_norm) {
  copier_->wait();
  std::vector<Tensor> grads;
  for (const Tensor& t : arrived_)
    if (t.defined()) grads.push_back(t);
  return grads.empty() ? 0.0 : clip_grad_norm(grads, max_norm);
}

void GradientStream::clear() {
  copier_->wait();
  for (Tensor& t : arrived_) t = Tensor();
  streamed_bytes_ = 0;
}

}  // namespace kestrel::train
