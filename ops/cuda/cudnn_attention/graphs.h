// The SDPA forward and backward operation graphs in the pattern cuDNN's fused flash-attention
// engine recognises (the composite graph cudnn-frontend's sdpa / sdpa_backward nodes lower to for
// cuDNN < 9.21), over packed (THD) tensors with ragged offsets. Layouts (elements):
//   q, out, dout, dq [B, Hq, S_q, D]   strides [*, D, Hq * D, 1], ragged offset cu_seqlens_q * Hq * D
//   k, v, dk, dv     [B, Hkv, S_k, D]  strides [*, D, Hkv * D, 1], ragged offset cu_seqlens_k * Hkv * D
//   stats (lse)      [B, Hq, S_q, 1]   strides [*, 1, Hq, 1], ragged offset cu_seqlens_q * Hq: exactly
//                    Kestrel's lse [total_q, Hq] (natural-log log-sum-exp of the scaled scores)
//   seq_len_q/kv     i32 [B, 1, 1, 1] (per-document lengths: the padding mask and GEMM extents)
// B and S are the plan's (bucketed) sizes: documents past the real ones have length 0, S bounds the
// longest document. The causal mask is top-left aligned (row >= col), which is Kestrel's rule when
// queries and keys are the same documents (attention_backend.cpp refuses anything else).
#pragma once

#include <cudnn_graph.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "cuda/cudnn_attention/backend.h"

namespace kestrel::cuda_ops::cudnn {

// Variant-pack uids of the graphs' non-virtual tensors.
enum Uid : int64_t {
  kQ = 1, kK, kV, kO, kStats, kDO, kDQ, kDK, kDV,
  kSeqQ, kSeqKV, kOffQ, kOffK, kOffV, kOffO, kOffStats,
  kScale, kNegInf, kOne,
  kSoftmaxSum, kDQAccum, kDKFull, kDVFull,  // backward scratch in the workspace (f32 / io type)
};

struct GraphShape {
  cudnnDataType_t io = CUDNN_DATA_BFLOAT16;
  int64_t b = 0, hq = 0, hkv = 0, d = 0, sq = 0, sk = 0;
  bool causal = true;
};

struct BuiltGraph {
  std::unique_ptr<GraphBuilder> builder;  // keeps every descriptor the plans were built from alive
  std::vector<PlanCandidate> plans;       // GraphBuilder::build_plans; the caller keeps the one it runs
};

// max_plans: how many finalised plans to return (GraphBuilder::build_plans).
BuiltGraph build_forward_graph(cudnnHandle_t handle, const GraphShape& s, int max_plans);
// GQA (hq != hkv) adds the full-head dK / dV scratch (kDKFull / kDVFull), reduced over each group.
BuiltGraph build_backward_graph(cudnnHandle_t handle, const GraphShape& s, int max_plans);

}  // namespace kestrel::cuda_ops::cudnn
