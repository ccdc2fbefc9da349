// FP8 linear layers with per-tensor delayed scaling (issue #23).
//
// y = x W^T runs as three FP8 GEMMs (cuBLASLt on sm_90; an exact emulation on the CPU):
//   forward  Y [T, N]  = X8 [T, K]   . W8 [N, K]^T       x, W in e4m3
//   dgrad   dX [T, K]  = dY8 [T, N]  . W8T [K, N]^T      dY in the recipe's grad format (e5m2 or e4m3)
//   wgrad   dW [N, K]  = dY8T [N, T] . X8T [K, T]^T
// Every GEMM is "TN" (both operands K-contiguous), which is what cuBLASLt's FP8 kernels take, so the
// transposed copies are materialised by the cast kernels (one pass writes the plain and/or the
// transposed copy and folds the tensor's amax into a device scalar). Backward keeps X8T (a byte per
// element, half of a bf16 x) and re-casts W8T from the bf16 weight with the forward's scale (the weight
// does not change within a step), so nothing weight-sized is held between forward and backward.
//
// Scaling is per tensor and delayed (Fp8State): each linear has three roles (input, weight, output
// gradient), each an amax history of H steps on the device. A cast multiplies by the role's scale,
//   scale = fp8_max / (max(history) * 2^margin),
// rounds to fp8 (saturating: finite values past +-max become +-max, NaN stays NaN) and records its own
// amax into the role's running amax of this step (a max, so a recompute region re-running the forward,
// or micro-batches of one optimizer step, fold into one value). Fp8State::roll(), once per optimizer
// step, pushes that amax into the history and recomputes the scales (device kernels, no host sync).
// Before the first roll the histories are empty: a cast then takes its scale from the tensor's own
// amax (an amax pass before the cast), so step 1 is sane. A zero or non-finite amax leaves a scale as
// it was (1 at first). Tile-wise scaling: not yet.
//
// Producer-fused input casts (kestrel/ops/fp8_producers.h): once the state is seeded, SwiGLU (which
// produces down's input) writes X8 (and X8T) in the same pass as its bf16 output, with the role's
// current scale, folding the amax as the cast would; the norms return the cast made right after
// them (fp8_input_cast: their fused kernels measured slower). linear_fp8 then takes that
// Fp8InputCast and makes no cast of x. The result is bit for bit the unfused one (the codes are those
// of the stored, bf16-rounded output). Before the first roll a cast's scale needs the tensor's own
// amax first, so the producers fall back to the plain op and the cast (fp8_input_cast). The other
// casts (the weights, W8T, the output gradient, the attention output's input to o_proj) are the
// standalone cast kernel.
//
// Shapes: K and N (the weight's dims) must be multiples of 16 (cuBLASLt's FP8 leading dimensions); the
// token count T may be anything: a ragged T is padded with zero rows to a multiple of 16 for the GEMMs
// (exact: zero rows add nothing to any output or to wgrad, and leave the amax unchanged). The casts
// write the zero rows themselves (no padded copy of x or dy is made).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kestrel/runtime/tensor.h"

namespace kestrel {

enum class Fp8Format { E4M3, E5M2 };

const char* fp8_format_name(Fp8Format f);  // "e4m3" | "e5m2"
// Parses "e4m3" / "e5m2"; an error names `key` and the value.
Fp8Format parse_fp8_format(const std::string& text, const std::string& key);
// Largest finite magnitude: 448 (e4m3), 57344 (e5m2).
double fp8_max(Fp8Format f);

// Host conversions (the CPU kernels and the tests use these). float_to_fp8 rounds to nearest, ties to
// even, saturating as cuda_fp8.h's __nv_cvt_float_to_fp8(x, __NV_SATFINITE, ...): |x| > max (inf
// included) becomes +-max; NaN becomes 0x7f. fp8_to_float is exact (every fp8 value is a float).
uint8_t float_to_fp8(float x, Fp8Format f);
float fp8_to_float(uint8_t code, Fp8Format f);

// A quantised tensor: codes (u8) and the scale it was cast with. The value of element i is
// fp8_to_float(data[i]) * scales[0].
struct Fp8Tensor {
  Tensor data;    // u8, contiguous [rows, cols]
  // f32 [2]: {1 / scale, scale}. The dequantisation factor (what cuBLASLt reads through a scale pointer,
  // which must be 16-byte aligned) comes first, at the start of the allocation fp8_cast makes for it.
  Tensor scales;
  Fp8Format format = Fp8Format::E4M3;
};

// Casts x [R, C] (f32 or bf16, any strides) with the scale at `scale` (f32 [1] on x's device): the
// plain copy [R, C] and/or the transposed copy [C, R], in one pass. When `amax` (f32 [1]) is given,
// max(amax, max|x|) is written into it. Not differentiable.
struct Fp8CastResult {
  Fp8Tensor plain, transposed;  // undefined data when not asked for
};
Fp8CastResult fp8_cast(const Tensor& x, const Tensor& scale, Fp8Format format, bool plain, bool transposed,
                       const Tensor& amax = Tensor());
// amax = max(amax, max|x|) (f32 [1]).
void fp8_amax_into(const Tensor& x, const Tensor& amax);
// out [M, N] = (a [M, K] . b [N, K]^T) * a.scales[0] * b.scales[0], rounded to out_dtype (bf16 or f32
// on the CPU, bf16 on CUDA). M, N, K multiples of 16; a and b not both e5m2. fast_accum: cuBLASLt's
// FP8 fast accumulation (no periodic promotion to f32; the forward only); the CPU sums exactly either way.
Tensor fp8_gemm(const Fp8Tensor& a, const Fp8Tensor& b, DType out_dtype, bool fast_accum);
// The values of q as f32 (codes times 1/scale), for tests and debugging.
Tensor fp8_dequantize(const Fp8Tensor& q);

struct Fp8Recipe {
  int64_t amax_history = 16;                // H, >= 1
  int64_t margin = 0;                       // scale divided by 2^margin, >= 0
  Fp8Format grad_format = Fp8Format::E5M2;  // the output gradient's format
  bool fast_accum_forward = true;           // FAST_ACCUM on the forward GEMM only (backward accumulates in f32)
  void validate() const;                    // errors name the field
};

enum class Fp8Role : int64_t { Input = 0, Weight = 1, GradOutput = 2 };

// The delayed-scaling state of `linears` linear layers on one device. Rows are role-major: row
// role * linears + index. Everything lives on the device; nothing here syncs with the host.
class Fp8State {
 public:
  Fp8State(int64_t linears, const Fp8Recipe& recipe, Device device);

  int64_t linears() const { return linears_; }
  const Fp8Recipe& recipe() const { return recipe_; }
  Device device() const { return device_; }
  int64_t row(int64_t index, Fp8Role role) const;
  Fp8Format format(Fp8Role role) const { return role == Fp8Role::GradOutput ? recipe_.grad_format : Fp8Format::E4M3; }
  // False until the first roll: casts scale by their tensor's own amax.
  bool seeded() const { return rolls_ > 0; }
  int64_t rolls() const { return rolls_; }

  // After an optimizer step: every history shifts by one and takes this step's amax (0 when it is not
  // finite or nothing was cast), the running amax resets to 0, scales follow the new histories.
  void roll();
  // A step whose update was not applied (train.nonfinite "skip"): its running amax is dropped (reset
  // to 0); histories, scales and the roll count stay as they were.
  void discard();
  // Back to the state of a fresh object (histories empty, scales 1, unseeded): e.g. after a resume.
  void reset();
  // A checkpoint's state back in place: history [3L, H] and scale [3L] (f32, any device; copied),
  // `rolls` >= 0; the running amax resets to 0. Shapes that do not match this state are an error.
  void load(const Tensor& history, const Tensor& scale, int64_t rolls);

  // Observing (on by default): casts fold their amax into the running amax. Off, linear_fp8 casts with
  // the current scales but leaves the running amax (and so the next roll) untouched: evaluation and
  // sampling forwards run off (Fp8ObserveOff), so they do not change training's scales.
  void set_observing(bool on) { observing_ = on; }
  bool observing() const { return observing_; }

  const Tensor& amax() const { return amax_; }        // f32 [3L]: this step's running max |x|
  const Tensor& history() const { return history_; }  // f32 [3L, H]: newest first
  const Tensor& scale() const { return scale_; }      // f32 [3L]

 private:
  int64_t linears_;
  Fp8Recipe recipe_;
  Device device_;
  int64_t rolls_ = 0;
  bool observing_ = true;
  Tensor amax_, history_, scale_;
};

// Turns a state's observing off for a scope (evaluation, sampling) and restores it after; a null
// state does nothing.
class Fp8ObserveOff {
 public:
  explicit Fp8ObserveOff(Fp8State* state) : state_(state), was_(state && state->observing()) {
    if (state_) state_->set_observing(false);
  }
  ~Fp8ObserveOff() {
    if (state_) state_->set_observing(was_);
  }
  Fp8ObserveOff(const Fp8ObserveOff&) = delete;
  Fp8ObserveOff& operator=(const Fp8ObserveOff&) = delete;

 private:
  Fp8State* state_;
  bool was_;
};

// The cast of a linear's input x [T, K] made before linear_fp8 (by fp8_input_cast, or by the kernel
// that produces x: fp8_producers.h): X8 [Tp, K] and, when made with `transposed`, X8T [K, Tp] (Tp = T
// rounded up to a multiple of 16, zero rows appended), e4m3, cast with the input scale of linear
// `index` of `state` as it was at roll count `rolls`, its amax already folded (while observing).
struct Fp8InputCast {
  Fp8CastResult x8;
  const Fp8State* state = nullptr;
  int64_t index = -1, rolls = -1;
  bool defined() const { return x8.plain.data.defined(); }
};
// Exactly the input cast linear_fp8 makes of x [..., K] for linear `index` (the state's scale once
// seeded, else one from x's own amax; the amax folded while observing). Not differentiable.
Fp8InputCast fp8_input_cast(const Tensor& x, Fp8State& state, int64_t index, bool transposed);
// Whether linear_fp8 over these weights keeps X8T: some weight needs its gradient (grad mode on). The
// `transposed` argument a producer is given for that linear.
bool fp8_input_needs_transposed(const std::vector<Tensor>& weights);

// y = x W^T + bias through FP8 as described at the top; x [..., K], weight [N, K], bias [N] or
// undefined (added after the GEMM, in x's dtype). Uses and updates the state's rows of linear `index`
// (updates only while the state is observing). bf16 on CUDA; bf16 or f32 on the CPU.
// Differentiable in x, weight and bias (the gradients through the FP8 dgrad / wgrad GEMMs).
// x8: x's input cast made beforehand (Fp8InputCast; null or undefined: linear_fp8 casts x itself). It
// must be for this state, linear and roll count and x's token count, with X8T when a weight needs its
// gradient; a mismatch is refused by name. x still carries the gradient (dX flows to it).
Tensor linear_fp8(const Tensor& x, const Tensor& weight, const Tensor& bias, Fp8State& state, int64_t index,
                  const Fp8InputCast* x8 = nullptr);
// Several linears reading one input (q/k/v, gate/up): x is cast once, with the input row of
// indices[0] (the other linears' input rows stay unused), and one X8T serves every weight gradient.
// Each output is what linear_fp8(x, weights[i], biases[i], state, indices[i]) gives with that input
// scale, and records its own tape entry. biases: one per weight (undefined for none) or empty. x8 as
// above, made for indices[0].
std::vector<Tensor> linear_fp8(const Tensor& x, const std::vector<Tensor>& weights, const std::vector<Tensor>& biases,
                               Fp8State& state, const std::vector<int64_t>& indices,
                               const Fp8InputCast* x8 = nullptr);

}  // namespace kestrel
