// CUDA fused linear + cross-entropy slots (kernels/cross_entropy.h). Forward: the launcher in
// cuda/fused_linear_cross_entropy.h (loss and lse, no gradient buffers). Forward + backward (an upstream
// gradient known in the forward): the same launcher with both gradients, three GEMMs. Backward: the lse-based pass of
// fused_linear_cross_entropy_backward.cu with the upstream gradient as a device scalar (no host sync):
// per vocabulary chunk the logits are recomputed and turned into the gradient with the saved lse; a
// bf16/f16 d_weight is written by its GEMM directly (f32 accumulation, one rounding), and with
// accumulate_d_weight added into the gradient the weight already holds (no second [V, H] buffer).
// Chunk sizes of the forward come from the launcher's picker (workspace <= 1 GiB), not the CPU
// defaults the op layer resolves. Workspaces are Tensor::empty under a Workspace tag.
#include "cuda/common.cuh"
#include "cuda/fused_linear_cross_entropy.h"
#include "kernels/cross_entropy.h"
#include "kestrel/ops/workspace_sizes.h"
#include "kestrel/runtime/memory.h"

namespace kestrel::cuda_ops {
namespace {

// The forward's bound (kestrel/ops/workspace_sizes.h: the memory planner plans the same one).
constexpr size_t kWorkspaceBound = workspace::kFusedCrossEntropyBound;

cuda::FusedLinearCrossEntropyParams make_params(const Tensor& hidden, const Tensor& weight, const Tensor& labels,
                                                const Tensor& token_weights, const kernels::CrossEntropyParams& p) {
  check_cuda_dtype(hidden.dtype(), "fused_linear_cross_entropy");
  KESTREL_CHECK(labels.dtype() == DType::I64, "fused_linear_cross_entropy", "labels must be i64 on CUDA");
  cuda::FusedLinearCrossEntropyParams f;
  f.dtype = hidden.dtype();
  f.tokens = hidden.shape()[0];
  f.hidden = hidden.shape()[1];
  f.vocab = weight.shape()[0];
  f.hidden_states = hidden.data_ptr();
  f.weight = weight.data_ptr();
  f.labels = static_cast<const int64_t*>(labels.data_ptr());
  if (token_weights.defined()) {
    KESTREL_CHECK(token_weights.dtype() == DType::F32, "fused_linear_cross_entropy", "token weights must be f32");
    f.token_weights = static_cast<const float*>(token_weights.data_ptr());
  }
  f.ignore_index = p.ignore_index;
  f.reduction = p.reduction == Reduction::Sum ? cuda::CrossEntropyReduction::Sum : cuda::CrossEntropyReduction::Mean;
  f.z_loss = static_cast<float>(p.z_loss);
  f.label_smoothing = static_cast<float>(p.label_smoothing);
  return f;
}

// The gradient side of the launch: the upstream gradient (an f32 scalar on the device, returned so
// that it lives until the launch) and where d_hidden / d_weight go (either may be undefined).
Tensor set_gradients(cuda::FusedLinearCrossEntropyParams& f, const Tensor& d_hidden, const Tensor& d_weight,
                     const Tensor& grad_loss, const kernels::CrossEntropyParams& p) {
  KESTREL_CHECK(grad_loss.dtype() == DType::F32 && grad_loss.numel() == 1, "fused_linear_cross_entropy",
                "upstream gradient must be an f32 scalar, got ", grad_loss.str());
  Tensor g = grad_loss.contiguous();
  f.upstream_grad = static_cast<const float*>(g.data_ptr());
  f.accumulate_d_weight = p.accumulate_d_weight;
  if (d_hidden.defined()) f.d_hidden = d_hidden.data_ptr();
  if (d_weight.defined()) {
    f.d_weight = d_weight.data_ptr();
    f.d_weight_f32 = d_weight.dtype() == DType::F32;
  }
  return g;
}

void run(cuda::FusedLinearCrossEntropyParams& f, Device device) {
  cuda::pick_fused_linear_cross_entropy_chunks(f, kWorkspaceBound).apply_to(f);
  size_t bytes = cuda::fused_linear_cross_entropy_workspace_bytes(f);
  Tensor ws;
  {
    TagScope tag(MemoryTag::Workspace);
    ws = Tensor::empty({static_cast<int64_t>(bytes)}, DType::U8, device);
  }
  cuda::fused_linear_cross_entropy(f, ws.data_ptr(), bytes, cuda::cublaslt_handle(), cuda::current_stream());
  KESTREL_CUDA_CHECK_LAUNCH();
}

void forward_cuda(const Tensor& loss, const Tensor& lse, const Tensor& hidden, const Tensor& weight,
                  const Tensor& labels, const Tensor& token_weights, const kernels::CrossEntropyParams& p) {
  auto f = make_params(hidden, weight, labels, token_weights, p);
  f.loss = static_cast<float*>(loss.data_ptr());
  f.lse = static_cast<float*>(lse.data_ptr());
  run(f, hidden.device());
}

// The launcher's single pass (three GEMMs) with the upstream gradient as a device scalar: loss and
// both gradients; a bf16/f16 d_weight is added into by each token chunk's GEMM (one rounding per chunk).
void forward_backward_cuda(const Tensor& loss, const Tensor& d_hidden, const Tensor& d_weight,
                           const Tensor& grad_loss, const Tensor& hidden, const Tensor& weight, const Tensor& labels,
                           const Tensor& token_weights, const kernels::CrossEntropyParams& p) {
  auto f = make_params(hidden, weight, labels, token_weights, p);
  const Tensor g = set_gradients(f, d_hidden, d_weight, grad_loss, p);
  f.loss = static_cast<float*>(loss.data_ptr());
  run(f, hidden.device());
}

void backward_cuda(const Tensor& d_hidden, const Tensor& d_weight, const Tensor& grad_loss, const Tensor& hidden,
                   const Tensor& weight, const Tensor& labels, const Tensor& token_weights, const Tensor& lse,
                   const kernels::CrossEntropyParams& p) {
  auto f = make_params(hidden, weight, labels, token_weights, p);
  KESTREL_CHECK(lse.dtype() == DType::F32 && lse.numel() == hidden.shape()[0] && lse.is_contiguous(),
                "fused_linear_cross_entropy", "backward needs the forward's f32 lse [N], got ", lse.str());
  const Tensor g = set_gradients(f, d_hidden, d_weight, grad_loss, p);
  const size_t bytes = cuda::fused_linear_cross_entropy_backward_workspace_bytes(f);
  Tensor ws;
  {
    TagScope tag(MemoryTag::Workspace);
    ws = Tensor::empty({static_cast<int64_t>(bytes)}, DType::U8, hidden.device());
  }
  cuda::fused_linear_cross_entropy_backward(f, static_cast<const float*>(lse.data_ptr()), ws.data_ptr(), bytes,
                                            cuda::cublaslt_handle(), cuda::current_stream());
  KESTREL_CUDA_CHECK_LAUNCH();
}

}  // namespace

KESTREL_REGISTER_KERNEL(fused_linear_cross_entropy_forward, cuda, forward_cuda);
KESTREL_REGISTER_KERNEL(fused_linear_cross_entropy_backward, cuda, backward_cuda);
KESTREL_REGISTER_KERNEL(fused_linear_cross_entropy_forward_backward, cuda, forward_backward_cuda);

}  // namespace kestrel::cuda_ops
