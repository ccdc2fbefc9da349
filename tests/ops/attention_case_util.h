// Shared pieces of the attention op tests over packed documents (the CPU ones in tests/ops and the
// CUDA ones that compare the CUDA op with the CPU reference op: cuda/test_flash_attention_prefix.cpp,
// cuda/test_flash_attention_window.cpp, cuda/test_cudnn_attention.cpp): cu_seqlens from document
// lengths, the flash tests' dtype-tied error budgets, and the outputs one run returns.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "kestrel/runtime/tensor.h"

namespace kestrel::testing {

// i32 [docs + 1] on the CPU.
inline Tensor cu_from(const std::vector<int64_t>& lens) {
  std::vector<int64_t> cu{0};
  for (int64_t l : lens) cu.push_back(cu.back() + l);
  return Tensor::from_vector(cu, {static_cast<int64_t>(cu.size())}, DType::I32);
}
inline int64_t sum_of(const std::vector<int64_t>& v) {
  int64_t s = 0;
  for (int64_t x : v) s += x;
  return s;
}
inline int64_t max_of(const std::vector<int64_t>& v) { return v.empty() ? 0 : *std::max_element(v.begin(), v.end()); }

// Same budgets as test_flash_attention.cu: P and dS are rounded to the input precision in the kernels.
inline double tol_out(DType t) { return t == DType::BF16 ? 1e-2 : 4e-3; }
inline double tol_grad(DType t) { return t == DType::BF16 ? 2e-2 : 8e-3; }

struct AttentionOutputs {
  Tensor out, lse, dq, dk, dv;  // CPU, f32
};

}  // namespace kestrel::testing
