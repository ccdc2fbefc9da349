// CPU reference attention over packed variable-length documents: one (token, head) query row at a
// time, f64 accumulation, parallel over rows. Never holds more than one row of scores per thread.
//
// Forward: s_j = scale * q.k_j over the visible keys of the row's document, lse = log sum exp s_j,
// out = sum_j exp(s_j - lse) v_j. Causal masking is bottom-right aligned: key j (local index) is
// visible to query i iff j <= i + len_k - len_q; a sliding window W > 0 keeps only
// j > i + len_k - len_q - W of those, so each row sees a contiguous key range. A prefix-LM mask
// (prefix_len P per document, causal only) also shows every query the keys j < P: the prefix is
// bidirectional, the rest causal (the keys of a row stay one contiguous range [0, max(diag, P - 1)]).
// Backward (FA2 form, P recomputed from the saved lse): delta_i = dout_i . out_i,
// dS_ij = P_ij (dout_i . v_j - delta_i), dq_i = scale sum_j dS_ij k_j, dk_j = scale sum_i dS_ij q_i,
// dv_j = sum_i P_ij dout_i, with dk/dv also summed over the query heads of the KV group. dq runs
// over query rows and dk/dv over key rows (each recomputes P), so no two threads write one row.
// A block-sparse mask (p.block_mask, one document) replaces the range by a list: a row's keys are
// those of its query block's listed key blocks (FULL: all, PARTIAL: the set bits of the row layout),
// a key row's queries those of its key block's listed query blocks (the transposed bits).
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "kernels/attention.h"
#include "kestrel/runtime/dtype_dispatch.h"
#include "kestrel/runtime/parallel.h"

namespace kestrel::cpu {
namespace {

// Document geometry shared by forward and backward.
struct Docs {
  std::vector<int32_t> cu_q, cu_k;
  std::vector<int32_t> doc_of_q, doc_of_k;  // [total_q], [total_k]
  int64_t Hq = 0, Hkv = 0, D = 0, group = 1;

  std::vector<int32_t> prefix;  // [docs] prefix-LM lengths (keys), empty = none
  // Block-sparse mask (host tensors of p.block_mask); bm_q_ptr null = none.
  const int32_t *bm_q_ptr = nullptr, *bm_q_kblock = nullptr, *bm_q_kind = nullptr;
  const int32_t *bm_k_ptr = nullptr, *bm_k_qblock = nullptr, *bm_k_kind = nullptr;
  const uint32_t *bm_bits = nullptr, *bm_bits_t = nullptr;

  Docs(const Tensor& q, const Tensor& k, const Tensor& cu_seqlens_q, const Tensor& cu_seqlens_k,
       const kernels::AttentionParams& p) {
    if (p.prefix_len.defined()) {
      const int32_t* pp = p.prefix_len.data<int32_t>();
      prefix.assign(pp, pp + p.prefix_len.numel());
    }
    if (p.block_mask.defined()) {
      const BlockMask& m = p.block_mask;
      bm_q_ptr = m.q_ptr.data<int32_t>();
      bm_q_kblock = m.q_kblock.data<int32_t>();
      bm_q_kind = m.q_kind.data<int32_t>();
      bm_k_ptr = m.k_ptr.data<int32_t>();
      bm_k_qblock = m.k_qblock.data<int32_t>();
      bm_k_kind = m.k_kind.data<int32_t>();
      bm_bits = reinterpret_cast<const uint32_t*>(m.bits.data_ptr());
      bm_bits_t = reinterpret_cast<const uint32_t*>(m.bits_t.data_ptr());
    }
    const int32_t* pq = cu_seqlens_q.data<int32_t>();
    const int32_t* pk = cu_seqlens_k.data<int32_t>();
    cu_q.assign(pq, pq + cu_seqlens_q.numel());
    cu_k.assign(pk, pk + cu_seqlens_k.numel());
    doc_of_q.resize(q.shape()[0]);
    doc_of_k.resize(k.shape()[0]);
    for (size_t d = 0; d + 1 < cu_q.size(); ++d) {
      for (int32_t t = cu_q[d]; t < cu_q[d + 1]; ++t) doc_of_q[t] = static_cast<int32_t>(d);
      for (int32_t t = cu_k[d]; t < cu_k[d + 1]; ++t) doc_of_k[t] = static_cast<int32_t>(d);
    }
    Hq = q.shape()[1];
    Hkv = k.shape()[1];
    D = q.shape()[2];
    group = Hq / Hkv;
  }
  int64_t len_q(int d) const { return cu_q[d + 1] - cu_q[d]; }
  int64_t len_k(int d) const { return cu_k[d + 1] - cu_k[d]; }
  int64_t prefix_of(int d) const { return prefix.empty() ? 0 : prefix[d]; }
  // Visible local keys [lo, hi) of local query index i (empty when lo >= hi).
  struct Range {
    int64_t lo, hi;
  };
  Range keys_of(int d, int64_t i, const kernels::AttentionParams& p) const {
    const int64_t lk = len_k(d);
    if (!p.causal) return {0, lk};
    const int64_t diag = std::max(i + lk - len_q(d), prefix_of(d) - 1);  // the last visible key
    const int64_t hi = std::clamp<int64_t>(diag + 1, 0, lk);
    const int64_t lo = p.window > 0 ? std::clamp<int64_t>(diag - p.window + 1, 0, lk) : 0;
    return {lo, std::max(lo, hi)};
  }
  // The visible local keys of local query i, increasing: the range of keys_of, or with a block mask
  // (one document: local = global) the listed key blocks' visible keys.
  void keys(int d, int64_t i, const kernels::AttentionParams& p, std::vector<int64_t>& out) const {
    out.clear();
    if (bm_q_ptr) {
      masked_list(i, len_k(d), bm_q_ptr, bm_q_kblock, bm_q_kind, bm_bits, out);
      return;
    }
    const Range r = keys_of(d, i, p);
    for (int64_t j = r.lo; j < r.hi; ++j) out.push_back(j);
  }
  // The local queries that see local key j, increasing.
  void queries(int d, int64_t j, const kernels::AttentionParams& p, std::vector<int64_t>& out) const {
    out.clear();
    if (bm_q_ptr) {
      masked_list(j, len_q(d), bm_k_ptr, bm_k_qblock, bm_k_kind, bm_bits_t, out);
      return;
    }
    const Range r = queries_of(d, j, p);
    for (int64_t i = r.lo; i < r.hi; ++i) out.push_back(i);
  }
  // Of row x (a query in the row view, a key in the column view), the visible positions along the
  // other axis (length n): every one of a FULL block, the set bits of a PARTIAL one.
  static void masked_list(int64_t x, int64_t n, const int32_t* ptr, const int32_t* blocks, const int32_t* kinds,
                          const uint32_t* bits, std::vector<int64_t>& out) {
    constexpr int64_t kB = BlockMask::kBlock;
    const int64_t b = x / kB, r = x % kB;
    for (int32_t e = ptr[b]; e < ptr[b + 1]; ++e) {
      const int64_t start = int64_t{blocks[e]} * kB, end = std::min(n, start + kB);
      const uint32_t* row = kinds[e] >= 0 ? bits + (int64_t{kinds[e]} * kB + r) * (kB / 32) : nullptr;
      for (int64_t y = start; y < end; ++y)
        if (!row || ((row[(y - start) / 32] >> ((y - start) % 32)) & 1u)) out.push_back(y);
    }
  }
  // Local queries [lo, hi) that see local key j.
  Range queries_of(int d, int64_t j, const kernels::AttentionParams& p) const {
    const int64_t lq = len_q(d);
    if (!p.causal) return {0, lq};
    const int64_t off = len_k(d) - len_q(d);
    const int64_t lo = j < prefix_of(d) ? 0 : std::clamp<int64_t>(j - off, 0, lq);
    const int64_t hi = p.window > 0 ? std::clamp<int64_t>(j - off + p.window, 0, lq) : lq;
    return {lo, std::max(lo, hi)};
  }
};

// Four independent partial sums: the loop-carried add chain, not the multiplies, bounds a dot product.
template <typename T>
double dot_row(const double* a, const T* b, int64_t D) {
  double s0 = 0, s1 = 0, s2 = 0, s3 = 0;
  int64_t d = 0;
  for (; d + 4 <= D; d += 4) {
    s0 += a[d] * elem_to_double(b[d]);
    s1 += a[d + 1] * elem_to_double(b[d + 1]);
    s2 += a[d + 2] * elem_to_double(b[d + 2]);
    s3 += a[d + 3] * elem_to_double(b[d + 3]);
  }
  for (; d < D; ++d) s0 += a[d] * elem_to_double(b[d]);
  return (s0 + s1) + (s2 + s3);
}

template <typename T>
void load_row(double* dst, const T* src, int64_t D) {
  for (int64_t d = 0; d < D; ++d) dst[d] = elem_to_double(src[d]);
}

void attention_forward_cpu(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k, const Tensor& v,
                           const Tensor& cu_seqlens_q, const Tensor& cu_seqlens_k,
                           const kernels::AttentionParams& p) {
  Docs g(q, k, cu_seqlens_q, cu_seqlens_k, p);
  int64_t total_q = q.shape()[0], Hq = g.Hq, Hkv = g.Hkv, D = g.D;
  dispatch_floating(q.dtype(), "attention", [&](auto tag) {
    using T = decltype(tag);
    const T* pq = q.data<T>();  // [total_q, Hq, D]
    const T* pk = k.data<T>();  // [total_k, Hkv, D]
    const T* pv = v.data<T>();  // [total_k, Hkv, D]
    T* po = out.data<T>();      // [total_q, Hq, D]
    float* pl = lse.data<float>();  // [total_q, Hq]
    int64_t grain = std::max<int64_t>(1, 4096 / std::max<int64_t>(1, p.max_seqlen_k * D));
    parallel_for(0, total_q * Hq, grain, [&](int64_t rb, int64_t re) {
      std::vector<double> qrow(D), acc(D), s(std::max<int64_t>(p.max_seqlen_k, 1));
      std::vector<int64_t> keys;
      keys.reserve(p.max_seqlen_k);
      for (int64_t r = rb; r < re; ++r) {
        int64_t t = r / Hq, h = r % Hq, hk = h / g.group;
        int d = g.doc_of_q[t];
        g.keys(d, t - g.cu_q[d], p, keys);
        const int64_t n = static_cast<int64_t>(keys.size());
        T* orow = po + r * D;
        if (n == 0) {
          for (int64_t e = 0; e < D; ++e) orow[e] = elem_from_double<T>(0.0);
          pl[r] = -std::numeric_limits<float>::infinity();
          continue;
        }
        load_row(qrow.data(), pq + r * D, D);
        const int64_t k0 = g.cu_k[d];  // the document's first key (global row)
        double m = -std::numeric_limits<double>::infinity();
        for (int64_t j = 0; j < n; ++j) {
          s[j] = p.softmax_scale * dot_row(qrow.data(), pk + ((k0 + keys[j]) * Hkv + hk) * D, D);
          m = std::max(m, s[j]);
        }
        double sum = 0;
        std::fill(acc.begin(), acc.end(), 0.0);
        for (int64_t j = 0; j < n; ++j) {
          double e = std::exp(s[j] - m);
          sum += e;
          const T* vrow = pv + ((k0 + keys[j]) * Hkv + hk) * D;
          for (int64_t c = 0; c < D; ++c) acc[c] += e * elem_to_double(vrow[c]);
        }
        for (int64_t c = 0; c < D; ++c) orow[c] = elem_from_double<T>(acc[c] / sum);
        pl[r] = static_cast<float>(m + std::log(sum));
      }
    });
  });
}

void attention_backward_cpu(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dout,
                            const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                            const Tensor& cu_seqlens_q, const Tensor& cu_seqlens_k,
                            const kernels::AttentionParams& p) {
  Docs g(q, k, cu_seqlens_q, cu_seqlens_k, p);
  int64_t total_q = q.shape()[0], total_k = k.shape()[0], Hq = g.Hq, Hkv = g.Hkv, D = g.D;
  const double scale = p.softmax_scale;
  dispatch_floating(q.dtype(), "attention_backward", [&](auto tag) {
    using T = decltype(tag);
    const T *pq = q.data<T>(), *pk = k.data<T>(), *pv = v.data<T>();  // [tokens, H, D]
    const T *po = out.data<T>(), *pdo = dout.data<T>();               // [total_q, Hq, D]
    const float* pl = lse.data<float>();                               // [total_q, Hq]
    T *pdq = dq.data<T>(), *pdk = dk.data<T>(), *pdv = dv.data<T>();

    // delta [total_q, Hq] = rowsum(dout * out).
    std::vector<double> delta(total_q * Hq);
    parallel_for(0, total_q * Hq, std::max<int64_t>(1, 16384 / std::max<int64_t>(D, 1)), [&](int64_t rb, int64_t re) {
      for (int64_t r = rb; r < re; ++r) {
        double s = 0;
        for (int64_t c = 0; c < D; ++c) s += elem_to_double(pdo[r * D + c]) * elem_to_double(po[r * D + c]);
        delta[r] = s;
      }
    });

    int64_t grain = std::max<int64_t>(1, 2048 / std::max<int64_t>(1, p.max_seqlen_k * D));
    // dq: one query row at a time.
    parallel_for(0, total_q * Hq, grain, [&](int64_t rb, int64_t re) {
      std::vector<double> qrow(D), dorow(D), acc(D);
      std::vector<int64_t> keys;
      keys.reserve(p.max_seqlen_k);
      for (int64_t r = rb; r < re; ++r) {
        int64_t t = r / Hq, h = r % Hq, hk = h / g.group;
        int d = g.doc_of_q[t];
        g.keys(d, t - g.cu_q[d], p, keys);
        std::fill(acc.begin(), acc.end(), 0.0);
        if (!keys.empty()) {
          load_row(qrow.data(), pq + r * D, D);
          load_row(dorow.data(), pdo + r * D, D);
          const double l = pl[r];
          for (int64_t j : keys) {
            int64_t kr = (g.cu_k[d] + j) * Hkv + hk;
            double pij = std::exp(scale * dot_row(qrow.data(), pk + kr * D, D) - l);
            double ds = pij * (dot_row(dorow.data(), pv + kr * D, D) - delta[r]);
            const T* krow = pk + kr * D;
            for (int64_t c = 0; c < D; ++c) acc[c] += ds * elem_to_double(krow[c]);
          }
        }
        for (int64_t c = 0; c < D; ++c) pdq[r * D + c] = elem_from_double<T>(scale * acc[c]);
      }
    });

    // dk, dv: one key row at a time, summed over the group's query heads and the queries that see it.
    int64_t kgrain = std::max<int64_t>(1, 2048 / std::max<int64_t>(1, p.max_seqlen_q * g.group * D));
    parallel_for(0, total_k * Hkv, kgrain, [&](int64_t rb, int64_t re) {
      std::vector<double> krow(D), vrow(D), dka(D), dva(D);
      std::vector<int64_t> queries;
      queries.reserve(p.max_seqlen_q);
      for (int64_t r = rb; r < re; ++r) {
        int64_t t = r / Hkv, hk = r % Hkv;
        int d = g.doc_of_k[t];
        int64_t j = t - g.cu_k[d];
        std::fill(dka.begin(), dka.end(), 0.0);
        std::fill(dva.begin(), dva.end(), 0.0);
        g.queries(d, j, p, queries);
        if (!queries.empty()) {
          load_row(krow.data(), pk + r * D, D);
          load_row(vrow.data(), pv + r * D, D);
        }
        for (int64_t i : queries) {
          for (int64_t h = hk * g.group; h < (hk + 1) * g.group; ++h) {
            int64_t qr = (g.cu_q[d] + i) * Hq + h;
            const T* qp = pq + qr * D;
            const T* dop = pdo + qr * D;
            double pij = std::exp(scale * dot_row(krow.data(), qp, D) - static_cast<double>(pl[qr]));
            double ds = pij * (dot_row(vrow.data(), dop, D) - delta[qr]);
            for (int64_t c = 0; c < D; ++c) {
              dka[c] += ds * elem_to_double(qp[c]);
              dva[c] += pij * elem_to_double(dop[c]);
            }
          }
        }
        for (int64_t c = 0; c < D; ++c) {
          pdk[r * D + c] = elem_from_double<T>(scale * dka[c]);
          pdv[r * D + c] = elem_from_double<T>(dva[c]);
        }
      }
    });
  });
}

}  // namespace

KESTREL_REGISTER_KERNEL(attention_forward, cpu, attention_forward_cpu);
KESTREL_REGISTER_KERNEL(attention_backward, cpu, attention_backward_cpu);

}  // namespace kestrel::cpu
