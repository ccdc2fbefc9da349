// Cross-entropy losses: validation, chunk-size policy, dispatch and the tape entry of the fused
// linear + cross-entropy, and cross_entropy() from materialised logits composed of ordinary ops
// (the oracle the fused op is tested against).
#include "kestrel/ops/cross_entropy.h"

#include <algorithm>
#include <vector>

#include "kernels/cross_entropy.h"
#include "kestrel/autograd/tape.h"
#include "kestrel/ops/elementwise.h"
#include "kestrel/ops/reduce.h"
#include "kestrel/ops/shape.h"
#include "kestrel/ops/softmax.h"
#include "kestrel/runtime/memory.h"

namespace kestrel {
namespace ag = autograd;
namespace {

constexpr const char* kFused = "fused_linear_cross_entropy";

void check_options(const CrossEntropyOptions& o, const char* op) {
  KESTREL_CHECK(o.label_smoothing >= 0 && o.label_smoothing <= 1, op, "label_smoothing must be in [0, 1], got ",
                o.label_smoothing);
  KESTREL_CHECK(o.z_loss >= 0, op, "z_loss must be >= 0, got ", o.z_loss);
  KESTREL_CHECK(o.chunk_tokens >= 0 && o.chunk_vocab >= 0, op, "chunk sizes must be >= 0, got ", o.chunk_tokens,
                " and ", o.chunk_vocab);
}

// labels [N] i32/i64 -> contiguous i64; on the CPU every label must be ignore_index or in [0, V).
Tensor check_labels(const Tensor& labels, int64_t N, int64_t V, int64_t ignore_index, const char* op) {
  KESTREL_CHECK(labels.defined(), op, "labels are undefined");
  KESTREL_CHECK(labels.dim() == 1 && labels.shape()[0] == N, op, "labels must be [", N, "], got ", labels.str());
  KESTREL_CHECK(labels.dtype() == DType::I64 || labels.dtype() == DType::I32, op, "labels must be i64 or i32, got ",
                labels.str());
  Tensor l = labels.dtype() == DType::I64 ? labels.contiguous() : labels.to(DType::I64).contiguous();
  if (l.device().is_cpu()) {
    const int64_t* y = l.data<int64_t>();
    for (int64_t i = 0; i < N; ++i)
      KESTREL_CHECK(y[i] == ignore_index || (y[i] >= 0 && y[i] < V), op, "label ", y[i], " at position ", i,
                    " is outside [0, ", V, ") and is not ignore_index (", ignore_index, ")");
  }
  return l;
}

Tensor check_token_weights(const Tensor& w, int64_t N, DType compute, const Tensor& like, const char* op) {
  if (!w.defined()) return w;
  KESTREL_CHECK(w.dim() == 1 && w.shape()[0] == N, op, "token_weights must be [", N, "], got ", w.str());
  KESTREL_CHECK(is_floating(w.dtype()), op, "token_weights must be floating, got ", w.str());
  KESTREL_CHECK(w.device() == like.device(), op, "token_weights must be on ", like.device().str(), ", got ", w.str());
  Tensor d = w.detach();
  return (d.dtype() == compute ? d : d.to(compute)).contiguous();
}

}  // namespace

Tensor fused_linear_cross_entropy(const Tensor& hidden, const Tensor& weight, const Tensor& labels,
                                  const Tensor& token_weights, const CrossEntropyOptions& options) {
  KESTREL_CHECK(hidden.defined() && weight.defined(), kFused, "undefined hidden or weight");
  KESTREL_CHECK(hidden.dim() == 2, kFused, "hidden must be [N, H], got ", hidden.str());
  KESTREL_CHECK(weight.dim() == 2 && weight.shape()[1] == hidden.shape()[1], kFused, "weight must be [V, ",
                hidden.shape()[1], "], got ", weight.str());
  KESTREL_CHECK(is_floating(hidden.dtype()) && weight.dtype() == hidden.dtype(), kFused,
                "hidden and weight must share a floating dtype, got ", hidden.str(), " and ", weight.str());
  KESTREL_CHECK(weight.device() == hidden.device(), kFused, "hidden ", hidden.str(), " and weight ", weight.str(),
                " are on different devices");
  KESTREL_CHECK(weight.shape()[0] > 0, kFused, "vocabulary must not be empty, got ", weight.str());
  check_options(options, kFused);
  const int64_t N = hidden.shape()[0], H = hidden.shape()[1], V = weight.shape()[0];
  Tensor y = check_labels(labels, N, V, options.ignore_index, kFused);
  const DType ct = hidden.dtype() == DType::F64 ? DType::F64 : DType::F32;
  Tensor tw = check_token_weights(token_weights, N, ct, hidden, kFused);

  kernels::CrossEntropyParams p;
  p.ignore_index = options.ignore_index;
  p.reduction = options.reduction;
  p.z_loss = options.z_loss;
  p.label_smoothing = options.label_smoothing;
  // Default chunks: 512 tokens x up to 4096 vocabulary rows, fewer for wide hidden sizes so a
  // converted weight chunk stays near 16 MiB (the logits block is at most 8 MiB).
  p.chunk_tokens = std::clamp<int64_t>(options.chunk_tokens > 0 ? options.chunk_tokens : 512, 1, std::max<int64_t>(N, 1));
  int64_t auto_vc = std::clamp<int64_t>((int64_t{4} << 20) / std::max<int64_t>(H, 1), 256, 4096);
  p.chunk_vocab = std::clamp<int64_t>(options.chunk_vocab > 0 ? options.chunk_vocab : auto_vc, 1, V);

  Tensor h = hidden.detach().contiguous(), w = weight.detach().contiguous();
  Tensor loss = Tensor::empty({}, ct, hidden.device());  // []
  const bool record = ag::should_record({hidden, weight});
  bool gh = hidden.requires_grad(), gw = weight.requires_grad();
  // A leaf weight that already holds a gradient (gradient accumulation over micro-batches) gets this
  // one added in place by the gradient kernel: no second [V, H] buffer, one rounding of the sum (per
  // token chunk of the CUDA single pass). The entry then hands autograd no gradient for it; hooks still
  // fire after this entry, as before.
  Tensor leaf = gw && weight.is_leaf() ? weight : Tensor();
  if (record && options.known_grad.defined() && N > 0) {
    // The gradients now, for the upstream gradient the caller will pass (CrossEntropyOptions::known_grad).
    const Tensor& known = options.known_grad;
    KESTREL_CHECK(known.numel() == 1 && is_floating(known.dtype()) && known.device() == hidden.device(), kFused,
                  "known_grad must be a floating scalar on ", hidden.device().str(), ", got ", known.str());
    Tensor up = known.dtype() == ct ? known.detach() : known.detach().to(ct);
    Tensor dh, dw;
    bool in_place = false;
    {
      TagScope tag(MemoryTag::Gradient);  // held for (or already part of) the backward's result
      if (gh) dh = Tensor::empty(h.shape(), h.dtype(), h.device());
      Tensor acc = leaf.defined() ? leaf.grad() : Tensor();
      in_place = acc.defined() && acc.is_contiguous() && acc.dtype() == w.dtype() && acc.shape() == w.shape() &&
                 acc.device() == w.device();
      dw = in_place ? acc : gw ? Tensor::empty(w.shape(), w.dtype(), w.device()) : Tensor();
    }
    kernels::CrossEntropyParams fp = p;
    fp.accumulate_d_weight = in_place;
    kernels::dispatch(kernels::fused_linear_cross_entropy_forward_backward, kFused, hidden.device(), loss, dh, dw, up,
                      h, w, y, tw, fp);
    Tensor held_dw = in_place ? Tensor() : dw;
    ag::record(kFused, {hidden, weight}, loss, [dh, held_dw, known](const std::vector<Tensor>& g) -> std::vector<Tensor> {
      KESTREL_CHECK(g[0].same_as(known), kFused, "the loss was given known_grad ", known.str(),
                    " and its gradients were computed in the forward for it, but backward passed another gradient (",
                    g[0].str(), "): pass that very tensor as the backward's seed for this loss, or leave "
                    "CrossEntropyOptions::known_grad undefined");
      return {dh, held_dw};
    });
    return loss;
  }
  Tensor lse = Tensor::empty({N}, ct, hidden.device());  // [N]
  if (N == 0) {
    loss.zero_();
  } else {
    kernels::dispatch(kernels::fused_linear_cross_entropy_forward, kFused, hidden.device(), loss, lse, h, w, y, tw, p);
  }
  if (!record) return loss;
  ag::record(kFused, {hidden, weight}, loss, [=](const std::vector<Tensor>& g) -> std::vector<Tensor> {
    Tensor dh = gh ? Tensor::empty(h.shape(), h.dtype(), h.device()) : Tensor();
    Tensor acc = leaf.defined() ? leaf.grad() : Tensor();
    const bool in_place = acc.defined() && acc.is_contiguous() && acc.dtype() == w.dtype() &&
                          acc.shape() == w.shape() && acc.device() == w.device() && N > 0;
    Tensor dw = in_place ? acc : gw ? Tensor::empty(w.shape(), w.dtype(), w.device()) : Tensor();
    if (N == 0) {
      if (dh.defined()) dh.zero_();
      if (dw.defined()) dw.zero_();
      return {dh, dw};
    }
    Tensor up = g[0].dtype() == ct ? g[0] : g[0].to(ct);
    kernels::CrossEntropyParams bp = p;
    bp.accumulate_d_weight = in_place;
    kernels::dispatch(kernels::fused_linear_cross_entropy_backward, "fused_linear_cross_entropy_backward", h.device(),
                      dh, dw, up, h, w, y, tw, lse, bp);
    return {dh, in_place ? Tensor() : dw};
  });
  return loss;
}

Tensor cross_entropy(const Tensor& logits, const Tensor& labels, const Tensor& token_weights,
                     const CrossEntropyOptions& options) {
  constexpr const char* kOp = "cross_entropy";
  KESTREL_CHECK(logits.defined() && logits.dim() == 2 && is_floating(logits.dtype()), kOp,
                "logits must be a floating [N, V] tensor, got ", logits.defined() ? logits.str() : "undefined");
  check_options(options, kOp);
  const int64_t N = logits.shape()[0], V = logits.shape()[1];
  KESTREL_CHECK(V > 0, kOp, "vocabulary must not be empty, got ", logits.str());
  const DType ct = logits.dtype() == DType::F64 ? DType::F64 : DType::F32;
  Tensor y = check_labels(labels, N, V, options.ignore_index, kOp).to(Device::cpu());
  Tensor tw = check_token_weights(token_weights, N, ct, logits, kOp);

  // The valid-token mask and the one-hot label matrix, built on the host (this is the oracle).
  std::vector<float> valid(N, 0.0f), onehot(N * V, 0.0f);
  const int64_t* py = y.data<int64_t>();
  for (int64_t i = 0; i < N; ++i) {
    if (py[i] == options.ignore_index) continue;
    valid[i] = 1.0f;
    onehot[i * V + py[i]] = 1.0f;
  }
  Tensor c = Tensor::from_vector(valid, {N}, ct, logits.device());  // [N] w_i, 0 when ignored
  if (tw.defined()) c = mul(c, tw.to(ct));
  double denom = *sum(c).to(Device::cpu()).to(DType::F64).data<double>();  // item() rounds to f32
  double norm = options.reduction == Reduction::Sum ? 1.0 : (denom != 0 ? 1.0 / denom : 0.0);
  Tensor z = logits.dtype() == ct ? logits : cast(logits, ct);  // [N, V]
  Tensor oh = Tensor::from_vector(onehot, {N, V}, ct, logits.device());
  const double eps = options.label_smoothing;
  Tensor lse = logsumexp(z, 1);                       // [N]
  Tensor zy = sum(mul(z, oh), {1});                    // [N]
  Tensor per = scale(sub(lse, zy), 1 - eps);           // [N]
  if (eps != 0) per = add(per, scale(sub(lse, mean(z, {1})), eps));
  if (options.z_loss != 0) per = add(per, scale(square(lse), options.z_loss));
  return scale(sum(mul(per, c)), norm);
}

}  // namespace kestrel
