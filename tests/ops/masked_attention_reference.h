// The float64 attention reference the CPU mask tests share (prefix-LM, sliding window, block-sparse):
// per document, the full [len_q, len_k] score matrix under a visibility predicate written from the
// mask's definition; forward (out, lse) and backward on full matrices: P = softmax(masked S),
// dP = dO V^T, dS = P * (dP - rowsum(dP * P)), dQ = scale dS K, dK = scale dS^T Q, dV = P^T dO.
// A query row with no visible key keeps out = 0, lse = -inf and no gradient.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <vector>

#include "kestrel/runtime/tensor.h"
#include "support/numerics.h"

namespace kestrel::testing {

// Relative L2 with the reference's RMS floored at 1e-3 (a row that sees one key has dq = dk = 0, so
// those are compared in absolute terms); equal infinities (lse of an empty row) are skipped.
inline double rel_err(const std::vector<double>& a, const std::vector<double>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::isinf(b[i]) && a[i] == b[i]) continue;
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  return std::sqrt(num) / std::max(std::sqrt(den), 1e-3 * std::sqrt(static_cast<double>(b.size())));
}

struct AttentionRef {
  std::vector<double> out, lse, dq, dk, dv;
};

// visible(d, i, j, len_q, len_k): key j of document d visible to its query i (local indices).
using Visibility = std::function<bool(size_t, int64_t, int64_t, int64_t, int64_t)>;

// q/dout [sum lq, Hq, D], k/v [sum lk, Hkv, D] (packed documents of lengths lq / lk), scale 1/sqrt(D).
inline AttentionRef masked_attention_reference(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& dout,
                                               const std::vector<int64_t>& lq, const std::vector<int64_t>& lk,
                                               const Visibility& visible) {
  std::vector<double> Q = host_f64(q), K = host_f64(k), V = host_f64(v), dO = host_f64(dout);
  const int64_t Hq = q.shape()[1], Hkv = k.shape()[1], D = q.shape()[2], G = Hq / Hkv;
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  AttentionRef r;
  r.out.assign(Q.size(), 0.0);
  r.dq.assign(Q.size(), 0.0);
  r.dk.assign(K.size(), 0.0);
  r.dv.assign(V.size(), 0.0);
  r.lse.assign(q.shape()[0] * Hq, -std::numeric_limits<double>::infinity());
  int64_t q0 = 0, k0 = 0;
  for (size_t d = 0; d < lq.size(); ++d) {
    const int64_t nq = lq[d], nk = lk[d];
    for (int64_t h = 0; h < Hq; ++h) {
      const int64_t hk = h / G;
      auto qv = [&](int64_t i, int64_t c) { return Q[((q0 + i) * Hq + h) * D + c]; };
      auto kv = [&](int64_t j, int64_t c) { return K[((k0 + j) * Hkv + hk) * D + c]; };
      auto vv = [&](int64_t j, int64_t c) { return V[((k0 + j) * Hkv + hk) * D + c]; };
      auto gv = [&](int64_t i, int64_t c) { return dO[((q0 + i) * Hq + h) * D + c]; };
      for (int64_t i = 0; i < nq; ++i) {
        std::vector<double> s(nk, -std::numeric_limits<double>::infinity()), P(nk, 0.0), dp(nk, 0.0);
        double m = -std::numeric_limits<double>::infinity();
        for (int64_t j = 0; j < nk; ++j) {
          if (!visible(d, i, j, nq, nk)) continue;
          double x = 0;
          for (int64_t c = 0; c < D; ++c) x += qv(i, c) * kv(j, c);
          s[j] = x * scale;
          m = std::max(m, s[j]);
        }
        if (std::isinf(m)) continue;
        double z = 0;
        for (int64_t j = 0; j < nk; ++j) z += std::exp(s[j] - m);
        r.lse[(q0 + i) * Hq + h] = m + std::log(z);
        double rowdot = 0;
        for (int64_t j = 0; j < nk; ++j) {
          P[j] = std::exp(s[j] - m) / z;
          if (P[j] == 0) continue;
          for (int64_t c = 0; c < D; ++c) {
            r.out[((q0 + i) * Hq + h) * D + c] += P[j] * vv(j, c);
            dp[j] += gv(i, c) * vv(j, c);
          }
          rowdot += dp[j] * P[j];
        }
        for (int64_t j = 0; j < nk; ++j) {
          if (P[j] == 0) continue;
          const double ds = P[j] * (dp[j] - rowdot);
          for (int64_t c = 0; c < D; ++c) {
            r.dq[((q0 + i) * Hq + h) * D + c] += scale * ds * kv(j, c);
            r.dk[((k0 + j) * Hkv + hk) * D + c] += scale * ds * qv(i, c);
            r.dv[((k0 + j) * Hkv + hk) * D + c] += P[j] * gv(i, c);
          }
        }
      }
    }
    q0 += nq;
    k0 += nk;
  }
  return r;
}

}  // namespace kestrel::testing
