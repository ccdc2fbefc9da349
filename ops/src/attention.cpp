// attention(): argument validation, output allocation, dispatch and the tape entry (outputs out and
// lse; lse is not differentiated: its gradient is ignored, as in the CUDA kernels).
#include "kestrel/ops/attention.h"

#include <cmath>
#include <string>
#include <vector>

#include "kernels/attention.h"
#include "kestrel/autograd/recompute.h"
#include "kestrel/autograd/tape.h"

namespace kestrel {
namespace ag = autograd;
namespace {

constexpr const char* kOp = "attention";

void check_cu_seqlens(const Tensor& cu, const char* name, const Tensor& q, int64_t total, int64_t max_seqlen) {
  KESTREL_CHECK(cu.defined(), kOp, name, " is undefined");
  KESTREL_CHECK(cu.dtype() == DType::I32 && cu.dim() == 1 && cu.numel() >= 1, kOp, name,
                " must be i32 [docs + 1], got ", cu.str());
  KESTREL_CHECK(cu.device() == q.device(), kOp, name, " must be on ", q.device().str(), ", got ", cu.str());
  if (!cu.device().is_cpu()) return;  // no device-to-host read: the CUDA kernels trust the offsets
  std::vector<int64_t> c = cu.to_int_vector();
  KESTREL_CHECK(c[0] == 0, kOp, name, "[0] must be 0, got ", c[0]);
  for (size_t i = 1; i < c.size(); ++i) {
    KESTREL_CHECK(c[i] >= c[i - 1], kOp, name, " must be non-decreasing, got ", c[i - 1], " then ", c[i],
                  " at position ", i);
    KESTREL_CHECK(c[i] - c[i - 1] <= max_seqlen, kOp, "document ", i - 1, " has length ", c[i] - c[i - 1],
                  " > max_seqlen ", max_seqlen, " (", name, ")");
  }
  KESTREL_CHECK(c.back() == total, kOp, name, " ends at ", c.back(), " but there are ", total, " tokens");
}

// prefix_len: i32 [docs] on q's device, causal only, no window; on the CPU each in [0, len_k].
void check_prefix_len(const AttentionOptions& options, const Tensor& cu_seqlens_k, const Tensor& q) {
  const Tensor& pl = options.prefix_len;
  KESTREL_CHECK(options.causal, kOp, "prefix_len (a prefix-LM mask) needs causal = true");
  KESTREL_CHECK(options.window <= 0, kOp, "prefix_len and a sliding window (", options.window,
                ") together are not implemented");
  KESTREL_CHECK(pl.dtype() == DType::I32 && pl.dim() == 1 && pl.numel() == cu_seqlens_k.numel() - 1, kOp,
                "prefix_len must be i32 [docs] = [", cu_seqlens_k.numel() - 1, "], got ", pl.str());
  KESTREL_CHECK(pl.device() == q.device(), kOp, "prefix_len must be on ", q.device().str(), ", got ", pl.str());
  if (!pl.device().is_cpu()) return;  // no device-to-host read; the kernels clamp to the document
  const std::vector<int64_t> c = cu_seqlens_k.to_int_vector(), v = pl.contiguous().to_int_vector();
  for (size_t d = 0; d < v.size(); ++d)
    KESTREL_CHECK(v[d] >= 0 && v[d] <= c[d + 1] - c[d], kOp, "prefix_len[", d, "] = ", v[d],
                  " must be in [0, len_k = ", c[d + 1] - c[d], "]");
}

// block_mask: causal = false, no window / prefix_len, one document spanning q and k (max_seqlen =
// the token counts), tensors of the documented dtypes and sizes on q's device, and built by
// make_block_mask: its validation record must still name these tensors. The contents were
// validated once there; nothing is re-read per call (the kernels trust the indices).
void check_block_mask(const AttentionOptions& options, const Tensor& q, const Tensor& k, const Tensor& cu_seqlens_q,
                      int64_t max_seqlen_q, int64_t max_seqlen_k) {
  const BlockMask& m = options.block_mask;
  KESTREL_CHECK(!options.causal, kOp, "block_mask combines with causal = false only (write causality into the mask)");
  KESTREL_CHECK(options.window <= 0, kOp, "block_mask and a sliding window (", options.window,
                ") together are not implemented");
  KESTREL_CHECK(!options.prefix_len.defined(), kOp, "block_mask and prefix_len together are not implemented");
  KESTREL_CHECK(cu_seqlens_q.numel() == 2, kOp, "block_mask describes one packed sequence (one document, "
                "cu_seqlens = [0, total]), got ", cu_seqlens_q.numel() - 1, " documents");
  KESTREL_CHECK(m.total_q == q.shape()[0] && m.total_k == k.shape()[0], kOp, "block_mask is ", m.total_q, " x ",
                m.total_k, " tokens, q/k hold ", q.shape()[0], " x ", k.shape()[0]);
  KESTREL_CHECK(max_seqlen_q == m.total_q && max_seqlen_k == m.total_k, kOp,
                "with block_mask max_seqlen_q/k must equal the token counts ", m.total_q, ", ", m.total_k, ", got ",
                max_seqlen_q, ", ", max_seqlen_k);
  const int64_t nnz = m.nnz(), partials = m.partials();
  auto check = [&](const Tensor& t, const char* name, const Shape& shape) {
    KESTREL_CHECK(t.defined() && t.dtype() == DType::I32 && t.shape() == shape && t.is_contiguous(), kOp,
                  "block_mask.", name, " must be contiguous i32 ", shape_str(shape), ", got ",
                  t.defined() ? t.str() : std::string("undefined"));
    KESTREL_CHECK(t.device() == q.device(), kOp, "block_mask.", name, " must be on ", q.device().str(), ", got ",
                  t.str(), " (move the mask with BlockMask::to)");
  };
  check(m.q_ptr, "q_ptr", {m.q_blocks() + 1});
  check(m.q_kblock, "q_kblock", {nnz});
  check(m.q_kind, "q_kind", {nnz});
  check(m.k_ptr, "k_ptr", {m.k_blocks() + 1});
  check(m.k_qblock, "k_qblock", {nnz});
  check(m.k_kind, "k_kind", {nnz});
  check(m.bits, "bits", {partials, BlockMask::kBlock, 4});
  check(m.bits_t, "bits_t", {partials, BlockMask::kBlock, 4});
  const std::string problem = m.validation_problem();
  KESTREL_CHECK(problem.empty(), kOp, "block_mask was not built by make_block_mask (or one of its tensors was "
                "replaced after building; here: ", problem, "): build it with make_block_mask / "
                "block_mask_from_predicate / block_mask_from_dense");
}

}  // namespace

const char* attention_backend_name(AttentionBackend b) {
  switch (b) {
    case AttentionBackend::Auto: return "auto";
    case AttentionBackend::Kestrel: return "kestrel";
    case AttentionBackend::Cudnn: return "cudnn";
  }
  return "?";
}

AttentionBackend parse_attention_backend(const std::string& value, const std::string& key) {
  for (AttentionBackend b : {AttentionBackend::Auto, AttentionBackend::Kestrel, AttentionBackend::Cudnn})
    if (value == attention_backend_name(b)) return b;
  throw make_error(kOp, key, " must be \"auto\", \"kestrel\" or \"cudnn\", got '", value, "'");
}

AttentionOutput attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& cu_seqlens_q,
                          const Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k,
                          const AttentionOptions& options) {
  KESTREL_CHECK(q.defined() && k.defined() && v.defined(), kOp, "undefined q, k or v");
  KESTREL_CHECK(q.dim() == 3, kOp, "q must be [total_q, Hq, D], got ", q.str());
  KESTREL_CHECK(k.dim() == 3, kOp, "k must be [total_k, Hkv, D], got ", k.str());
  KESTREL_CHECK(v.shape() == k.shape(), kOp, "v must match k ", k.str(), ", got ", v.str());
  KESTREL_CHECK(is_floating(q.dtype()), kOp, "expected a floating q, got ", q.str());
  KESTREL_CHECK(k.dtype() == q.dtype() && v.dtype() == q.dtype(), kOp, "q, k, v must share a dtype, got ", q.str(),
                ", ", k.str(), ", ", v.str());
  KESTREL_CHECK(k.device() == q.device() && v.device() == q.device(), kOp, "q, k, v must share a device, got ",
                q.str(), ", ", k.str(), ", ", v.str());
  int64_t Hq = q.shape()[1], Hkv = k.shape()[1], D = q.shape()[2];
  KESTREL_CHECK(k.shape()[2] == D, kOp, "head_dim of k (", k.shape()[2], ") differs from q (", D, ")");
  KESTREL_CHECK(Hkv > 0 && Hq % Hkv == 0, kOp, "query heads (", Hq, ") must be a multiple of KV heads (", Hkv, ")");
  KESTREL_CHECK(D > 0, kOp, "head_dim must be positive, got ", q.str());
  KESTREL_CHECK(max_seqlen_q >= 0 && max_seqlen_k >= 0, kOp, "max_seqlen must be >= 0, got ", max_seqlen_q, ", ",
                max_seqlen_k);
  check_cu_seqlens(cu_seqlens_q, "cu_seqlens_q", q, q.shape()[0], max_seqlen_q);
  check_cu_seqlens(cu_seqlens_k, "cu_seqlens_k", q, k.shape()[0], max_seqlen_k);
  KESTREL_CHECK(cu_seqlens_q.numel() == cu_seqlens_k.numel(), kOp, "cu_seqlens_q ", cu_seqlens_q.str(),
                " and cu_seqlens_k ", cu_seqlens_k.str(), " describe different numbers of documents");
  KESTREL_CHECK(options.softmax_scale >= 0, kOp, "softmax_scale must be >= 0 (0 = 1/sqrt(D)), got ",
                options.softmax_scale);
  KESTREL_CHECK(options.window <= 0 || options.causal, kOp, "a sliding window (", options.window,
                ") is implemented for causal attention only; pass causal = true or window = 0");
  if (options.prefix_len.defined()) check_prefix_len(options, cu_seqlens_k, q);
  if (options.block_mask.defined()) check_block_mask(options, q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k);
  KESTREL_CHECK(options.backend != AttentionBackend::Cudnn || q.device().is_cuda(), kOp,
                "backend cudnn (attention.backend) runs on CUDA devices only, q is on ", q.device().str());

  kernels::AttentionParams p;
  p.max_seqlen_q = max_seqlen_q;
  p.max_seqlen_k = max_seqlen_k;
  p.softmax_scale = options.softmax_scale > 0 ? options.softmax_scale : 1.0 / std::sqrt(static_cast<double>(D));
  p.causal = options.causal;
  // A window covering the longest key document is no window (and fits the kernels' int).
  p.window = options.window > 0 && options.window < max_seqlen_k ? options.window : 0;
  p.deterministic = options.deterministic;
  if (options.prefix_len.defined()) p.prefix_len = options.prefix_len.contiguous();
  p.block_mask = options.block_mask;
  p.backend = options.backend;

  Tensor qc = q.detach().contiguous(), kc = k.detach().contiguous(), vc = v.detach().contiguous();
  Tensor cq = cu_seqlens_q.contiguous(), ck = cu_seqlens_k.contiguous();
  AttentionOutput r;
  if (auto kept = ag::reuse_kept_outputs(kOp)) {
    // The backward re-run of a selective recompute region (kestrel/autograd/recompute.h): the
    // forward kept out and lse, so the kernel does not run again; the entry below saves them.
    const Shape lse_shape{q.shape()[0], Hq};
    KESTREL_CHECK(kept->size() == 2 && (*kept)[0].shape() == q.shape() && (*kept)[1].shape() == lse_shape, kOp,
                  "kept outputs do not match q ", q.str());
    r.out = (*kept)[0];
    r.lse = (*kept)[1];
  } else {
    r.out = Tensor::empty(q.shape(), q.dtype(), q.device());  // [total_q, Hq, D]
    r.lse = Tensor::empty({q.shape()[0], Hq}, DType::F32, q.device());  // [total_q, Hq]
    if (q.numel() > 0) kernels::dispatch(kernels::attention_forward, kOp, q.device(), r.out, r.lse, qc, kc, vc, cq, ck, p);
    ag::keep_outputs(kOp, {r.out, r.lse});
  }

  if (!ag::should_record({q, k, v})) return r;
  bool gq = q.requires_grad(), gk = k.requires_grad(), gv = v.requires_grad();
  Tensor so = r.out.detach(), sl = r.lse.detach();
  std::vector<Tensor> outs = {r.out, r.lse};
  ag::record(kOp, {q, k, v}, outs, [=](const std::vector<Tensor>& g) -> std::vector<Tensor> {
    Tensor dout = g[0].dtype() == qc.dtype() ? g[0].contiguous() : g[0].to(qc.dtype()).contiguous();
    Tensor dq = Tensor::empty(qc.shape(), qc.dtype(), qc.device());
    Tensor dk = Tensor::empty(kc.shape(), kc.dtype(), kc.device());
    Tensor dv = Tensor::empty(vc.shape(), vc.dtype(), vc.device());
    if (qc.numel() == 0 || kc.numel() == 0) {
      dq.zero_();
      dk.zero_();
      dv.zero_();
    } else {
      kernels::dispatch(kernels::attention_backward, "attention_backward", qc.device(), dq, dk, dv, dout, qc, kc, vc,
                        so, sl, cq, ck, p);
    }
    return {gq ? dq : Tensor(), gk ? dk : Tensor(), gv ? dv : Tensor()};
  });
  r.out = outs[0];
  r.lse = outs[1];
  return r;
}

Tensor attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& cu_seqlens, int64_t max_seqlen,
                 const AttentionOptions& options) {
  return attention(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, options).out;
}

}  // namespace kestrel
