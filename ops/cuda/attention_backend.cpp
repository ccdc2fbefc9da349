// The attention backend choice (attention_backend.h): what cuDNN's fused flash attention can run
// and the Auto rule.
#include "cuda/attention_backend.h"

#include <atomic>
#include <cstdint>
#include <sstream>

#include "cuda/flash_attention/heuristics.h"
#include "kestrel/runtime/error.h"

namespace kestrel::cuda_ops {

bool cudnn_attention_built() { return KESTREL_WITH_CUDNN != 0; }

std::string cudnn_attention_unsupported(const kernels::AttentionParams& p, const Tensor& q, const Tensor& k,
                                        const Tensor& cu_seqlens_q, const Tensor& cu_seqlens_k, bool backward) {
  std::ostringstream why;
  if (!cudnn_attention_built()) return "Kestrel was built without cuDNN (cudnn_graph.h / libcudnn 9 not found by CMake)";
  if (q.dtype() != DType::BF16 && q.dtype() != DType::F16) {
    why << "dtype " << dtype_name(q.dtype()) << " (cuDNN backend: bf16 or f16)";
    return why.str();
  }
  const int64_t D = q.shape()[2];
  if (D % 8 != 0 || D > 128) {
    why << "head_dim " << D << " (cuDNN backend: multiples of 8 up to 128)";
    return why.str();
  }
  if (p.window > 0) {
    why << "sliding window " << p.window << " (not implemented by the cuDNN backend)";
    return why.str();
  }
  if (p.prefix_len.defined()) return "prefix_len (a prefix-LM mask is not implemented by the cuDNN backend)";
  if (p.block_mask.defined()) return "block_mask (not implemented by the cuDNN backend)";
  if (p.deterministic)
    return backward ? "deterministic (the cuDNN backend's backward adds dq by atomics)"
                    : "deterministic (the cuDNN backend's backward adds dq by atomics; the forward refuses too so a "
                      "run fails before its first step)";
  // The graph's causal mask is top-left aligned per document (query row i sees keys j <= i): equal to
  // Kestrel's bottom-right alignment only when queries and keys are the same documents.
  if (p.causal && (cu_seqlens_q.data_ptr() != cu_seqlens_k.data_ptr() || q.shape()[0] != k.shape()[0] ||
                   p.max_seqlen_q != p.max_seqlen_k))
    return "causal attention with separate cu_seqlens_q / cu_seqlens_k (the cuDNN backend needs self-attention: one "
           "cu_seqlens tensor for queries and keys)";
  if (cu_seqlens_q.numel() < 2) return "no documents";
  const cuda::fa::DeviceProps dev = cuda::fa::current_device_props();
  if (dev.cc_major != 9) {
    why << "device sm_" << dev.cc_major << dev.cc_minor << " (the cuDNN backend is enabled on sm_90)";
    return why.str();
  }
  return {};
}

bool cudnn_attention_preferred(const kernels::AttentionParams& p, const Tensor& q, const Tensor& k, bool backward) {
  // Measured on the H200 (bench/RESULTS.md, "cuDNN as a second attention backend"): alone, cuDNN's
  // fused attention is ahead at head dim 128 (8k causal fwd+bwd 484 vs 402 TFLOP/s, GQA 32/8 484 vs
  // 412, a long-tailed document mix 367-377 vs 319-330) and level at head dim 64. Inside the 1.5B
  // training step, though, the op profile put 16 cuDNN attention forwards at 71.7 ms (Kestrel 5.9 ms)
  // and the backwards at 46.5 ms (13.7 ms) on most batches (on some it ran at Kestrel's speed): the
  // step fell from ~56k to ~34k tok/s, and the 9B step (head dim 128) from 10.8k to 10.4k. Until that
  // is understood, Auto keeps Kestrel's kernels everywhere; attention.backend "cudnn" runs cuDNN.
  (void)p;
  (void)q;
  (void)k;
  (void)backward;
  return false;
}

bool use_cudnn_attention(const kernels::AttentionParams& p, const Tensor& q, const Tensor& k,
                         const Tensor& cu_seqlens_q, const Tensor& cu_seqlens_k, bool backward) {
  if (p.backend == AttentionBackend::Kestrel) return false;
  if (p.backend == AttentionBackend::Cudnn) {
    const std::string why = cudnn_attention_unsupported(p, q, k, cu_seqlens_q, cu_seqlens_k, backward);
    KESTREL_CHECK(why.empty(), "attention", "backend cudnn (attention.backend) cannot run this ",
                  backward ? "backward" : "forward", ": ", why, "; use backend kestrel or auto");
    return true;
  }
  // Auto: the rule first (a function of the shape and device), the reasons only where it says cuDNN.
  return cudnn_attention_preferred(p, q, k, backward) &&
         cudnn_attention_unsupported(p, q, k, cu_seqlens_q, cu_seqlens_k, backward).empty();
}

namespace {
std::atomic<CudnnPlanChoice> g_plan_choice{CudnnPlanChoice::First};
}  // namespace

void set_cudnn_plan_choice(CudnnPlanChoice choice) { g_plan_choice.store(choice); }
CudnnPlanChoice cudnn_plan_choice() { return g_plan_choice.load(); }
const char* cudnn_plan_choice_name(CudnnPlanChoice choice) {
  return choice == CudnnPlanChoice::First ? "first" : "fastest";
}

std::string format_cudnn_plan_log(const std::vector<CudnnPlanRecord>& log) {
  std::ostringstream o;
  o.setf(std::ios::fixed);
  o.precision(3);
  for (const CudnnPlanRecord& r : log) {
    o << (r.backward ? "bwd " : "fwd ") << r.dtype << " B " << r.b << " Hq " << r.hq << " Hkv " << r.hkv << " D "
      << r.d << " S " << r.sq << "/" << r.sk << (r.causal ? " causal " : " bidir ")
      << cudnn_plan_choice_name(r.choice) << " (docs " << r.docs << ", " << r.tokens_q << " tokens, max "
      << r.max_seqlen_q << "; built in " << r.build_ms << " ms):";
    for (size_t i = 0; i < r.candidates.size(); ++i) {
      const CudnnPlanCandidate& c = r.candidates[i];
      o << (i ? ", " : " ") << "engine " << c.engine << " [" << c.knobs << "] " << c.heuristics << " ws "
        << c.workspace_bytes << " ";
      if (c.ms >= 0) o << c.ms << " ms";
      else o << (c.ms == -2 ? "failed" : c.ms == -3 ? "skipped (workspace)" : "untimed");
      if (static_cast<int>(i) == r.chosen) o << " *";
    }
    o << "\n";
  }
  return o.str();
}

#if !KESTREL_WITH_CUDNN
int64_t cudnn_attention_external_bytes(int) { return 0; }
std::vector<CudnnPlanRecord> cudnn_attention_plan_log(int) { return {}; }
#endif

}  // namespace kestrel::cuda_ops
