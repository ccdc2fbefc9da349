// Runtime values -> template arguments, in one place (FlashAttention's static_switch.h, as lambdas):
//   dtype_switch(p.dtype, [&](auto tag) { using T = typename decltype(tag)::type; ... });
//   head_dim_switch(64, 80, 96, 112 or 128, [&](auto d) { constexpr int kD = decltype(d)::value; ... });
//   bool_switch(flag, [&](auto b) { constexpr bool kFlag = decltype(b)::value; ... });
#pragma once

#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "cuda/flash_attention/flash_attention.h"

namespace kestrel::cuda::fa {

template <typename T>
struct TypeTag { using type = T; };

template <typename F>
decltype(auto) dtype_switch(AttnDType dtype, F&& f) {
  if (dtype == AttnDType::BF16) return f(TypeTag<__nv_bfloat16>{});
  return f(TypeTag<__half>{});
}

// The Hopper kernels' head dims (64, 80, 96, 112, 128; traits.h); the caller has chosen one of them
// (heuristics.h).
template <typename F>
decltype(auto) head_dim_switch(int kernel_head_dim, F&& f) {
  if (kernel_head_dim == 64) return f(std::integral_constant<int, 64>{});
  if (kernel_head_dim == 80) return f(std::integral_constant<int, 80>{});
  if (kernel_head_dim == 96) return f(std::integral_constant<int, 96>{});
  if (kernel_head_dim == 112) return f(std::integral_constant<int, 112>{});
  return f(std::integral_constant<int, 128>{});
}

template <typename F>
decltype(auto) bool_switch(bool flag, F&& f) {
  if (flag) return f(std::true_type{});
  return f(std::false_type{});
}

}  // namespace kestrel::cuda::fa
