// The SDPA forward / backward graphs (graphs.h). Each step names the cudnn-frontend lowering it
// mirrors (node/scaled_dot_product_flash_attention.h, node/softmax.h, utils/attn_score_modifiers.h,
// node/diagonal_band_mask.h): the fused engine matches this pattern, tensor types included
// (intermediates f32, masks i32 / bool, P and dS^T in the io type before their GEMMs).
#include "cuda/cudnn_attention/graphs.h"

namespace kestrel::cuda_ops::cudnn {
namespace {

struct Layouts {
  Dims q_dim, q_stride;      // q, out, dout, dq (and dq's f32 accumulator)
  Dims kt_dim, kt_stride;    // k and v read transposed ([B, Hkv, D, S_k])
  Dims k_dim, k_stride;      // k, v, dk, dv
  Dims kfull_dim, kfull_stride;  // GQA: dk / dv per query head before the group reduction
  Dims stats_dim, stats_stride;
  Dims score_dim, score_stride;    // [B, Hq, S_q, S_k]
  Dims scoret_dim, scoret_stride;  // the same memory read as [B, Hq, S_k, S_q]
  Dims row_dim, row_stride;        // [B, Hq, S_q, 1]
};

Layouts layouts(const GraphShape& s) {
  const int64_t B = s.b, Hq = s.hq, Hkv = s.hkv, D = s.d, Sq = s.sq, Sk = s.sk;
  Layouts l;
  l.q_dim = {B, Hq, Sq, D};
  l.q_stride = {Sq * Hq * D, D, Hq * D, 1};
  l.kt_dim = {B, Hkv, D, Sk};
  l.kt_stride = {Sk * Hkv * D, D, 1, Hkv * D};
  l.k_dim = {B, Hkv, Sk, D};
  l.k_stride = {Sk * Hkv * D, D, Hkv * D, 1};
  l.kfull_dim = {B, Hq, Sk, D};
  l.kfull_stride = {Sk * Hq * D, D, Hq * D, 1};
  l.stats_dim = {B, Hq, Sq, 1};
  l.stats_stride = {Sq * Hq, 1, Hq, 1};
  l.score_dim = {B, Hq, Sq, Sk};
  l.score_stride = {Hq * Sq * Sk, Sq * Sk, Sk, 1};
  l.scoret_dim = {B, Hq, Sk, Sq};
  l.scoret_stride = {Hq * Sq * Sk, Sq * Sk, 1, Sk};
  l.row_dim = {B, Hq, Sq, 1};
  l.row_stride = {Hq * Sq, Sq, 1, 1};
  return l;
}

// The inputs both graphs share: per-document lengths, ragged offsets, scalars.
struct Common {
  T seq_q, seq_kv, off_q, off_k, off_v, off_o, off_stats, scale, neg_inf;
};

Common common(GraphBuilder& g, const GraphShape& s) {
  const Dims seq_dim{s.b, 1, 1, 1}, off_dim{s.b + 1, 1, 1, 1}, ones{1, 1, 1, 1};
  Common c;
  c.seq_q = g.tensor(kSeqQ, seq_dim, ones, CUDNN_DATA_INT32);
  c.seq_kv = g.tensor(kSeqKV, seq_dim, ones, CUDNN_DATA_INT32);
  c.off_q = g.tensor(kOffQ, off_dim, ones, CUDNN_DATA_INT64);
  c.off_k = g.tensor(kOffK, off_dim, ones, CUDNN_DATA_INT64);
  c.off_v = g.tensor(kOffV, off_dim, ones, CUDNN_DATA_INT64);
  c.off_o = g.tensor(kOffO, off_dim, ones, CUDNN_DATA_INT64);
  c.off_stats = g.tensor(kOffStats, off_dim, ones, CUDNN_DATA_INT64);
  c.scale = g.scalar(kScale);
  c.neg_inf = g.scalar(kNegInf);
  return c;
}

// attn_score_modifiers.h padding_mask: keep (row < seq_len_q && col < seq_len_kv), else -inf.
T padding_mask(GraphBuilder& g, const Layouts& l, const Common& c, T s) {
  const Dims &d = l.score_dim, &st = l.score_stride;
  T row = g.pointwise(CUDNN_POINTWISE_GEN_INDEX, s, nullptr, nullptr, g.virt(d, st, CUDNN_DATA_INT32), CUDNN_DATA_INT32, 2);
  T col = g.pointwise(CUDNN_POINTWISE_GEN_INDEX, s, nullptr, nullptr, g.virt(d, st, CUDNN_DATA_INT32), CUDNN_DATA_INT32, 3);
  T row_ok = g.pointwise(CUDNN_POINTWISE_CMP_LT, row, c.seq_q, nullptr, g.virt(d, st, CUDNN_DATA_BOOLEAN),
                         CUDNN_DATA_BOOLEAN);
  T col_ok = g.pointwise(CUDNN_POINTWISE_CMP_LT, col, c.seq_kv, nullptr, g.virt(d, st, CUDNN_DATA_BOOLEAN),
                         CUDNN_DATA_BOOLEAN);
  T keep = g.pointwise(CUDNN_POINTWISE_LOGICAL_AND, row_ok, col_ok, nullptr, g.virt(d, st, CUDNN_DATA_BOOLEAN),
                       CUDNN_DATA_BOOLEAN);
  return g.pointwise(CUDNN_POINTWISE_BINARY_SELECT, s, c.neg_inf, keep, g.virt(d, st, CUDNN_DATA_FLOAT), CUDNN_DATA_FLOAT);
}

// diagonal_band_mask.h with a right bound of 0, top-left aligned: keep row >= col, else -inf.
T causal_mask(GraphBuilder& g, const Layouts& l, const Common& c, T s) {
  const Dims &d = l.score_dim, &st = l.score_stride;
  T row = g.pointwise(CUDNN_POINTWISE_GEN_INDEX, s, nullptr, nullptr, g.virt(d, st, CUDNN_DATA_INT32), CUDNN_DATA_FLOAT, 2);
  T col = g.pointwise(CUDNN_POINTWISE_GEN_INDEX, s, nullptr, nullptr, g.virt(d, st, CUDNN_DATA_INT32), CUDNN_DATA_FLOAT, 3);
  T keep = g.pointwise(CUDNN_POINTWISE_CMP_GE, row, col, nullptr, g.virt(d, st, CUDNN_DATA_BOOLEAN), CUDNN_DATA_BOOLEAN);
  return g.pointwise(CUDNN_POINTWISE_BINARY_SELECT, s, c.neg_inf, keep, g.virt(d, st, CUDNN_DATA_FLOAT), CUDNN_DATA_FLOAT);
}

T binary(GraphBuilder& g, cudnnPointwiseMode_t mode, T a, T b, const Dims& dim, const Dims& stride,
         cudnnDataType_t out = CUDNN_DATA_FLOAT) {
  return g.pointwise(mode, a, b, nullptr, g.virt(dim, stride, out), CUDNN_DATA_FLOAT);
}

// A key-side gradient (dK = dS^T Q, dV = P^T dO; m = seq_len_kv, k = seq_len_q): MHA writes the
// matmul straight into `grad`; GQA writes a full-head tensor (uid full_uid, in the workspace) and
// sums it over each group of query heads into `grad`.
void key_gradient(GraphBuilder& g, const GraphShape& s, const Layouts& l, const Common& c, T a_t, T b, T grad,
                  int64_t full_uid, T ragged) {
  if (s.hq == s.hkv) {
    g.matmul(a_t, b, grad, c.seq_kv, nullptr, c.seq_q);
    return;
  }
  T full = g.tensor(full_uid, l.kfull_dim, l.kfull_stride, s.io, ragged);
  g.matmul(a_t, b, full, c.seq_kv, nullptr, c.seq_q);
  g.reduction(CUDNN_REDUCE_TENSOR_ADD, full, grad);
}

}  // namespace

BuiltGraph build_forward_graph(cudnnHandle_t handle, const GraphShape& s, int max_plans) {
  BuiltGraph r;
  r.builder = std::make_unique<GraphBuilder>();
  GraphBuilder& g = *r.builder;
  const Layouts l = layouts(s);
  const Common c = common(g, s);
  T q = g.tensor(kQ, l.q_dim, l.q_stride, s.io, c.off_q);
  T kt = g.tensor(kK, l.kt_dim, l.kt_stride, s.io, c.off_k);
  T v = g.tensor(kV, l.k_dim, l.k_stride, s.io, c.off_v);
  T o = g.tensor(kO, l.q_dim, l.q_stride, s.io, c.off_o);
  T stats = g.tensor(kStats, l.stats_dim, l.stats_stride, CUDNN_DATA_FLOAT, c.off_stats);

  // bmm1: S = Q K^T over each document's extents (m/n overrides), padded with 0; then the scale.
  T sc = g.matmul(q, kt, g.virt(l.score_dim, l.score_stride, CUDNN_DATA_FLOAT), c.seq_q, c.seq_kv, nullptr,
                  /*pad_zero=*/true);
  sc = binary(g, CUDNN_POINTWISE_MUL, sc, c.scale, l.score_dim, l.score_stride);
  sc = padding_mask(g, l, c, sc);
  if (s.causal) sc = causal_mask(g, l, c, sc);
  // softmax.h's composite softmax with stats: M = max, E = exp(S - M), Z = sum E, stats = M + ln Z, P = E / Z.
  T m = g.reduction(CUDNN_REDUCE_TENSOR_MAX, sc, g.virt(l.row_dim, l.row_stride, CUDNN_DATA_FLOAT));
  T e = binary(g, CUDNN_POINTWISE_SUB, sc, m, l.score_dim, l.score_stride);
  e = g.pointwise(CUDNN_POINTWISE_EXP, e, nullptr, nullptr, g.virt(l.score_dim, l.score_stride, CUDNN_DATA_FLOAT),
                  CUDNN_DATA_FLOAT);
  T z = g.reduction(CUDNN_REDUCE_TENSOR_ADD, e, g.virt(l.row_dim, l.row_stride, CUDNN_DATA_FLOAT));
  T lz = g.pointwise(CUDNN_POINTWISE_LOG, z, nullptr, nullptr, g.virt(l.row_dim, l.row_stride, CUDNN_DATA_FLOAT),
                     CUDNN_DATA_FLOAT);
  g.pointwise(CUDNN_POINTWISE_ADD, m, lz, nullptr, stats, CUDNN_DATA_FLOAT);
  T p = binary(g, CUDNN_POINTWISE_DIV, e, z, l.score_dim, l.score_stride, s.io);  // bmm2's A in the io type
  // bmm2: O = P V (m = seq_len_q, k = seq_len_kv).
  g.matmul(p, v, o, c.seq_q, nullptr, c.seq_kv);
  r.plans = g.build_plans(handle, "SDPA forward", max_plans);
  return r;
}

BuiltGraph build_backward_graph(cudnnHandle_t handle, const GraphShape& s, int max_plans) {
  BuiltGraph r;
  r.builder = std::make_unique<GraphBuilder>();
  GraphBuilder& g = *r.builder;
  const Layouts l = layouts(s);
  const Common c = common(g, s);
  T q = g.tensor(kQ, l.q_dim, l.q_stride, s.io, c.off_q);
  T kt = g.tensor(kK, l.kt_dim, l.kt_stride, s.io, c.off_k);
  T vt = g.tensor(kV, l.kt_dim, l.kt_stride, s.io, c.off_v);
  T o = g.tensor(kO, l.q_dim, l.q_stride, s.io, c.off_o);
  T dout = g.tensor(kDO, l.q_dim, l.q_stride, s.io, c.off_o);
  T stats = g.tensor(kStats, l.stats_dim, l.stats_stride, CUDNN_DATA_FLOAT, c.off_stats);
  T dq = g.tensor(kDQ, l.q_dim, l.q_stride, s.io, c.off_q);
  T dk = g.tensor(kDK, l.k_dim, l.k_stride, s.io, c.off_k);
  T dv = g.tensor(kDV, l.k_dim, l.k_stride, s.io, c.off_v);
  T one = g.scalar(kOne);

  // softmax_sum = rowsum(dO * O) (delta), in the workspace with the stats' ragged layout.
  T t = binary(g, CUDNN_POINTWISE_MUL, dout, o, l.q_dim, {s.hq * s.sq * s.d, s.sq * s.d, s.hq * s.d, 1});
  t = g.reduction(CUDNN_REDUCE_TENSOR_ADD, t, g.virt(l.row_dim, l.row_stride, CUDNN_DATA_FLOAT));
  T softmax_sum = g.tensor(kSoftmaxSum, l.stats_dim, l.stats_stride, CUDNN_DATA_FLOAT, c.off_stats);
  g.pointwise(CUDNN_POINTWISE_MUL, t, one, nullptr, softmax_sum, CUDNN_DATA_FLOAT);

  // P = exp(scale * Q K^T (masked) - stats).
  T sc = g.matmul(q, kt, g.virt(l.score_dim, l.score_stride, CUDNN_DATA_FLOAT), c.seq_q, c.seq_kv, nullptr);
  sc = binary(g, CUDNN_POINTWISE_MUL, sc, c.scale, l.score_dim, l.score_stride);
  sc = padding_mask(g, l, c, sc);
  sc = binary(g, CUDNN_POINTWISE_SUB, sc, stats, l.score_dim, l.score_stride);
  if (s.causal) sc = causal_mask(g, l, c, sc);
  T p = g.pointwise(CUDNN_POINTWISE_EXP, sc, nullptr, nullptr, g.virt(l.score_dim, l.score_stride, CUDNN_DATA_FLOAT),
                    CUDNN_DATA_FLOAT);

  // dV = P^T dO (GQA: per query head, then summed over each group).
  T pt = g.reshape(p, g.virt(l.scoret_dim, l.scoret_stride, s.io));
  key_gradient(g, s, l, c, pt, dout, dv, kDVFull, c.off_v);

  // dS = scale * P * (dO V^T - softmax_sum).
  T ds = g.matmul(dout, vt, g.virt(l.score_dim, l.score_stride, CUDNN_DATA_FLOAT), c.seq_q, c.seq_kv, nullptr);
  ds = binary(g, CUDNN_POINTWISE_SUB, ds, softmax_sum, l.score_dim, l.score_stride);
  ds = binary(g, CUDNN_POINTWISE_MUL, ds, p, l.score_dim, l.score_stride);
  ds = binary(g, CUDNN_POINTWISE_MUL, ds, c.scale, l.score_dim, l.score_stride);

  // dK = dS^T Q (GQA as dV).
  T dst = g.reshape(ds, g.virt(l.scoret_dim, l.scoret_stride, s.io));
  key_gradient(g, s, l, c, dst, q, dk, kDKFull, c.off_k);

  // dQ = dS K into an f32 accumulator (packed like dq, in the workspace), then cast.
  T k = g.reshape(kt, g.virt(l.k_dim, l.k_stride, s.io, c.off_k));
  T dq_accum = g.tensor(kDQAccum, l.q_dim, l.q_stride, CUDNN_DATA_FLOAT, c.off_q);
  g.matmul(ds, k, dq_accum, c.seq_q, nullptr, c.seq_kv);
  g.pointwise(CUDNN_POINTWISE_IDENTITY, dq_accum, nullptr, nullptr, dq, CUDNN_DATA_FLOAT);

  r.plans = g.build_plans(handle, "SDPA backward", max_plans);
  return r;
}

}  // namespace kestrel::cuda_ops::cudnn
