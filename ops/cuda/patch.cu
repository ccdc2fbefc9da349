// CUDA patch unfold/fold (stride = kernel = P) for the slots in kernels/patch.h: one thread per
// element of the patch matrix cols [B, Hp*Wp, C*P*P] (writes coalesced), raw element copies.
// fold is the exact transpose (no overlap, so no sums); pixels past Hp*P / Wp*P get 0.
#include "cuda/common.cuh"
#include "kernels/patch.h"

namespace kestrel::cuda_ops {
namespace {

// FOLD = false: cols[q] = img[src(q)];  true: img[src(q)] = cols[q].
template <typename W, bool FOLD>
__global__ void patch_kernel(W* __restrict__ cols, W* __restrict__ img, int64_t B, int64_t C, int64_t H, int64_t Wd,
                             int64_t P) {
  int64_t Hp = H / P, Wp = Wd / P, K = C * P * P, total = B * Hp * Wp * K;
  for (int64_t q = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; q < total;
       q += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int64_t k = q % K, patch = (q / K) % (Hp * Wp), b = q / (K * Hp * Wp);
    int64_t c = k / (P * P), i = (k / P) % P, j = k % P;
    int64_t y = (patch / Wp) * P + i, x = (patch % Wp) * P + j;
    int64_t e = ((b * C + c) * H + y) * Wd + x;
    if (FOLD)
      img[e] = cols[q];
    else
      cols[q] = img[e];
  }
}

template <bool FOLD>
void run(const Tensor& cols, const Tensor& img, int64_t P) {
  check_cuda_dtype(img.dtype(), FOLD ? "fold_patches" : "unfold_patches");
  int64_t B = img.shape()[0], C = img.shape()[1], H = img.shape()[2], Wd = img.shape()[3];
  int64_t total = cols.numel();
  if (total == 0) return;
  auto go = [&](auto word) {
    using W = decltype(word);
    patch_kernel<W, FOLD><<<grid_for(total, 256), 256, 0, cuda::current_stream()>>>(
        static_cast<W*>(cols.data_ptr()), static_cast<W*>(img.data_ptr()), B, C, H, Wd, P);
  };
  if (dtype_size(img.dtype()) == 4)
    go(uint32_t{});
  else
    go(uint16_t{});
  KESTREL_CUDA_CHECK_LAUNCH();
}

void unfold_cuda(const Tensor& cols, const Tensor& images, int64_t patch) { run<false>(cols, images, patch); }
void fold_cuda(const Tensor& dimages, const Tensor& dcols, int64_t patch) {
  int64_t H = dimages.shape()[2], Wd = dimages.shape()[3];
  if (H % patch != 0 || Wd % patch != 0) Tensor(dimages).zero_();  // dropped pixels
  run<true>(dcols, dimages, patch);
}

}  // namespace

KESTREL_REGISTER_KERNEL(unfold_patches, cuda, unfold_cuda);
KESTREL_REGISTER_KERNEL(fold_patches, cuda, fold_cuda);

}  // namespace kestrel::cuda_ops
