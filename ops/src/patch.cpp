// patch_embed: unfold the image into patch rows (recorded; backward folds), then one linear layer
// with the conv weight viewed as [E, C*P*P]. On the CPU this is as fast as a direct convolution.
#include "kestrel/ops/patch.h"

#include "kernels/patch.h"
#include "kestrel/autograd/tape.h"
#include "kestrel/ops/matmul.h"
#include "kestrel/ops/shape.h"

namespace kestrel {
namespace ag = autograd;
namespace {

// images [B, C, H, W] -> cols [B, Hp*Wp, C*P*P], differentiable.
Tensor unfold_patches(const Tensor& images, int64_t P) {
  int64_t B = images.shape()[0], C = images.shape()[1], Hp = images.shape()[2] / P, Wp = images.shape()[3] / P;
  Tensor cols = Tensor::empty({B, Hp * Wp, C * P * P}, images.dtype(), images.device());
  if (cols.numel() > 0)
    kernels::dispatch(kernels::unfold_patches, "patch_embed", images.device(), cols, images.contiguous(), P);
  if (!ag::should_record({images})) return cols;
  ag::record("unfold_patches", {images}, cols, [P, is = images.shape()](const std::vector<Tensor>& g) -> std::vector<Tensor> {
    Tensor d = Tensor::zeros(is, g[0].dtype(), g[0].device());
    if (g[0].numel() > 0) kernels::dispatch(kernels::fold_patches, "patch_embed", d.device(), d, g[0].contiguous(), P);
    return {d};
  });
  return cols;
}

}  // namespace

Tensor patch_embed(const Tensor& images, const Tensor& weight, const Tensor& bias, int64_t patch) {
  KESTREL_CHECK(images.defined() && images.dim() == 4, "patch_embed", "images must be [B, C, H, W], got ",
                images.defined() ? images.str() : std::string("undefined"));
  KESTREL_CHECK(is_floating(images.dtype()), "patch_embed", "expected floating images, got ", images.str());
  KESTREL_CHECK(patch > 0, "patch_embed", "patch must be positive, got ", patch);
  int64_t C = images.shape()[1];
  KESTREL_CHECK(weight.defined() && weight.dim() == 4 && weight.shape()[1] == C && weight.shape()[2] == patch &&
                    weight.shape()[3] == patch,
                "patch_embed", "weight must be [E, ", C, ", ", patch, ", ", patch, "], got ",
                weight.defined() ? weight.str() : std::string("undefined"));
  KESTREL_CHECK(images.shape()[2] >= patch && images.shape()[3] >= patch, "patch_embed", "images ", images.str(),
                " are smaller than one ", patch, "x", patch, " patch");
  KESTREL_CHECK(weight.dtype() == images.dtype() && weight.device() == images.device(), "patch_embed", "weight ",
                weight.str(), " differs in dtype or device from images ", images.str());
  int64_t E = weight.shape()[0];
  if (bias.defined())
    KESTREL_CHECK(bias.dim() == 1 && bias.shape()[0] == E && bias.dtype() == images.dtype(), "patch_embed",
                  "bias must be [", E, "] of ", dtype_name(images.dtype()), ", got ", bias.str());
  Tensor cols = unfold_patches(images, patch);                 // [B, Np, C*P*P]
  Tensor w2 = reshape(contiguous(weight), {E, C * patch * patch});  // [E, C*P*P]
  return linear(cols, w2, bias);                               // [B, Np, E]
}

}  // namespace kestrel
