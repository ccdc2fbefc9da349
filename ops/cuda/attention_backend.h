// Which attention implementation runs a CUDA call (AttentionBackend, kestrel/ops/attention.h):
// Kestrel's flash kernels (ops/cuda/flash_attention/) or cuDNN's fused flash attention
// (ops/cuda/cudnn_attention/). One place for what cuDNN can run, for the Auto rule, and for the
// cuDNN entry points the CUDA attention slots (attention.cu) call. Compiled in every CUDA build; the
// cuDNN entry points exist only where KESTREL_WITH_CUDNN is 1 (CMake found cuDNN 9).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kernels/attention.h"
#include "kestrel/runtime/tensor.h"

namespace kestrel::cuda_ops {

// Whether this library was built with the cuDNN backend.
bool cudnn_attention_built();

// Empty when cuDNN's backend can run this call on the current device, else why not ("head_dim 256
// (cuDNN backend: multiples of 8 up to 128)"). `backward`: the backward graph. Not checked (it would
// need the lengths on the host): a bidirectional document with queries but no keys, whose rows
// Kestrel's kernels define (out 0, lse -inf) and cuDNN's softmax does not.
std::string cudnn_attention_unsupported(const kernels::AttentionParams& p, const Tensor& q, const Tensor& k,
                                        const Tensor& cu_seqlens_q, const Tensor& cu_seqlens_k, bool backward);

// The choice for one call: true = cuDNN. Kestrel -> false; Cudnn -> true or kestrel::Error "[attention]
// backend cudnn (attention.backend) cannot run this call: <why>"; Auto -> cudnn_attention_preferred
// where cuDNN can run the call, else false.
bool use_cudnn_attention(const kernels::AttentionParams& p, const Tensor& q, const Tensor& k,
                         const Tensor& cu_seqlens_q, const Tensor& cu_seqlens_k, bool backward);

// The Auto rule for a call cuDNN can run (a function of the shape and the device only).
bool cudnn_attention_preferred(const kernels::AttentionParams& p, const Tensor& q, const Tensor& k, bool backward);

// Device memory the cuDNN backend's handle and loaded kernels took on `device` (the rise of External
// measured around cudnnCreate and each new plan's first run; 0 before first use or without cuDNN).
int64_t cudnn_attention_external_bytes(int device);

// How the cuDNN backend picks the execution plan it builds for a new shape bucket (forward and
// backward alike). Process-wide; a plan is cached per choice, so switching builds fresh plans.
// Fastest costs one host sync, up to kCudnnPlanCandidates finalisations and a few extra runs per
// bucket, once; timing noise may pick another engine in another process (results then differ in the
// last bits between runs); First does not. First is the default: on step-like document packs
// (BM_attention_backends_step_packs, 2026-12-02) Fastest kept the same engine or one within 1-3%
// (TFLOP/s equal to 0.1%), while each new bucket's plan build is what a short run pays.
enum class CudnnPlanChoice {
  First,    // the first engine config of heuristics mode A that finalises, untimed
  Fastest,  // up to kCudnnPlanCandidates configs (mode A, then FALLBACK), each run once and then timed
            // over kCudnnPlanTimedRuns runs on the building call's own buffers; the fastest is kept.
            // Candidates after the first whose workspace exceeds both the first's and
            // kCudnnPlanMaxWorkspace are not run (logged as skipped).
};
constexpr int kCudnnPlanCandidates = 8;
constexpr int kCudnnPlanTimedRuns = 3;
constexpr int64_t kCudnnPlanMaxWorkspace = int64_t{256} << 20;
void set_cudnn_plan_choice(CudnnPlanChoice choice);
CudnnPlanChoice cudnn_plan_choice();  // First unless set
const char* cudnn_plan_choice_name(CudnnPlanChoice choice);  // "first" / "fastest"

// One plan the cuDNN backend built: its bucket, the call that built it, every candidate considered.
struct CudnnPlanCandidate {
  int64_t engine = -1;          // CUDNN_ATTR_ENGINE_GLOBAL_INDEX (-1: cuDNN did not say)
  std::string knobs;            // knob choices "type=value ..." (cudnnBackendKnobType_t numbers)
  std::string heuristics;       // "A" or "fallback"
  int64_t workspace_bytes = 0;  // the plan's own workspace
  double ms = -1;  // mean of the timed runs; -1: not timed (First, a lone candidate, a captured stream);
                   // -2: failed to run; -3: skipped for its workspace
};
struct CudnnPlanRecord {
  bool backward = false;
  std::string dtype;                                      // "bf16" / "f16"
  int64_t b = 0, hq = 0, hkv = 0, d = 0, sq = 0, sk = 0;  // the bucket (B, S rounded up)
  bool causal = false;
  CudnnPlanChoice choice = CudnnPlanChoice::First;
  int64_t docs = 0, tokens_q = 0, max_seqlen_q = 0;  // the call that built the plan
  std::vector<CudnnPlanCandidate> candidates;        // in the heuristics' order
  int chosen = -1;                                   // index into candidates (-1: not chosen yet)
  double build_ms = 0;  // host time to build the graph and finalise its candidates (timing runs not included)
};

// The plans built on `device` so far, oldest first (empty before first use or without cuDNN).
std::vector<CudnnPlanRecord> cudnn_attention_plan_log(int device);
// One line per record, e.g. "bwd bf16 B 2 Hq 32 Hkv 8 D 64 S 6144/6144 causal fastest (docs 2, 8192
// tokens, max 6000; built in 41.2 ms): engine 8 [24=3 40=128] A ws 4096 1.234 ms *, engine 8 [24=1 40=64] A ws 0
// 1.502 ms, ..." (knobs in brackets, the proposing heuristics, workspace bytes; the chosen starred).
std::string format_cudnn_plan_log(const std::vector<CudnnPlanRecord>& log);

#if KESTREL_WITH_CUDNN
// The cuDNN slots: same contracts as kernels::AttentionForwardFn / AttentionBackwardFn (contiguous
// tensors, cu_seqlens i32 on the device), for calls cudnn_attention_unsupported accepts.
void cudnn_attention_forward(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k, const Tensor& v,
                             const Tensor& cu_seqlens_q, const Tensor& cu_seqlens_k, const kernels::AttentionParams& p);
void cudnn_attention_backward(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dout,
                              const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                              const Tensor& cu_seqlens_q, const Tensor& cu_seqlens_k,
                              const kernels::AttentionParams& p);
#endif

}  // namespace kestrel::cuda_ops
