// Private: optimizer.gradients "host". Every parameter gradient leaves the device as soon as backward
// completes it (the tape's grad-ready hook): it is copied into its slice of one pinned host buffer on
// the D2H stream, the parameter lets go of it, and its device block returns to the allocator when the
// copy lands (record_stream), so no full gradient set ever exists on the device. The step then works
// on the host copies: finish() waits for the last copy, computes the global norm there (f64, as
// clip_grad_norm on the CPU) and clips in place; AdamW's host update reads them without a D2H pass.
// With parameters on the CPU the copy is a plain one (the same logic, testable without a GPU).
// One micro-batch per step: a second backward would need the gradients added on the host.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "kestrel/models/parameters.h"
#include "kestrel/runtime/tensor.h"

namespace kestrel::train {

class GradientStream {
 public:
  // Registers a grad-ready hook on every parameter that requires grad, and allocates the host copies
  // (pinned on CUDA) in the parameters' dtypes: host_bytes() in all.
  explicit GradientStream(models::ParameterList& params);
  ~GradientStream();
  GradientStream(const GradientStream&) = delete;
  GradientStream& operator=(const GradientStream&) = delete;

  // Waits for this step's copies; returns the global L2 norm of the gradients that arrived and, when
  // max_norm > 0, scales them in place by min(1, max_norm / (norm + 1e-6)) (clip_grad_norm's rule).
  double finish(double max_norm);
  // The host gradient of each parameter (ParameterList order); undefined where none arrived this step.
  // Valid after finish() until clear().
  const std::vector<Tensor>& gradients() const { return arrived_; }
  // Forgets this step's gradients (the buffers stay for the next one).
  void clear();

  int64_t host_bytes() const { return host_bytes_; }
  int64_t streamed_bytes() const { return streamed_bytes_; }  // since the last clear()

  class Copier;  // the device side of a copy (train/cuda/gradient_stream_cuda.cpp on CUDA)

 private:
  void on_gradient(size_t index, Tensor& param, Tensor& grad);

  std::vector<Tensor> host_;     // per parameter: its slice of the host buffer
  std::vector<Tensor> arrived_;  // host_[i] once its gradient has been copied this step
  std::shared_ptr<void> buffer_;
  std::unique_ptr<Copier> copier_;
  int64_t host_bytes_ = 0, streamed_bytes_ = 0;
  std::shared_ptr<bool> alive_ = std::make_shared<bool>(true);  // hooks outlive this object
};

class GradientStream::Copier {
 public:
  virtual ~Copier() = default;
  // Host memory for `bytes` of gradients (pinned where copies are asynchronous).
  virtual std::shared_ptr<void> allocate(int64_t bytes) = 0;
  // Starts copying `grad` into `host` (same bytes); `grad`'s block may be reused once it has landed.
  virtual void copy(const Tensor& grad, const Tensor& host) = 0;
  // Blocks until every copy started so far has landed.
  virtual void wait() = 0;
};

#if KESTREL_WITH_CUDA
std::unique_ptr<GradientStream::Copier> make_cuda_gradient_copier(int device);
#endif

}  // namespace kestrel::train
