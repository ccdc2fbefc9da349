// Op-table cases for patch_embed: a direct stride-P convolution in f64 as the reference, with image
// sizes that are and are not multiples of P.
#include "kestrel/ops/patch.h"
#include "support/op_table.h"

namespace kestrel::testing {
namespace {

// images [B, C, H, W], weight [E, C, P, P], bias [E] -> [B, Hp*Wp, E].
Tensor patch_reference(const Tensor& images, const Tensor& weight, const Tensor& bias, int64_t P) {
  int64_t B = images.shape()[0], C = images.shape()[1], H = images.shape()[2], W = images.shape()[3];
  int64_t E = weight.shape()[0], Hp = H / P, Wp = W / P;
  std::vector<double> x = host_values(images), w = host_values(weight);
  std::vector<double> b = bias.defined() ? host_values(bias) : std::vector<double>(E, 0.0);
  std::vector<double> y(static_cast<size_t>(B * Hp * Wp * E));
  for (int64_t n = 0; n < B; ++n)
    for (int64_t py = 0; py < Hp; ++py)
      for (int64_t px = 0; px < Wp; ++px)
        for (int64_t e = 0; e < E; ++e) {
          double s = b[e];
          for (int64_t c = 0; c < C; ++c)
            for (int64_t i = 0; i < P; ++i)
              for (int64_t j = 0; j < P; ++j)
                s += x[((n * C + c) * H + py * P + i) * W + px * P + j] * w[((e * C + c) * P + i) * P + j];
          y[((n * Hp + py) * Wp + px) * E + e] = s;
        }
  return f64_tensor(y, {B, Hp * Wp, E});
}

}  // namespace

void add_patch_cases(std::vector<OpCase>& cases) {
  struct Spec {
    const char* cls;
    int64_t B, C, H, W, P, E;
    bool bias, grad;
  };
  const Spec specs[] = {
      {"b1_c1_1x1_p1_e1", 1, 1, 1, 1, 1, 1, true, true},
      {"b1_c2_5x6_p2_e3_trailing", 1, 2, 5, 6, 2, 3, true, true},
      {"b2_c3_4x4_p2_e2_nobias", 2, 3, 4, 4, 2, 2, false, true},
      {"b2_c3_33x31_p4_e7", 2, 3, 33, 31, 4, 7, true, false},
      {"b1_c3_64x64_p16_e127", 1, 3, 64, 64, 16, 127, true, false},
  };
  for (const Spec& sp : specs) {
    OpCase c;
    c.name = "patch_embed";
    c.shape_class = sp.cls;
    c.make_inputs = [sp](DType dt, Device dev) -> OpInputs {
      OpInputs in{randn({sp.B, sp.C, sp.H, sp.W}, dt, dev), randn({sp.E, sp.C, sp.P, sp.P}, dt, dev)};
      if (sp.bias) in.push_back(randn({sp.E}, dt, dev));
      return in;
    };
    c.op = [P = sp.P](const OpInputs& in) -> std::vector<Tensor> {
      return {patch_embed(in[0], in[1], in.size() > 2 ? in[2] : Tensor(), P)};
    };
    c.reference = [P = sp.P](const OpInputs& in) -> std::vector<Tensor> {
      return {patch_reference(in[0], in[1], in.size() > 2 ? in[2] : Tensor(), P)};
    };
    c.gradcheck = sp.grad;
    cases.push_back(c);
  }
}

}  // namespace kestrel::testing
