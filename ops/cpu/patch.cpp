// CPU unfold/fold for patch embedding: pure data movement, one (image, patch row) per task.
#include "kernels/patch.h"
#include "kestrel/runtime/dtype_dispatch.h"
#include "kestrel/runtime/parallel.h"

namespace kestrel::cpu {
namespace {

// fn(col_index, pixel_index) for every element of a patch row; both flat offsets.
template <typename F>
void for_patch_elements(const Shape& img, int64_t P, F&& fn) {
  int64_t B = img[0], C = img[1], H = img[2], W = img[3], Hp = H / P, Wp = W / P, K = C * P * P;
  parallel_for(0, B * Hp, 1, [&](int64_t b0, int64_t e0) {
    for (int64_t t = b0; t < e0; ++t) {
      int64_t b = t / Hp, py = t % Hp;
      for (int64_t px = 0; px < Wp; ++px) {
        int64_t col_base = ((b * Hp + py) * Wp + px) * K;
        for (int64_t c = 0; c < C; ++c)
          for (int64_t i = 0; i < P; ++i)
            for (int64_t j = 0; j < P; ++j)
              fn(col_base + (c * P + i) * P + j, ((b * C + c) * H + py * P + i) * W + px * P + j);
      }
    }
  });
}

void unfold_cpu(const Tensor& cols, const Tensor& images, int64_t P) {
  dispatch_floating(images.dtype(), "patch_embed", [&](auto tag) {
    using T = decltype(tag);
    const T* pi = images.data<T>();
    T* pc = cols.data<T>();
    for_patch_elements(images.shape(), P, [&](int64_t ci, int64_t ii) { pc[ci] = pi[ii]; });
  });
}

void fold_cpu(const Tensor& dimages, const Tensor& dcols, int64_t P) {
  dispatch_floating(dimages.dtype(), "patch_embed", [&](auto tag) {
    using T = decltype(tag);
    const T* pc = dcols.data<T>();
    T* pi = dimages.data<T>();
    for_patch_elements(dimages.shape(), P, [&](int64_t ci, int64_t ii) { pi[ii] = pc[ci]; });
  });
}

}  // namespace

KESTREL_REGISTER_KERNEL(unfold_patches, cpu, unfold_cpu);
KESTREL_REGISTER_KERNEL(fold_patches, cpu, fold_cpu);

}  // namespace kestrel::cpu
