// FP8 ops (kestrel/ops/fp8.h): argument checks, the delayed-scaling state, and linear_fp8's forward
// and backward GEMMs; swiglu_gate_up_fp8 (kestrel/ops/fp8_producers.h), which shares them. The kernels
// are in cpu/fp8.cpp (exact emulation) and cuda/fp8*.cu.
#include "kestrel/ops/fp8.h"

#include <vector>

#include "src/fp8_input.h"
#include "kernels/activation.h"
#include "kernels/fp8.h"
#include "kestrel/autograd/grad_mode.h"
#include "kestrel/autograd/tape.h"
#include "kestrel/ops/elementwise.h"
#include "kestrel/ops/fp8_producers.h"
#include "kestrel/ops/shape.h"

namespace kestrel {
namespace ag = autograd;

const char* fp8_format_name(Fp8Format f) { return f == Fp8Format::E4M3 ? "e4m3" : "e5m2"; }

Fp8Format parse_fp8_format(const std::string& text, const std::string& key) {
  if (text == "e4m3") return Fp8Format::E4M3;
  if (text == "e5m2") return Fp8Format::E5M2;
  throw make_error("fp8", key, " must be \"e4m3\" or \"e5m2\", got '", text, "'");
}

double fp8_max(Fp8Format f) { return f == Fp8Format::E4M3 ? 448.0 : 57344.0; }

void Fp8Recipe::validate() const {
  KESTREL_CHECK(amax_history >= 1 && amax_history <= 1024, "fp8", "amax_history must be in [1, 1024], got ",
                amax_history);
  KESTREL_CHECK(margin >= 0 && margin <= 32, "fp8", "margin must be in [0, 32], got ", margin);
}

namespace {

void check_scalar(const Tensor& t, Device device, const char* what) {
  KESTREL_CHECK(t.defined() && t.dtype() == DType::F32 && t.numel() == 1 && t.device() == device, "fp8", what,
                " must be an f32 scalar on ", device.str(), ", got ", t.defined() ? t.str() : std::string("undefined"));
}

void check_fp8_operand(const Fp8Tensor& q, const char* what) {
  KESTREL_CHECK(q.data.defined() && q.data.dtype() == DType::U8 && q.data.dim() == 2 && q.data.is_contiguous(), "fp8",
                what, " must be contiguous u8 [rows, cols], got ",
                q.data.defined() ? q.data.str() : std::string("undefined"));
  KESTREL_CHECK(q.scales.defined() && q.scales.dtype() == DType::F32 && q.scales.numel() == 2 &&
                    q.scales.is_contiguous() && q.scales.device() == q.data.device(),
                "fp8", what, "'s scales must be f32 [2] on its device");
}

int64_t round_up16(int64_t n) { return (n + 15) / 16 * 16; }

// The scale a cast of x in role row `row` uses: the state's (delayed) once seeded; before that, one
// computed from x's own amax (a fresh scalar, so every call's snapshot is its own).
Tensor role_scale(const Fp8State& state, int64_t row, Fp8Format format, const Tensor& x) {
  if (state.seeded()) return state.scale().narrow_view(0, row, 1);
  Tensor amax = Tensor::zeros({1}, DType::F32, x.device());
  kernels::dispatch(kernels::fp8_amax, "fp8_amax", x.device(), x, amax);
  Tensor scale = Tensor::full({1}, 1.0, DType::F32, x.device());
  kernels::dispatch(kernels::fp8_scale, "fp8_scale", x.device(), amax.view({1, 1}), scale, fp8_max(format),
                    state.recipe().margin);
  return scale;
}

// The buffers of a cast of [R, C] with Rp output rows (R plus zero padding) and the target that
// writes them: the codes and their scales, {1 / scale, scale} in their own allocation (the
// dequantisation factor first: on CUDA the caching allocator's blocks are 512-byte aligned, so
// scales[0] meets cuBLASLt's 16-byte rule for scale pointers and fp8_gemm passes it as is, no copy
// into an aligned workspace, no extra kernel per GEMM).
struct CastBuffers {
  Fp8CastResult result;
  kernels::Fp8CastTarget target;
};
CastBuffers cast_buffers(int64_t Rp, int64_t C, Device device, const Tensor& scale, Fp8Format format, bool plain,
                         bool transposed, const Tensor& amax) {
  CastBuffers b;
  Tensor scales = Tensor::empty({2}, DType::F32, device);
  if (plain) b.result.plain = {Tensor::empty({Rp, C}, DType::U8, device), scales, format};
  if (transposed) b.result.transposed = {Tensor::empty({C, Rp}, DType::U8, device), scales, format};
  b.target = {b.result.plain.data, b.result.transposed.data, scale, scales, amax, format};
  return b;
}

// Casts x [R, C] (contiguous) into codes of Rp >= R rows (zero rows appended).
Fp8CastResult cast_rows(const Tensor& x, int64_t Rp, const Tensor& scale, Fp8Format format, bool plain,
                        bool transposed, const Tensor& amax) {
  CastBuffers b = cast_buffers(Rp, x.shape()[1], x.device(), scale, format, plain, transposed, amax);
  kernels::dispatch(kernels::fp8_cast, "fp8_cast", x.device(), x, b.target);
  return b.result;
}

// Where a cast folds its amax: the state's running amax of that row while observing, nowhere when not
// (evaluation, sampling: the same casts and GEMMs, the training scales untouched).
Tensor amax_slot(const Fp8State& s, int64_t row) { return s.observing() ? s.amax().narrow_view(0, row, 1) : Tensor(); }

void check_input(const Tensor& x, const Fp8State& state, const char* op) {
  KESTREL_CHECK(x.defined() && x.dim() >= 1 && (x.dtype() == DType::BF16 || x.dtype() == DType::F32), op,
                "x must be bf16 (or f32 on the CPU), got ", x.defined() ? x.str() : std::string("undefined"));
  KESTREL_CHECK(x.device() == state.device(), op, "x on ", x.device().str(), ", state on ", state.device().str());
  KESTREL_CHECK(x.dtype() == DType::BF16 || !x.device().is_cuda(), op,
                "f32 FP8 linears are emulated on the CPU only; on ", x.device().str(), " x must be bf16, got ",
                x.str());
}

// The input cast of linear `index` for x of T rows and K columns with `scale`: buffers of Tp rows.
detail::PendingInputCast pending_cast(Fp8State& state, int64_t index, int64_t T, int64_t K, bool transposed,
                                      const Tensor& scale) {
  const int64_t row = state.row(index, Fp8Role::Input);
  CastBuffers b = cast_buffers(round_up16(std::max<int64_t>(T, 1)), K, state.device(), scale,
                               state.format(Fp8Role::Input), true, transposed, amax_slot(state, row));
  return {b.target, Fp8InputCast{b.result, &state, index, state.rolls()}};
}

}  // namespace

namespace detail {

PendingInputCast pending_input_cast(Fp8State& state, int64_t index, int64_t T, int64_t K, bool transposed) {
  KESTREL_CHECK(state.seeded(), "fp8", "a producer-fused input cast needs a seeded state (scales from a roll)");
  return pending_cast(state, index, T, K, transposed,
                      state.scale().narrow_view(0, state.row(index, Fp8Role::Input), 1));
}

}  // namespace detail

// ---- casts and GEMM ----

Fp8CastResult fp8_cast(const Tensor& x_in, const Tensor& scale, Fp8Format format, bool plain, bool transposed,
                       const Tensor& amax) {
  KESTREL_CHECK(x_in.defined() && x_in.dim() == 2, "fp8_cast", "x must be 2-D, got ",
                x_in.defined() ? x_in.str() : std::string("undefined"));
  KESTREL_CHECK(x_in.dtype() == DType::F32 || x_in.dtype() == DType::BF16, "fp8_cast", "x must be f32 or bf16, got ",
                x_in.str());
  check_scalar(scale, x_in.device(), "scale");
  if (amax.defined()) check_scalar(amax, x_in.device(), "amax");
  Tensor x = x_in.contiguous();
  return cast_rows(x, x.shape()[0], scale, format, plain, transposed, amax);
}

Fp8InputCast fp8_input_cast(const Tensor& x, Fp8State& state, int64_t index, bool transposed) {
  check_input(x, state, "fp8_input_cast");
  const int64_t K = x.shape().back();
  KESTREL_CHECK(K % 16 == 0, "fp8_input_cast", "x ", x.str(),
                ": the features must be a multiple of 16 (cuBLASLt's FP8 leading dimensions)");
  Tensor x2 = (x.dim() == 2 ? x : reshape(x, {-1, K})).detach().contiguous();
  const int64_t row = state.row(index, Fp8Role::Input);
  detail::PendingInputCast p =
      pending_cast(state, index, x2.shape()[0], K, transposed, role_scale(state, row, state.format(Fp8Role::Input), x2));
  kernels::dispatch(kernels::fp8_cast, "fp8_cast", x2.device(), x2, p.target);
  return p.cast;
}

bool fp8_input_needs_transposed(const std::vector<Tensor>& weights) {
  if (!ag::grad_enabled()) return false;
  for (const Tensor& w : weights)
    if (w.defined() && w.requires_grad()) return true;
  return false;
}

void fp8_amax_into(const Tensor& x, const Tensor& amax) {
  KESTREL_CHECK(x.defined() && x.dim() == 2 && (x.dtype() == DType::F32 || x.dtype() == DType::BF16), "fp8_amax",
                "x must be 2-D f32 or bf16, got ", x.defined() ? x.str() : std::string("undefined"));
  check_scalar(amax, x.device(), "amax");
  kernels::dispatch(kernels::fp8_amax, "fp8_amax", x.device(), x.contiguous(), amax);
}

Tensor fp8_gemm(const Fp8Tensor& a, const Fp8Tensor& b, DType out_dtype, bool fast_accum) {
  check_fp8_operand(a, "a");
  check_fp8_operand(b, "b");
  KESTREL_CHECK(a.data.device() == b.data.device(), "fp8_gemm", "device mismatch: ", a.data.str(), " and ",
                b.data.str());
  const int64_t M = a.data.shape()[0], K = a.data.shape()[1], N = b.data.shape()[0];
  KESTREL_CHECK(b.data.shape()[1] == K, "fp8_gemm", "a [", M, ", ", K, "] and b [", N, ", ", b.data.shape()[1],
                "] differ in K (out = a . b^T)");
  KESTREL_CHECK(M % 16 == 0 && N % 16 == 0 && K % 16 == 0, "fp8_gemm",
                "M, N and K must be multiples of 16 (cuBLASLt's FP8 leading dimensions), got M ", M, ", N ", N,
                ", K ", K);
  KESTREL_CHECK(!(a.format == Fp8Format::E5M2 && b.format == Fp8Format::E5M2), "fp8_gemm",
                "a and b cannot both be e5m2 (no such FP8 GEMM)");
  KESTREL_CHECK(out_dtype == DType::BF16 || out_dtype == DType::F32, "fp8_gemm", "output must be bf16 or f32, got ",
                dtype_name(out_dtype));
  Tensor out = Tensor::empty({M, N}, out_dtype, a.data.device());
  kernels::dispatch(kernels::fp8_gemm, "fp8_gemm", out.device(), out, a.data, a.format, a.scales, b.data, b.format,
                    b.scales, fast_accum);
  return out;
}

Tensor fp8_dequantize(const Fp8Tensor& q) {
  check_fp8_operand(q, "q");
  std::vector<uint8_t> codes(static_cast<size_t>(q.data.numel()));
  Tensor host = q.data.to(Device::cpu());
  std::copy(host.data<uint8_t>(), host.data<uint8_t>() + codes.size(), codes.begin());
  const float inv = q.scales.to(Device::cpu()).to_float_vector()[0];
  std::vector<float> v(codes.size());
  for (size_t i = 0; i < v.size(); ++i) v[i] = fp8_to_float(codes[i], q.format) * inv;
  return Tensor::from_vector(v, q.data.shape());
}

// ---- delayed scaling ----

Fp8State::Fp8State(int64_t linears, const Fp8Recipe& recipe, Device device)
    : linears_(linears), recipe_(recipe), device_(device) {
  KESTREL_CHECK(linears > 0, "fp8", "the state needs at least one linear, got ", linears);
  recipe_.validate();
  reset();
}

int64_t Fp8State::row(int64_t index, Fp8Role role) const {
  KESTREL_CHECK(index >= 0 && index < linears_, "fp8", "linear index ", index, " out of range [0, ", linears_, ")");
  return static_cast<int64_t>(role) * linears_ + index;
}

void Fp8State::reset() {
  amax_ = Tensor::zeros({3 * linears_}, DType::F32, device_);
  history_ = Tensor::zeros({3 * linears_, recipe_.amax_history}, DType::F32, device_);
  scale_ = Tensor::full({3 * linears_}, 1.0, DType::F32, device_);
  rolls_ = 0;
}

void Fp8State::discard() { amax_.zero_(); }

void Fp8State::load(const Tensor& history, const Tensor& scale, int64_t rolls) {
  KESTREL_CHECK(history.defined() && history.dtype() == DType::F32 && history.shape() == history_.shape(), "fp8",
                "the saved amax history must be f32 ", history_.str(), " (", linears_, " linears x 3 roles, history ",
                recipe_.amax_history, "), got ", history.defined() ? history.str() : std::string("undefined"));
  KESTREL_CHECK(scale.defined() && scale.dtype() == DType::F32 && scale.shape() == scale_.shape(), "fp8",
                "the saved scales must be f32 ", scale_.str(), ", got ",
                scale.defined() ? scale.str() : std::string("undefined"));
  KESTREL_CHECK(rolls >= 0, "fp8", "the saved roll count must be >= 0, got ", rolls);
  history_.copy_(history.to(device_));
  scale_.copy_(scale.to(device_));
  amax_.zero_();
  rolls_ = rolls;
}

void Fp8State::roll() {
  kernels::dispatch(kernels::fp8_roll, "fp8_roll", device_, history_, amax_);
  // Input and weight rows are e4m3; the gradient rows use the recipe's format.
  const int64_t L = linears_;
  kernels::dispatch(kernels::fp8_scale, "fp8_scale", device_, history_.narrow_view(0, 0, 2 * L),
                    scale_.narrow_view(0, 0, 2 * L), fp8_max(Fp8Format::E4M3), recipe_.margin);
  kernels::dispatch(kernels::fp8_scale, "fp8_scale", device_, history_.narrow_view(0, 2 * L, L),
                    scale_.narrow_view(0, 2 * L, L), fp8_max(recipe_.grad_format), recipe_.margin);
  ++rolls_;
}

// ---- linear ----

namespace {

// linear_fp8's input side for several weights reading one input: the checks and the input's cast.
struct Fp8LinearInput {
  Tensor x2;                    // x as [T, K]
  int64_t T = 0, Tp = 0;        // tokens, and rounded up to 16 (the GEMMs' rows)
  Fp8CastResult x8;             // X8 [Tp, K], X8T [K, Tp] when any_gw
  bool any_gw = false;          // some weight needs its gradient (grad mode on)
};

Fp8LinearInput fp8_linear_input(const Tensor& x, const std::vector<Tensor>& weights,
                                    const std::vector<Tensor>& biases, Fp8State& state,
                                    const std::vector<int64_t>& indices, const Fp8InputCast* x8_in, const char* op) {
  KESTREL_CHECK(!weights.empty() && indices.size() == weights.size() &&
                    (biases.empty() || biases.size() == weights.size()),
                op, "needs one index per weight (and one bias per weight, or none), got ", weights.size(),
                " weights, ", indices.size(), " indices, ", biases.size(), " biases");
  check_input(x, state, op);
  const DType dt = x.dtype();
  const int64_t K = x.shape().back();
  for (size_t i = 0; i < weights.size(); ++i) {
    const Tensor& w = weights[i];
    KESTREL_CHECK(w.dim() == 2 && w.shape()[1] == K, op, "weight must be [out, ", K, "] for input ", x.str(),
                  ", got ", w.str());
    KESTREL_CHECK(w.dtype() == dt && w.device() == x.device(), op,
                  "x and weight must both be bf16 (or f32 on the CPU) on one device, got ", x.str(), " and ", w.str());
    KESTREL_CHECK(K % 16 == 0 && w.shape()[0] % 16 == 0, op, "weight ", w.str(),
                  ": in and out features must be multiples of 16 (cuBLASLt's FP8 leading dimensions)");
    state.row(indices[i], Fp8Role::Input);  // range check, naming the index
    if (!biases.empty() && biases[i].defined())
      KESTREL_CHECK(biases[i].dim() == 1 && biases[i].shape()[0] == w.shape()[0] && biases[i].dtype() == dt, op,
                    "bias must be ", dtype_name(dt), " [", w.shape()[0], "], got ", biases[i].str());
  }
  Fp8LinearInput f;
  f.x2 = x.dim() == 2 ? x : reshape(x, {-1, K});
  f.T = f.x2.shape()[0];
  f.Tp = round_up16(std::max<int64_t>(f.T, 1));
  // The input is cast once, with the first linear's input row; X8T is kept when any weight needs
  // its gradient, and shared by their backward closures. (any_gw is fp8_input_needs_transposed: for a
  // weight that requires grad, should_record({x2, w}) is grad mode.)
  for (const Tensor& w : weights) f.any_gw = f.any_gw || (w.requires_grad() && ag::should_record({f.x2, w}));
  if (x8_in && x8_in->defined()) {  // made by x's producer (or fp8_input_cast) with this linear's input row
    KESTREL_CHECK(x8_in->state == &state && x8_in->index == indices[0], op, "the input cast was made for ",
                  "linear ", x8_in->index, " of ", x8_in->state == &state ? "this" : "another", " FP8 state; this ",
                  "call casts with the input row of linear ", indices[0], " of its state");
    KESTREL_CHECK(x8_in->rolls == state.rolls(), op, "the input cast was made at roll ", x8_in->rolls,
                  ", the state has rolled since (now ", state.rolls(), "): its scale is stale");
    const Tensor& p = x8_in->x8.plain.data;
    KESTREL_CHECK(p.dim() == 2 && p.shape()[0] == f.Tp && p.shape()[1] == K, op, "the input cast's codes ", p.str(),
                  " do not fit x ", x.str(), " (expected [", f.Tp, ", ", K, "])");
    KESTREL_CHECK(!f.any_gw || x8_in->x8.transposed.data.defined(), op, "a weight needs its gradient but "
                  "the input cast has no transposed copy (make it with fp8_input_needs_transposed(weights))");
    f.x8 = x8_in->x8;
  } else {
    f.x8 = fp8_input_cast(f.x2, state, indices[0], f.any_gw).x8;
  }
  return f;
}

// One weight's forward GEMM: W8 cast with the state's weight row, Y [T, N] = X8 . W8^T. Returns y and
// the W8 cast's scales (the backward's W8T is cast with them); wd: the weight, detached, contiguous.
struct Fp8WeightForward {
  Tensor y, wd, w_scales;
};
Fp8WeightForward fp8_weight_forward(const Fp8LinearInput& in, const Tensor& weight, Fp8State& state, int64_t index) {
  const Fp8Format fw = state.format(Fp8Role::Weight);
  const int64_t N = weight.shape()[0], rw = state.row(index, Fp8Role::Weight);
  Fp8WeightForward f{Tensor(), weight.detach().contiguous(), Tensor()};
  Fp8CastResult w8 = cast_rows(f.wd, N, role_scale(state, rw, fw, f.wd), fw, true, false, amax_slot(state, rw));
  f.y = fp8_gemm(in.x8.plain, w8.plain, in.x2.dtype(), state.recipe().fast_accum_forward);  // [Tp, N]
  if (in.Tp != in.T) f.y = f.y.narrow_view(0, 0, in.T).contiguous();
  f.w_scales = w8.plain.scales;
  return f;
}

// One weight's backward GEMMs from its output gradient's cast g8 (plain when dx is wanted,
// transposed when dw is): dx [T, K] = dY8 . W8T^T with W8T cast from the bf16 weight with the
// forward's scale (the weight has not changed since), dw [N, K] = dY8T . X8T^T.
void fp8_linear_grads(const Fp8CastResult& g8, const Tensor& wd, const Tensor& w_scales, Fp8Format fw,
                      const Fp8Tensor& xt, DType dt, int64_t T, int64_t Tp, bool gx, bool gw, Tensor& dx, Tensor& dw) {
  if (gx) {
    Fp8CastResult wt = cast_rows(wd, wd.shape()[0], w_scales.narrow_view(0, 1, 1), fw, false, true, Tensor());
    dx = fp8_gemm(g8.plain, wt.transposed, dt, false);  // [Tp, K]
    if (Tp != T) dx = dx.narrow_view(0, 0, T).contiguous();
  }
  if (gw) dw = fp8_gemm(g8.transposed, xt, dt, false);  // [N, K]
}

}  // namespace

std::vector<Tensor> linear_fp8(const Tensor& x, const std::vector<Tensor>& weights, const std::vector<Tensor>& biases,
                               Fp8State& state, const std::vector<int64_t>& indices, const Fp8InputCast* x8_in) {
  const Fp8LinearInput in = fp8_linear_input(x, weights, biases, state, indices, x8_in, "linear_fp8");
  const Fp8Format fw = state.format(Fp8Role::Weight), fg = state.format(Fp8Role::GradOutput);
  const DType dt = x.dtype();
  const int64_t T = in.T, Tp = in.Tp;
  const Tensor x2 = in.x2;
  Fp8State* st = &state;  // owned by the model, which outlives its tape
  std::vector<Tensor> outs;
  for (size_t i = 0; i < weights.size(); ++i) {
    const Tensor& weight = weights[i];
    const int64_t N = weight.shape()[0];
    const int64_t rg = state.row(indices[i], Fp8Role::GradOutput);
    const bool record = ag::should_record({x2, weight});
    const bool gx = record && x2.requires_grad(), gw = record && weight.requires_grad();
    Fp8WeightForward wf = fp8_weight_forward(in, weight, state, indices[i]);
    Tensor y = wf.y;
    if (record) {
      Fp8Tensor xt = gw ? in.x8.transposed : Fp8Tensor{};  // [K, Tp], the only activation kept
      ag::record("linear_fp8", {x2, weight}, y,
                 [=, wd = wf.wd, w_scales = wf.w_scales](const std::vector<Tensor>& g) -> std::vector<Tensor> {
                   Tensor go = g[0].detach().contiguous();  // [T, N]; the cast appends the zero rows up to Tp
                   Fp8CastResult g8 = cast_rows(go, Tp, role_scale(*st, rg, fg, go), fg, gx, gw, amax_slot(*st, rg));
                   Tensor dx, dw;
                   fp8_linear_grads(g8, wd, w_scales, fw, xt, dt, T, Tp, gx, gw, dx, dw);
                   return {dx, dw};
                 });
    }
    if (!biases.empty() && biases[i].defined()) y = add(y, biases[i]);
    Shape out_shape = x.shape();
    out_shape.back() = N;
    outs.push_back(x.dim() == 2 ? y : reshape(y, out_shape));
  }
  return outs;
}

Fp8Produced swiglu_gate_up_fp8(const Tensor& x, const Tensor& gate_w, const Tensor& up_w, Fp8State& state,
                               int64_t gate_index, int64_t up_index, int64_t down_index, bool down_transposed,
                               const Fp8InputCast* x8) {
  constexpr const char* kOp = "swiglu_gate_up_fp8";
  KESTREL_CHECK(gate_w.defined() && up_w.defined() && gate_w.dim() == 2 && gate_w.shape() == up_w.shape(), kOp,
                "gate and up weights must be [I, C] of one shape, got ", gate_w.defined() ? gate_w.str() : "undefined",
                " and ", up_w.defined() ? up_w.str() : "undefined");
  state.row(down_index, Fp8Role::Input);  // range check, naming the index
  const Fp8LinearInput in = fp8_linear_input(x, {gate_w, up_w}, {}, state, {gate_index, up_index}, x8, kOp);
  Fp8WeightForward wg = fp8_weight_forward(in, gate_w, state, gate_index);
  Fp8WeightForward wu = fp8_weight_forward(in, up_w, state, up_index);
  Fp8Produced out;
  {
    ag::NoGradGuard no_grad;  // this op's own entry below stands for the two linears and SwiGLU
    out = swiglu_fp8(wg.y, wu.y, state, down_index, down_transposed);
  }
  const Tensor x2 = in.x2;
  if (!ag::should_record({x2, gate_w, up_w})) return out;
  const bool gx = x2.requires_grad(), gwg = gate_w.requires_grad(), gwu = up_w.requires_grad();
  const Fp8Format fw = state.format(Fp8Role::Weight), fgr = state.format(Fp8Role::GradOutput);
  const int64_t rgg = state.row(gate_index, Fp8Role::GradOutput), rgu = state.row(up_index, Fp8Role::GradOutput);
  const int64_t T = in.T, Tp = in.Tp, I = gate_w.shape()[0];
  const DType dt = x.dtype();
  const Fp8Tensor xt = (gwg || gwu) ? in.x8.transposed : Fp8Tensor{};  // [C, Tp], shared by both wgrads
  Fp8State* st = &state;  // owned by the model, which outlives its tape
  ag::record(kOp, {x2, gate_w, up_w}, out.y,
             [=, gd = wg.y.detach(), ud = wu.y.detach(), wdg = wg.wd, wdu = wu.wd, sg = wg.w_scales,
              su = wu.w_scales](const std::vector<Tensor>& g) -> std::vector<Tensor> {
               const Tensor dy = g[0].dtype() == gd.dtype() ? g[0].detach().contiguous() : g[0].detach().to(gd.dtype());
               const Device dev = gd.device();
               Fp8CastResult g8g, g8u;
               bool fused = false;
               // Once seeded, the casts' scales are known before dgate / dup exist: one pass computes
               // both and writes their codes (no 16-bit gradient stored). The same layouts for both.
               const auto& slot = kernels::swiglu_fp8_backward;
               if (st->seeded() && gwg == gwu && (gx || gwg) && T > 0 && (dev.is_cuda() ? slot.cuda : slot.cpu)) {
                 CastBuffers bg = cast_buffers(Tp, I, dev, st->scale().narrow_view(0, rgg, 1), fgr, gx, gwg,
                                               amax_slot(*st, rgg));
                 CastBuffers bu = cast_buffers(Tp, I, dev, st->scale().narrow_view(0, rgu, 1), fgr, gx, gwu,
                                               amax_slot(*st, rgu));
                 fused = kernels::dispatch(slot, kOp, dev, bg.target, bu.target, gd, ud, dy);
                 if (fused) g8g = bg.result, g8u = bu.result;
               }
               if (!fused) {  // SwiGLU's backward, then each gradient's cast as linear_fp8's backward makes it
                 Tensor dg = Tensor::empty(gd.shape(), gd.dtype(), dev), du = Tensor::empty(gd.shape(), gd.dtype(), dev);
                 if (dg.numel() > 0) kernels::dispatch(kernels::swiglu_backward, kOp, dev, dg, du, gd, ud, dy);
                 if (gx || gwg) g8g = cast_rows(dg, Tp, role_scale(*st, rgg, fgr, dg), fgr, gx, gwg, amax_slot(*st, rgg));
                 dg = Tensor();
                 if (gx || gwu) g8u = cast_rows(du, Tp, role_scale(*st, rgu, fgr, du), fgr, gx, gwu, amax_slot(*st, rgu));
               }
               Tensor dxg, dwg, dxu, dwu;
               fp8_linear_grads(g8u, wdu, su, fw, xt, dt, T, Tp, gx, gwu, dxu, dwu);
               fp8_linear_grads(g8g, wdg, sg, fw, xt, dt, T, Tp, gx, gwg, dxg, dwg);
               return {gx ? add(dxu, dxg) : Tensor(), dwg, dwu};
             });
  return out;
}

Tensor linear_fp8(const Tensor& x, const Tensor& weight, const Tensor& bias, Fp8State& state, int64_t index,
                  const Fp8InputCast* x8) {
  return linear_fp8(x, std::vector<Tensor>{weight}, std::vector<Tensor>{bias}, state, std::vector<int64_t>{index},
                    x8)[0];
}

}  // namespace kestrel
