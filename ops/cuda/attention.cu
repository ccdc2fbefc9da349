// CUDA attention slots (kernels/attention.h) over the flash-attention launchers in
// cuda/flash_attention/flash_attention.h: bf16/f16 only (f32 attention on CUDA is an error naming the op), the
// backward workspace allocated with Tensor::empty under a Workspace tag. Each call first asks
// use_cudnn_attention (attention_backend.h) whether cuDNN's fused attention runs it instead.
#include "cuda/attention_backend.h"
#include "cuda/common.cuh"
#include "cuda/flash_attention/flash_attention.h"
#include "kernels/attention.h"
#include "kestrel/runtime/memory.h"

namespace kestrel::cuda_ops {
namespace {

cuda::FlashAttentionParams make_params(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k,
                                       const Tensor& v, const Tensor& cq, const Tensor& ck,
                                       const kernels::AttentionParams& p, cuda::FlashBlockMask& mask_storage) {
  KESTREL_CHECK(q.dtype() == DType::BF16 || q.dtype() == DType::F16, "attention",
                "CUDA attention runs in bf16 or f16, got ", dtype_name(q.dtype()), " (cast q, k, v first)");
  KESTREL_CHECK(cq.dtype() == DType::I32 && ck.dtype() == DType::I32, "attention", "cu_seqlens must be i32");
  cuda::FlashAttentionParams f{};
  f.q = q.data_ptr();
  f.k = k.data_ptr();
  f.v = v.data_ptr();
  f.out = out.data_ptr();
  f.lse = static_cast<float*>(lse.data_ptr());
  f.cu_seqlens_q = static_cast<const int32_t*>(cq.data_ptr());
  f.cu_seqlens_k = static_cast<const int32_t*>(ck.data_ptr());
  f.num_docs = static_cast<int>(cq.numel() - 1);
  f.max_seqlen_q = static_cast<int>(p.max_seqlen_q);
  f.max_seqlen_k = static_cast<int>(p.max_seqlen_k);
  f.num_heads_q = static_cast<int>(q.shape()[1]);
  f.num_heads_kv = static_cast<int>(k.shape()[1]);
  f.head_dim = static_cast<int>(q.shape()[2]);
  f.softmax_scale = static_cast<float>(p.softmax_scale);
  f.causal = p.causal;
  f.window = static_cast<int>(p.window);  // 0 = none; the op layer clamps it to the longest key document
  f.dtype = q.dtype() == DType::BF16 ? cuda::AttnDType::BF16 : cuda::AttnDType::F16;
  f.total_q = static_cast<int>(q.shape()[0]);
  f.total_k = static_cast<int>(k.shape()[0]);
  f.deterministic = p.deterministic;
  // i32 [docs] on q's device, checked by the op layer (src/attention.cpp)
  if (p.prefix_len.defined()) f.prefix_len = static_cast<const int32_t*>(p.prefix_len.data_ptr());
  if (p.block_mask.defined()) {  // on q's device, shapes checked by the op layer (src/attention.cpp)
    const BlockMask& m = p.block_mask;
    auto i32 = [](const Tensor& t) { return static_cast<const int32_t*>(t.data_ptr()); };
    auto u32 = [](const Tensor& t) { return static_cast<const uint32_t*>(t.data_ptr()); };
    // An empty list or no PARTIAL tile still needs non-null arrays (they are never read then).
    const int32_t* ptr = i32(m.q_ptr);
    cuda::FlashBlockMask& b = mask_storage;  // outlives the launch: the caller's
    b.q_ptr = ptr;
    b.q_kblock = m.nnz() > 0 ? i32(m.q_kblock) : ptr;
    b.q_kind = m.nnz() > 0 ? i32(m.q_kind) : ptr;
    b.k_ptr = i32(m.k_ptr);
    b.k_qblock = m.nnz() > 0 ? i32(m.k_qblock) : ptr;
    b.k_kind = m.nnz() > 0 ? i32(m.k_kind) : ptr;
    b.bits = m.partials() > 0 ? u32(m.bits) : reinterpret_cast<const uint32_t*>(ptr);
    b.bits_t = m.partials() > 0 ? u32(m.bits_t) : reinterpret_cast<const uint32_t*>(ptr);
    f.block_mask = &b;
  }
  return f;
}

void attention_forward_cuda(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k, const Tensor& v,
                            const Tensor& cq, const Tensor& ck, const kernels::AttentionParams& p) {
  if (use_cudnn_attention(p, q, k, cq, ck, /*backward=*/false)) {
#if KESTREL_WITH_CUDNN
    cudnn_attention_forward(out, lse, q, k, v, cq, ck, p);
#endif
    return;
  }
  cuda::FlashBlockMask mask;
  cuda::flash_attention_forward(make_params(out, lse, q, k, v, cq, ck, p, mask), cuda::current_stream());
  KESTREL_CUDA_CHECK_LAUNCH();
}

void attention_backward_cuda(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dout, const Tensor& q,
                             const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse, const Tensor& cq,
                             const Tensor& ck, const kernels::AttentionParams& p) {
  if (use_cudnn_attention(p, q, k, cq, ck, /*backward=*/true)) {
#if KESTREL_WITH_CUDNN
    cudnn_attention_backward(dq, dk, dv, dout, q, k, v, out, lse, cq, ck, p);
#endif
    return;
  }
  cuda::FlashAttentionBackwardParams b{};
  cuda::FlashBlockMask mask;
  b.fwd = make_params(out, lse, q, k, v, cq, ck, p, mask);
  b.dout = dout.data_ptr();
  b.dq = dq.data_ptr();
  b.dk = dk.data_ptr();
  b.dv = dv.data_ptr();
  size_t bytes = cuda::flash_attention_backward_workspace_bytes(b.fwd);
  Tensor ws;
  {
    TagScope tag(MemoryTag::Workspace);
    ws = Tensor::empty({static_cast<int64_t>(bytes)}, DType::U8, q.device());
  }
  b.workspace = ws.data_ptr();
  b.workspace_bytes = bytes;
  cuda::flash_attention_backward(b, cuda::current_stream());
  KESTREL_CUDA_CHECK_LAUNCH();
}

}  // namespace

KESTREL_REGISTER_KERNEL(attention_forward, cuda, attention_forward_cuda);
KESTREL_REGISTER_KERNEL(attention_backward, cuda, attention_backward_cuda);

}  // namespace kestrel::cuda_ops
