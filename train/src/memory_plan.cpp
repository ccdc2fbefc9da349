// The memory planner (see memory_plan.h): a replay of one optimizer step's allocations, block by
// block, on a ledger of bytes per tag. Each model piece below mirrors the code it stands for
// (models/src/{vision,vlm,decoder}.cpp and the tape entries of ops/src/*); when that code changes
// what it allocates or saves, change the matching lines here and the plan-vs-profile test says so.
#include "kestrel/train/memory_plan.h"

#include <algorithm>
#include <cstdio>
#include <deque>
#include <sstream>

#include "kestrel/autograd/recompute.h"
#include "kestrel/models/config.h"
#include "kestrel/models/decoder.h"
#include "kestrel/runtime/dtype.h"
#include "kestrel/runtime/error.h"
#include "kestrel/runtime/memory_budget.h"
#include "kestrel/train/optimizer.h"
#include "kestrel/train/run_config.h"
#include "kestrel/train/image_tiling.h"
#include "kestrel/train/shapes_dataset.h"
#include "kestrel/train/tokenizer.h"
#include "memory_plan_workspace.h"
#include "param_groups.h"
#include "vlm_init.h"

namespace kestrel::train {

using nlohmann::json;
using autograd::RecomputePolicy;
using namespace plan_detail;

namespace {

constexpr MemoryTag kAct = MemoryTag::Activation, kGrad = MemoryTag::Gradient;

// Bytes per tag now and at peak, and the peak of their sum.
struct Ledger {
  std::array<int64_t, kNumMemoryTags> cur{}, peak{};
  int64_t in_use = 0, peak_in_use = 0;
  std::string where, peak_where;
  void alloc(MemoryTag t, int64_t b) {
    cur[static_cast<int>(t)] += b;
    in_use += b;
    peak[static_cast<int>(t)] = std::max(peak[static_cast<int>(t)], cur[static_cast<int>(t)]);
    if (in_use > peak_in_use) {
      peak_in_use = in_use;
      peak_where = where;
    }
  }
  void free(MemoryTag t, int64_t b) {
    cur[static_cast<int>(t)] -= b;
    in_use -= b;
  }
};

struct Shapes {
  int64_t b = 4;   // bytes per element of the model dtype
  int64_t T = 0;   // text tokens of the micro-batch
  int64_t B = 0;   // images
  int64_t Tv = 0;  // vision tokens = B * patches
  int64_t Ti = 0;  // image tokens after the pixel shuffle
};

// One decoder layer's forward with its tape (policy None, or the re-run of a region in backward).
// Returns the bytes of what stays saved; `h_in` is the layer input (already live).
struct LayerCosts {
  int64_t saved = 0;  // everything the layer's entries keep until backward (output included)
};

class Planner {
 public:
  Planner(const models::VlmConfig& mc, const Shapes& s, RecomputePolicy policy, bool cuda, int64_t mlp_tile)
      : cuda_(cuda), mlp_tile_(mlp_tile), mc_(mc), s_(s), policy_(policy) {
    const auto& tc = mc.text_config;
    C_ = tc.hidden_size, I_ = tc.intermediate_size, D_ = tc.head_dim, Hq_ = tc.num_attention_heads,
    Hkv_ = tc.num_key_value_heads, V_ = tc.vocab_size, L_ = tc.num_hidden_layers;
    const auto& vc = mc.vision_config;
    E_ = vc.hidden_size, IV_ = vc.intermediate_size, HV_ = vc.num_attention_heads, LV_ = vc.num_hidden_layers;
  }
  Ledger led;
  // train.trainable (param_groups.h): a frozen parameter gets no gradient; `layer_` / `vision_layer_`
  // name the block being replayed.
  std::function<bool(const std::string&)> trains = [](const std::string&) { return true; };
  std::string text_prefix;  // "language_model." in the VLM
  int64_t layer_ = 0, vision_layer_ = 0;
  int64_t tb(const std::string& suffix, int64_t bytes) const {  // a decoder layer parameter's gradient bytes
    return trains(text_prefix + "model.layers." + std::to_string(layer_) + "." + suffix) ? bytes : 0;
  }
  int64_t vb(const std::string& module, int64_t weight_bytes, int64_t bias_bytes) const {  // a vision module's
    const std::string p = "vision_tower.vision_model.encoder.layers." + std::to_string(vision_layer_) + "." + module;
    return (trains(p + ".weight") ? weight_bytes : 0) + (trains(p + ".bias") ? bias_bytes : 0);
  }
  // Selective recompute (models::LayerRecompute::Selective): each decoder region also keeps its
  // attention output and lse from the forward (tag Activation, or Checkpoint once restored from the
  // host under offload); the re-run reuses them instead of allocating new ones.
  bool selective_ = false;
  MemoryTag kept_tag_ = MemoryTag::Activation;
  int64_t attention_kept_bytes() const { return s_.T * Hq_ * D_ * s_.b + s_.T * Hq_ * 4; }
  const bool cuda_;  // CUDA kernels: their Workspace buffers (memory_plan_workspace.h) instead of the CPU's scratch
  const int64_t mlp_tile_;  // the decoder MLP's token tile (0: untiled linear/swiglu ops)

  // A kernel's scratch, freed when the kernel returns (CUDA only: the CPU kernels' scratch is modelled inline).
  void workspace(int64_t bytes) {
    if (!cuda_) return;
    led.alloc(MemoryTag::Workspace, bytes);
    led.free(MemoryTag::Workspace, bytes);
  }

  // --- FP8 projections (fp8.enabled: kestrel/ops/fp8.h, linear_fp8 in ops/src/fp8.cpp) ---
  // Each projection keeps X8T [K, Tp] (1 byte per element, T padded to a multiple of 16) and the f32
  // {1/scale, scale} pairs of its input and weight casts instead of a bf16 input; the casts' plain
  // copies, the weights' W8 / W8T and the output gradient's casts live only inside the op.
  bool fp8_ = false;
  static constexpr int64_t kFp8Scales = 8;  // an Fp8Tensor's f32 [2]
  int64_t Tp() const { return (s_.T + 15) / 16 * 16; }
  // What linear_fp8 keeps for backward: X8T of its input and the scales of that cast and of each weight's.
  int64_t fp8_kept(int64_t K, int64_t weights) const { return K * Tp() + kFp8Scales * (1 + weights); }
  // linear_fp8(x [T, K], weights [N_i, K]) forward: x padded to Tp rows (a copy when T is not a multiple
  // of 16) and cast once (X8 [Tp, K], and X8T [K, Tp] when recording); per weight its cast W8 [N, K],
  // the GEMM's [Tp, N] (narrowed into a [T, N] copy when padded; the bias added out of place), W8 gone
  // after the GEMM; X8 and the padded copy go when the call returns. The outputs stay; recording keeps
  // fp8_kept(K, weights).
  void fp8_linear_forward(MemoryTag tag, int64_t K, std::initializer_list<int64_t> Ns, bool record, bool bias) {
    const int64_t T = s_.T, Tp = this->Tp(), b = s_.b, pad = T != Tp ? Tp * K * b : 0;
    led.alloc(tag, pad);
    led.alloc(tag, kFp8Scales + Tp * K + (record ? K * Tp : 0));
    for (int64_t N : Ns) {
      led.alloc(tag, kFp8Scales + N * K);  // W8 and its scales (kept by the backward closure)
      led.alloc(tag, Tp * N * b);           // the GEMM's output
      if (T != Tp) {
        led.alloc(tag, T * N * b);
        led.free(tag, Tp * N * b);
      }
      if (bias) {
        led.alloc(tag, T * N * b);
        led.free(tag, T * N * b);
      }
      led.free(tag, N * K + (record ? 0 : kFp8Scales));
    }
    led.free(tag, pad + Tp * K + (record ? 0 : kFp8Scales));
  }
  // linear_fp8's backward of one weight [N, K], live while its GEMMs write dx [T, K] and dW [N, K] (which
  // the caller allocates as for a bf16 linear): dY padded to Tp rows (a copy when padded) and cast
  // plain (dgrad) and transposed (wgrad) with its scales, W8T [K, N] re-cast with its scales, and the
  // [Tp, K] dx before its narrowed copy when padded.
  int64_t fp8_backward_scratch(int64_t N, int64_t K) const {
    const int64_t T = s_.T, Tp = this->Tp(), b = s_.b;
    return (T != Tp ? Tp * N * b + Tp * K * b : 0) + 2 * kFp8Scales + 2 * Tp * N + K * N;
  }
  // A projection's backward: dx and dW (allocated by `body`) with the FP8 scratch around them.
  template <typename Body>
  void projection_backward(int64_t N, int64_t K, Body&& body) {
    const int64_t scratch = fp8_ ? fp8_backward_scratch(N, K) : 0;
    led.alloc(kGrad, scratch);
    body();
    led.free(kGrad, scratch);
  }

  // --- decoder layer (models/src/decoder.cpp: layer_forward) ---
  // Forward with recording: allocations in order; the saved set stays.
  void decoder_layer_forward_recorded(MemoryTag tag, bool rerun = false) {
    if (fp8_) return decoder_layer_forward_recorded_fp8(tag, rerun);
    const int64_t T = s_.T, b = s_.b;
    const bool reuse_attention = rerun && selective_;  // a selective re-run takes the kept out and lse
    led.alloc(tag, T * C_ * b + T * 4);              // rms_norm y, rstd (saved)
    led.alloc(tag, T * Hq_ * D_ * b);                // q linear (freed by rope)
    led.alloc(tag, 2 * T * Hkv_ * D_ * b);           // k, v linear (v saved by attention)
    led.alloc(tag, T * Hq_ * D_ * b);                // rope(q) saved
    led.free(tag, T * Hq_ * D_ * b);                 // pre-rope q released
    led.alloc(tag, T * Hkv_ * D_ * b);               // rope(k) saved
    led.free(tag, T * Hkv_ * D_ * b);                // pre-rope k released
    if (!reuse_attention) led.alloc(tag, T * Hq_ * D_ * b + T * Hq_ * 4);  // attention out, lse (saved)
    led.alloc(tag, T * C_ * b);                      // o_proj out (transient)
    led.alloc(tag, 2 * T * C_ * b + T * 4);          // add_rms_norm y, h, rstd (saved)
    led.free(tag, T * C_ * b);                       // o_proj out released
    if (mlp_tile_ > 0) {
      led.alloc(tag, T * C_ * b);                    // the tiled MLP's output (its entry saves only y)
      tile_scratch(tag, 3);                          // gate, up, product of one tile
    } else {
      led.alloc(tag, 3 * T * I_ * b);                // gate, up, swiglu (saved)
      led.alloc(tag, T * C_ * b);                    // down out (transient)
    }
    led.alloc(tag, T * C_ * b);                      // layer output (saved by the next consumer)
    led.free(tag, T * C_ * b);                       // down out released
  }
  // The same with FP8 projections (the tiled MLP is refused with fp8): the norm outputs and the SwiGLU
  // product are no longer kept (only their casts' X8T), the attention output keeps o_proj's X8T too.
  void decoder_layer_forward_recorded_fp8(MemoryTag tag, bool rerun) {
    const int64_t T = s_.T, b = s_.b, Q = T * Hq_ * D_ * b, Kv = T * Hkv_ * D_ * b;
    const bool reuse_attention = rerun && selective_;
    const auto& tc = mc_.text_config;
    led.alloc(tag, T * C_ * b + T * 4);  // rms_norm y (until the attention block ends), rstd (saved)
    fp8_linear_forward(tag, C_, {Hq_ * D_, Hkv_ * D_, Hkv_ * D_}, true, tc.qkv_bias());  // q, k, v
    led.alloc(tag, Q);                   // rope(q) saved
    led.free(tag, Q);                    // pre-rope q released
    led.alloc(tag, Kv);                  // rope(k) saved
    led.free(tag, Kv);                   // pre-rope k released
    if (!reuse_attention) led.alloc(tag, attention_kept_bytes());  // attention out, lse (saved)
    fp8_linear_forward(tag, Hq_ * D_, {C_}, true, tc.o_proj_bias());  // o_proj out (transient)
    led.free(tag, T * C_ * b);           // the block's norm output: nothing keeps it
    led.alloc(tag, 2 * T * C_ * b + T * 4);  // add_rms_norm y (until the layer returns), h, rstd (saved)
    led.free(tag, T * C_ * b);           // o_proj out released
    fp8_linear_forward(tag, C_, {I_, I_}, true, false);  // gate, up (saved by swiglu)
    led.alloc(tag, T * I_ * b);          // swiglu
    fp8_linear_forward(tag, I_, {C_}, true, false);  // down out (transient)
    led.free(tag, T * I_ * b);           // swiglu out: only its cast is kept
    led.alloc(tag, T * C_ * b);          // layer output (saved by the next consumer)
    led.free(tag, 2 * T * C_ * b);       // down out, y
  }
  int64_t decoder_layer_saved_fp8() const {
    const int64_t T = s_.T, b = s_.b, Q = T * Hq_ * D_ * b, Kv = T * Hkv_ * D_ * b;
    return T * 4 + fp8_kept(C_, 3) + Q + 2 * Kv + attention_kept_bytes() + fp8_kept(Hq_ * D_, 1) + T * C_ * b +
           T * 4 + fp8_kept(C_, 2) + 2 * T * I_ * b + fp8_kept(I_, 1) + T * C_ * b;
  }
  void decoder_layer_forward_nograd_fp8() {
    const int64_t T = s_.T, b = s_.b, Q = T * Hq_ * D_ * b, Kv = T * Hkv_ * D_ * b;
    const auto& tc = mc_.text_config;
    led.alloc(kAct, T * C_ * b + T * 4);  // norm y, rstd
    fp8_linear_forward(kAct, C_, {Hq_ * D_, Hkv_ * D_, Hkv_ * D_}, false, tc.qkv_bias());
    led.alloc(kAct, Q);  // rope(q) while the pre-rope q is alive
    led.free(kAct, Q);
    led.alloc(kAct, Kv);
    led.free(kAct, Kv);
    led.alloc(kAct, attention_kept_bytes());  // attention out, lse
    fp8_linear_forward(kAct, Hq_ * D_, {C_}, false, tc.o_proj_bias());  // o_proj out (stays)
    // The attention block's locals (selective: out and lse stay).
    led.free(kAct, T * C_ * b + T * 4 + Q + 2 * Kv + (selective_ ? 0 : attention_kept_bytes()));
    led.alloc(kAct, 2 * T * C_ * b + T * 4);  // y, h, rstd
    fp8_linear_forward(kAct, C_, {I_, I_}, false, false);  // gate, up
    led.alloc(kAct, T * I_ * b);              // swiglu
    fp8_linear_forward(kAct, I_, {C_}, false, false);  // down
    led.alloc(kAct, T * C_ * b);              // output
    led.free(kAct, T * C_ * b + 2 * T * C_ * b + T * 4 + 3 * T * I_ * b + T * C_ * b);
  }
  // swiglu_mlp_tiled's [tile, I] buffers (ops/src/mlp.cpp), allocated and freed around its tile loop.
  void tile_scratch(MemoryTag tag, int buffers) {
    const int64_t bytes = buffers * std::min(mlp_tile_, s_.T) * I_ * s_.b;
    led.alloc(tag, bytes);
    led.free(tag, bytes);
  }
  int64_t decoder_layer_saved() const {
    if (fp8_) return decoder_layer_saved_fp8();
    const int64_t T = s_.T, b = s_.b;
    return T * C_ * b + T * 4 + T * Hq_ * D_ * b + 2 * T * Hkv_ * D_ * b + T * Hq_ * D_ * b + T * Hq_ * 4 +
           2 * T * C_ * b + T * 4 + (mlp_tile_ > 0 ? 0 : 3 * T * I_ * b) + T * C_ * b;
  }
  // Forward of a region without recording (no-grad): locals die with their scopes.
  void decoder_layer_forward_nograd() {
    if (fp8_) return decoder_layer_forward_nograd_fp8();
    const int64_t T = s_.T, b = s_.b;
    int64_t attn = T * C_ * b + T * 4 + T * Hq_ * D_ * b + 2 * T * Hkv_ * D_ * b;
    led.alloc(kAct, attn);
    led.alloc(kAct, T * Hq_ * D_ * b);  // rope(q) while the pre-rope q is alive
    led.free(kAct, T * Hq_ * D_ * b);
    led.alloc(kAct, T * Hkv_ * D_ * b);
    led.free(kAct, T * Hkv_ * D_ * b);
    led.alloc(kAct, T * Hq_ * D_ * b + T * Hq_ * 4 + T * C_ * b);  // attention out, lse, o_proj out
    int64_t attn_live = attn + (selective_ ? 0 : attention_kept_bytes());
    led.free(kAct, attn_live);  // the attention block's locals (o_proj out stays; selective: out and lse too)
    const int64_t mlp = mlp_tile_ > 0 ? 0 : 3 * T * I_ * b;  // gate, up, swiglu (untiled)
    led.alloc(kAct, 2 * T * C_ * b + T * 4 + mlp + T * C_ * b);  // y, h, rstd, [gate, up, swiglu,] down
    if (mlp_tile_ > 0) tile_scratch(kAct, 3);
    led.alloc(kAct, T * C_ * b);  // output
    led.free(kAct, T * C_ * b + 2 * T * C_ * b + T * 4 + mlp + T * C_ * b);
  }
  // Backward through one recorded layer; `g` [T, C] arrives (live), the layer input's gradient
  // leaves (live). Frees the layer's saved tensors and allocates its parameter gradients.
  int64_t layer_param_grads = 0;  // parameter gradients of the last decoder layer's backward
  void decoder_layer_backward(bool params_first_time, bool free_input) {
    layer_param_grads = 0;
    const int64_t T = s_.T, b = s_.b, TC = T * C_ * b, TI = T * I_ * b;
    // The first micro-batch's parameter gradients stay (they become .grad); later ones are added into
    // them and go at once.
    auto pgrad = [&](int64_t bytes) {  // 0: a frozen parameter (no gradient)
      led.alloc(kGrad, bytes);
      if (!params_first_time) led.free(kGrad, bytes);
      else layer_param_grads += bytes;  // optimizer.step_in_backward drops them after the layer
    };
    // In a region's backward the incoming gradient stays referenced by the closure until it
    // returns, and the region input is a leaf of the inner tape: its first gradient is a clone,
    // later ones are added in place.
    const bool region = !free_input;
    if (mlp_tile_ > 0) {
      // add(h2, m): both get g. swiglu_mlp_tiled: d_down, d_gate, d_up (added in place into held
      // gradients), dx [T, C], and five [tile, I] buffers while it walks the tiles.
      pgrad(tb("mlp.down_proj.weight", C_ * I_ * b));
      pgrad(tb("mlp.gate_proj.weight", I_ * C_ * b));
      pgrad(tb("mlp.up_proj.weight", I_ * C_ * b));
      led.alloc(kGrad, TC);
      tile_scratch(kGrad, 5);
      led.free(kAct, TC);  // y (saved by the tiled MLP)
    } else {
      // add(h2, m): both get g (no copy). down linear: dx [T, I], dW.
      projection_backward(C_, I_, [&] {
        led.alloc(kGrad, TI);
        pgrad(tb("mlp.down_proj.weight", C_ * I_ * b));
      });
      led.free(kAct, fp8_ ? fp8_kept(I_, 1) : TI);  // the down entry's saved input (swiglu out, or its X8T)
      // swiglu: dg, du; the incoming dx goes, then gate and up.
      led.alloc(kGrad, 2 * TI);
      led.free(kGrad, TI);
      led.free(kAct, 2 * TI);
      // up linear: dx [T, C], dW; gate linear: dx, dW; the second is accumulated out of place.
      projection_backward(I_, C_, [&] {
        led.alloc(kGrad, TC);
        pgrad(tb("mlp.up_proj.weight", I_ * C_ * b));
      });
      led.free(kGrad, TI);
      projection_backward(I_, C_, [&] {
        led.alloc(kGrad, TC);
        pgrad(tb("mlp.gate_proj.weight", I_ * C_ * b));
      });
      led.free(kGrad, TI);
      led.alloc(kGrad, TC);  // clone + add
      led.free(kGrad, 2 * TC);
      led.free(kAct, fp8_ ? fp8_kept(C_, 2) : TC);  // y (saved by the gate/up linears), or its X8T
    }
    // add_rms_norm: dh, dw; gy and g are released; h2 and rstd go.
    led.alloc(kGrad, TC);
    pgrad(tb("post_attention_layernorm.weight", C_ * b));
    workspace(cuda_norm_backward_workspace_bytes(T, C_, 1));
    led.free(kGrad, TC);  // gy
    if (!region) led.free(kGrad, TC);  // g (the layer output's gradient)
    led.free(kAct, TC + T * 4);  // h2, rstd
    if (region) led.alloc(kGrad, TC);  // the region input's gradient (a clone of d)
    // o_proj: dx [T, Hq*D], dW. attention: dq, dk, dv; saved q, k, v, out, lse go.
    const int64_t Q = T * Hq_ * D_ * b, K = T * Hkv_ * D_ * b;
    projection_backward(C_, Hq_ * D_, [&] {
      led.alloc(kGrad, Q);
      pgrad(tb("self_attn.o_proj.weight", C_ * Hq_ * D_ * b));
    });
    if (fp8_) led.free(kAct, fp8_kept(Hq_ * D_, 1));  // o_proj's X8T (attention keeps its own out)
    if (region) led.free(kGrad, TC);  // d, consumed by o_proj
    if (cuda_) {
      led.alloc(kGrad, Q + 2 * K);
      workspace(cuda_attention_backward_workspace_bytes(T, Hq_, D_));
    } else {
      led.alloc(kGrad, T * Hq_ * 4);  // attention backward row statistics (CPU kernel)
      led.alloc(kGrad, Q + 2 * K);
      led.free(kGrad, T * Hq_ * 4);
    }
    led.free(kGrad, Q);
    led.free(kAct, Q + 2 * K);                  // q, k, v
    led.free(selective_ ? kept_tag_ : kAct, Q + T * Hq_ * 4);  // out, lse
    // rope backward (k then q), v/k/q linears: dx each [T, C], accumulated out of place.
    led.alloc(kGrad, K);
    led.free(kGrad, K);
    led.alloc(kGrad, Q);
    led.free(kGrad, Q);
    projection_backward(Hkv_ * D_, C_, [&] {
      led.alloc(kGrad, TC);  // v: dx
      pgrad(tb("self_attn.v_proj.weight", Hkv_ * D_ * C_ * b));
    });
    led.free(kGrad, K);
    projection_backward(Hkv_ * D_, C_, [&] {
      led.alloc(kGrad, TC);  // k: dx
      pgrad(tb("self_attn.k_proj.weight", Hkv_ * D_ * C_ * b));
    });
    led.free(kGrad, K);
    led.alloc(kGrad, TC);
    led.free(kGrad, 2 * TC);
    projection_backward(Hq_ * D_, C_, [&] {
      led.alloc(kGrad, TC);  // q: dx
      pgrad(tb("self_attn.q_proj.weight", Hq_ * D_ * C_ * b));
    });
    led.free(kGrad, Q);
    led.alloc(kGrad, TC);
    led.free(kGrad, 2 * TC);
    led.free(kAct, fp8_ ? fp8_kept(C_, 3) : TC);  // the norm output (saved by the q/k/v linears), or its X8T
    if (mc_.text_config.qkv_bias())
      pgrad(tb("self_attn.q_proj.bias", Hq_ * D_ * b) + tb("self_attn.k_proj.bias", Hkv_ * D_ * b) +
            tb("self_attn.v_proj.bias", Hkv_ * D_ * b));
    // rms_norm: dx, dw; its input (the layer input) and rstd go; accumulated into the residual gradient.
    led.alloc(kGrad, TC);
    pgrad(tb("input_layernorm.weight", C_ * b));
    workspace(cuda_norm_backward_workspace_bytes(T, C_, 1));
    led.free(kGrad, TC);
    led.free(kAct, T * 4 + (free_input ? TC : 0));
    if (region) {
      led.free(kGrad, TC);  // added in place into the input's gradient
      led.free(kGrad, TC);  // the closure lets go of the incoming gradient
    } else {
      led.alloc(kGrad, TC);
      led.free(kGrad, 2 * TC);
    }
  }

  // --- vision block (models/src/vision.cpp: block_forward) ---
  void vision_block_forward_recorded(MemoryTag tag) {
    const int64_t T = s_.Tv, b = s_.b, TE = T * E_ * b;
    led.alloc(tag, TE + 2 * T * 4);          // ln1 y, mean, rstd
    led.alloc(tag, 3 * TE);                  // q, k, v (saved by attention)
    led.alloc(tag, TE + T * HV_ * 4);        // attention out, lse
    led.alloc(tag, TE);                      // out_proj (transient)
    led.alloc(tag, TE);                      // h = x + o
    led.free(tag, TE);
    led.alloc(tag, TE + 2 * T * 4);          // ln2 z, mean, rstd
    led.alloc(tag, 2 * T * IV_ * b);         // fc1, gelu
    led.alloc(tag, TE);                      // fc2 (transient)
    led.alloc(tag, TE);                      // output
    led.free(tag, TE);
  }
  void vision_block_forward_nograd() {
    const int64_t T = s_.Tv, b = s_.b, TE = T * E_ * b;
    int64_t attn = TE + 2 * T * 4 + 3 * TE + TE + T * HV_ * 4 + TE + TE;
    led.alloc(kAct, attn);
    led.free(kAct, attn - TE);  // h stays
    int64_t mlp = TE + 2 * T * 4 + 2 * T * IV_ * b + TE + TE;
    led.alloc(kAct, mlp);
    led.free(kAct, mlp - TE + TE);  // output stays, h goes
  }
  void vision_block_backward(bool first, bool free_input) {
    const int64_t T = s_.Tv, b = s_.b, TE = T * E_ * b, TI = T * IV_ * b;
    auto pgrad = [&](int64_t bytes) {
      led.alloc(kGrad, bytes);
      if (!first) led.free(kGrad, bytes);
    };
    const bool region = !free_input;  // see decoder_layer_backward
    // add(h, z): g to both. fc2: dx [T, I], dW, db; gelu: dx; fc1: dx [T, E].
    led.alloc(kGrad, TI);
    pgrad(vb("mlp.fc2", E_ * IV_ * b, E_ * b));
    led.free(kAct, TI);
    led.alloc(kGrad, TI);
    led.free(kGrad, TI);
    led.free(kAct, TI);
    led.alloc(kGrad, TE);
    pgrad(vb("mlp.fc1", IV_ * E_ * b, IV_ * b));
    led.free(kGrad, TI);
    led.free(kAct, TE + 2 * T * 4);  // ln2's z, mean, rstd
    // ln2: dx, dw, db; accumulated with g into h's gradient (g stays alive in a region's closure).
    led.alloc(kGrad, TE);
    pgrad(vb("layer_norm2", E_ * b, E_ * b));
    workspace(cuda_norm_backward_workspace_bytes(T, E_, 2));
    led.free(kGrad, TE);
    led.alloc(kGrad, TE);
    led.free(kGrad, region ? TE : 2 * TE);
    led.free(kAct, TE);  // h (ln2's input)
    // add(x, o): g to both (a clone for a region's leaf input). out_proj: dx, dW, db; attention: dq, dk, dv.
    if (region) led.alloc(kGrad, TE);
    led.alloc(kGrad, TE);
    pgrad(vb("self_attn.out_proj", E_ * E_ * b, E_ * b));
    if (region) led.free(kGrad, TE);
    if (cuda_) {
      led.alloc(kGrad, 3 * TE);
      workspace(cuda_attention_backward_workspace_bytes(T, HV_, E_ / HV_));
      led.free(kGrad, TE);
    } else {
      led.alloc(kGrad, T * HV_ * 4);  // attention backward row statistics (CPU kernel)
      led.alloc(kGrad, 3 * TE);
      led.free(kGrad, TE + T * HV_ * 4);
    }
    led.free(kAct, 4 * TE + T * HV_ * 4);
    // v, k, q linears: dx each, accumulated.
    for (int i = 0; i < 3; ++i) {
      led.alloc(kGrad, TE);
      pgrad(vb(std::string("self_attn.") + "vkq"[i] + "_proj", E_ * E_ * b, E_ * b));
      led.free(kGrad, TE);
      if (i > 0) {
        led.alloc(kGrad, TE);
        led.free(kGrad, 2 * TE);
      }
    }
    // ln1: dx, dw, db; accumulated into x's gradient.
    led.alloc(kGrad, TE);
    pgrad(vb("layer_norm1", E_ * b, E_ * b));
    workspace(cuda_norm_backward_workspace_bytes(T, E_, 2));
    led.free(kGrad, TE);
    led.free(kAct, TE + 2 * T * 4 + (free_input ? TE : 0));  // y, stats, the block input
    if (region) {
      led.free(kGrad, 2 * TE);
    } else {
      led.alloc(kGrad, TE);
      led.free(kGrad, 2 * TE);
    }
  }

  int64_t C_, I_, D_, Hq_, Hkv_, V_, L_, E_, IV_, HV_, LV_;
  const models::VlmConfig& mc_;
  Shapes s_;
  RecomputePolicy policy_;
};

int64_t decoder_parameter_count(const models::TextConfig& t) {
  const int64_t C = t.hidden_size, D = t.head_dim, Hq = t.num_attention_heads, Hkv = t.num_key_value_heads;
  const int64_t I = t.intermediate_size;
  int64_t layer = 2 * C + (Hq + 2 * Hkv) * D * C + C * Hq * D + 3 * I * C;
  if (t.qkv_bias()) layer += (Hq + 2 * Hkv) * D;
  if (t.o_proj_bias()) layer += C;
  return t.vocab_size * C + t.num_hidden_layers * layer + C + (t.tie_word_embeddings ? 0 : t.vocab_size * C);
}

int64_t vlm_parameter_count(const models::VlmConfig& mc) {
  const auto& v = mc.vision_config;
  const auto& t = mc.text_config;
  const int64_t E = v.hidden_size, IV = v.intermediate_size, P = v.patch_size, N = v.num_patches();
  int64_t vision = E * v.num_channels * P * P + E + N * E +
                   v.num_hidden_layers * (4 * (E * E + E) + 4 * E + IV * E + IV + E * IV + E) + 2 * E;
  const int64_t s = mc.pixel_shuffle_factor, C = t.hidden_size;
  const int64_t Hp = mc.projector_hidden_size > 0 ? mc.projector_hidden_size : C;
  int64_t proj = Hp * E * s * s + Hp + C * Hp + C;
  return vision + proj + decoder_parameter_count(t);
}

}  // namespace

MemoryPlan plan_memory(const json& cfg, const PlanOptions& options) {
  if (RunConfig::resolve(cfg).recompute_auto) {
    json chosen = cfg;
    chosen["recompute"] = choose_recompute(cfg, options);
    MemoryPlan p = plan_memory(chosen, options);
    p.recompute += " (auto)";
    return p;
  }
  MemoryPlan plan;
  std::string type = cfg["model"]["type"];
  KESTREL_CHECK(type == "vlm" || type == "decoder", "plan", "model.type '", type,
                "' is not supported; use \"vlm\" or \"decoder\"");
  // A decoder-only run is planned as a VLM without a vision tower, projector or splice.
  const bool vlm = type == "vlm";
  const std::string config_path = cfg["model"]["config_path"];
  models::VlmConfig mc;
  if (vlm) {
    mc = resolve_vlm_config(cfg);  // towers' configs from model.vision_from / text_from (vlm_init.h)
  } else {
    mc.text_config = config_path.empty() ? models::TextConfig::from_json(cfg["model"]["config"], "model.config")
                                         : models::TextConfig::from_file(config_path);
    mc.vision_config.num_hidden_layers = 0;
  }
  const RunConfig run = RunConfig::resolve(cfg);
  const bool on_cuda = run.on_cuda();
  const DType dtype = run.dtype;
  const RecomputePolicy policy = run.recompute;
  const json& tr = cfg["train"];
  // Data parallelism (train/src/data_parallel.h, zero.h): one rank's share of each micro-batch.
  const int64_t W = options.world_size;
  KESTREL_CHECK(W >= 1 && tr["batch_size"].get<int64_t>() % W == 0, "plan", "train.batch_size ",
                tr["batch_size"].dump(), " (the global micro-batch) does not split evenly over ", W, " ranks");
  const int64_t B = tr["batch_size"].get<int64_t>() / W;
  plan.world_size = W;
  plan.zero = W > 1 && cfg.contains("distributed") ? static_cast<int>(cfg["distributed"]["zero"].get<int64_t>()) : 0;
  const int64_t state_shard = plan.zero >= 1 ? W : 1;  // ZeRO-1/2: each rank's AdamW owns ~1/W
  plan.device = on_cuda ? "cuda" : "cpu";
  plan.precision = std::string(dtype_name(dtype));
  plan.recompute = run.recompute_name();
  plan.external = options.external_bytes >= 0 ? options.external_bytes : (on_cuda ? int64_t{560} << 20 : 0);
  plan.budget = run.memory_budget_bytes;

  // Tokens: the largest micro-batch of the planned steps (captions vary in length).
  Shapes s;
  s.b = static_cast<int64_t>(dtype_size(dtype));
  // data.image_tiling (image_tiling.h): a record's picture is several tower images. Shapes pictures
  // all share one grid; other data is planned at the most a picture can have.
  const ImageTiling tiling = vlm ? image_tiling_from_config(cfg["data"]) : ImageTiling{};
  int64_t per_record = 1;
  if (tiling.enabled())
    per_record = cfg["data"]["type"] == "shapes"
                     ? choose_tile_grid(cfg["data"]["image_size"].get<int64_t>(), cfg["data"]["image_size"].get<int64_t>(),
                                        mc.vision_config.image_size, tiling)
                           .images()
                     : tiling.max_tiles + (tiling.thumbnail ? 1 : 0);
  s.B = vlm ? B * per_record : 0;
  const int64_t tpi = vlm ? mc.image_tokens_per_image() * per_record : 0;  // image slots per record
  s.Tv = s.B * mc.vision_config.num_patches();
  s.Ti = B * tpi;
  if (!vlm) s.T = B * cfg["data"]["seq_len"].get<int64_t>();  // rows x seq_len, every micro-batch alike
  if (vlm && cfg["data"]["type"] == "chat") {
    // Conversations (chat_data.h): rows of seq_len, padded; a row's images vary, planned at the most a
    // row can hold (seq_len / tokens_per_image: its slots alone would fill it), an upper bound.
    const int64_t seq_len = cfg["data"]["seq_len"];
    KESTREL_CHECK(seq_len > mc.image_tokens_per_image(), "memory_plan", "data.seq_len (", seq_len,
                  ") must exceed one image's ", mc.image_tokens_per_image(), " image-token slots");
    s.B = B * (seq_len / mc.image_tokens_per_image());
    s.Tv = s.B * mc.vision_config.num_patches();
    s.Ti = s.B * mc.image_tokens_per_image();
    s.T = B * seq_len;
  } else if (vlm) {
    const json& d = cfg["data"];
    ShapesConfig sc;
    sc.image_size = d["image_size"];
    sc.seed = d["seed"];
    sc.noise = d["noise"];
    sc.shape_scale = d["shape_scale"];
    ShapesDataset ds(sc);
    ByteTokenizer tok;
    std::vector<uint8_t> img(static_cast<size_t>(ds.image_bytes()));
    const int64_t micro = std::clamp<int64_t>(options.steps > 0 ? options.steps : tr["steps"].get<int64_t>(), 1, 64) *
                          tr["grad_accum"].get<int64_t>();
    for (int64_t m = 0; m < micro; ++m) {
      int64_t T = 0;
      for (int64_t i = 0; i < B; ++i)
        T += tpi + 2 + static_cast<int64_t>(tok.encode(ds.render(static_cast<uint64_t>(m * B + i), img).caption).size());
      s.T = std::max(s.T, T);
    }
  }
  plan.tokens = s.T;
  plan.parameters = vlm ? vlm_parameter_count(mc) : decoder_parameter_count(mc.text_config);
  // train.trainable (param_groups.h): gradients and optimizer state exist for trainable parameters only.
  const ParameterGroupRules rules = ParameterGroupRules::from_config(cfg);
  const std::vector<std::pair<std::string, int64_t>> sizes = model_parameter_sizes(mc, vlm);
  {
    std::vector<std::string> names;
    for (const auto& [name, n] : sizes) names.push_back(name), plan.trainable_parameters += rules.is_trainable(name) ? n : 0;
    rules.check_names(names);
  }
  const auto trains = [&rules](const std::string& name) { return rules.is_trainable(name); };
  bool vision_trains = false;  // any tower parameter: else the tower records nothing and has no backward
  for (const auto& [name, n] : sizes) vision_trains |= name.starts_with("vision_tower.") && rules.is_trainable(name);

  plan.mlp_tile_tokens = run.mlp_tile_auto ? choose_mlp_tile_tokens(cfg, options) : run.mlp_tile_tokens;
  Planner P(mc, s, policy, on_cuda, plan.mlp_tile_tokens);
  // LLaVA's features (vision_feature_layer): the blocks up to that hidden state run, no post_layernorm.
  const bool post_ln = !mc.vision_feature_layer;
  P.LV_ = vlm ? mc.vision_blocks_used() : 0;
  P.selective_ = run.recompute_selective && policy != RecomputePolicy::None;
  P.fp8_ = run.fp8;
  plan.layer_bytes_per_token = policy == RecomputePolicy::None
                                   ? P.decoder_layer_saved() / std::max<int64_t>(s.T, 1)
                                   : P.C_ * s.b + (P.selective_ ? P.Hq_ * P.D_ * s.b + P.Hq_ * 4 : 0);
  P.trains = trains;
  P.text_prefix = vlm ? "language_model." : "";
  const std::string tp = P.text_prefix;
  Ledger& L = P.led;
  const int64_t b = s.b, T = s.T, C = P.C_, E = P.E_, V = P.V_;
  const auto& tc = mc.text_config;
  const int64_t pbytes = plan.parameters * b;
  L.where = "setup";
  // The CUDA context's cuBLASLt workspace exists before the model (it is live for the whole run).
  if (on_cuda) L.alloc(MemoryTag::Workspace, cuda_context_workspace_bytes());
  L.alloc(MemoryTag::Parameter, pbytes);
  if (!on_cuda) {
    // CPU initialisation draws each weight as an f32 tensor (tagged Parameter) before copying it in;
    // the last one drawn comes when every other parameter exists: the VLM's projector linear_2
    // [C, Hp]; a decoder's untied lm_head [V, C], or with tied embeddings its last down_proj [C, I].
    const int64_t Cx = mc.text_config.hidden_size;
    const int64_t Hpx = mc.projector_hidden_size > 0 ? mc.projector_hidden_size : Cx;
    const int64_t last = vlm ? Cx * Hpx
                             : (mc.text_config.tie_word_embeddings ? Cx * mc.text_config.intermediate_size
                                                                   : Cx * mc.text_config.vocab_size);
    L.alloc(MemoryTag::Parameter, last * 4);
    L.free(MemoryTag::Parameter, last * 4);
  }
  // fp8.enabled: the decoder's Fp8State (ops/src/fp8.cpp), made by enable_fp8 outside any tag scope:
  // f32 amax [3 n], history [3 n, H] and scale [3 n] for its n = layers x 7 projections.
  if (run.fp8) {
    const int64_t rows = 3 * models::Decoder::kFp8LinearsPerLayer * mc.text_config.num_hidden_layers;
    L.alloc(MemoryTag::Temporary, rows * (run.fp8_recipe.amax_history + 2) * 4);
  }
  // AdamW state (train/src/optimizer.cpp, one rule: optimizer_state_bytes_per_param): moments (f32,
  // or q8: 2 bytes + two f32 scales per 2048), plus f32 masters for 16-bit parameters unless
  // optimizer.master_weights is "none", on the device; with optimizer.offload "host" (CUDA) the
  // f32 master + moments live in host memory instead and the device holds nothing of it; the host
  // also pins 2 x staging_slots x staging_slot_mib.
  const OptimizerPlacement placement = optimizer_placement_from_config(cfg, on_cuda ? Device::cuda(0) : Device::cpu());
  OptimizerStateBytes per_param = optimizer_state_bytes_per_param(placement, dtype, on_cuda);
  per_param.device /= static_cast<double>(state_shard);  // ZeRO-1/2: per GPU
  per_param.host /= static_cast<double>(state_shard);
  const bool step_in_backward = placement.step_in_backward;
  // optimizer.gradients "host" (train/src/gradient_stream.h) copies each gradient out at the hook where
  // step_in_backward would update it: on the device both drop it at the same point.
  const bool stream_grads = on_cuda && cfg["optimizer"]["gradients"] == "host";
  const bool drop_grads = step_in_backward || stream_grads;
  if (stream_grads) plan.host_gradients = plan.parameters * b;  // GradientStream pins a slice for every parameter
  plan.optimizer_offload = optimizer_offload_name(placement.offload);
  plan.master_weights = master_weights_name(placement.master_weights);
  plan.state_dtype = optimizer_state_dtype_name(placement.state_dtype);
  plan.step_in_backward = step_in_backward;
  plan.bytes_per_param_weights = static_cast<double>(b);
  plan.bytes_per_param_grads = step_in_backward ? 0.0 : static_cast<double>(b);
  plan.bytes_per_param_device_state = per_param.device;
  plan.bytes_per_param_host_state = per_param.host;
  const auto state_bytes = [&](double per) {
    return static_cast<int64_t>(std::ceil(per * static_cast<double>(plan.trainable_parameters)));
  };
  if (placement.offload == OptimizerOffload::Host && on_cuda) {
    plan.host_optimizer_state = state_bytes(per_param.host);
    plan.host_pinned = 2 * static_cast<int64_t>(placement.staging_slots) * placement.staging_slot_bytes;
  } else if (placement.offload == OptimizerOffload::Host) {
    L.alloc(MemoryTag::OptimizerState, state_bytes(per_param.host));  // CPU parameters: host memory anyway
  } else {
    L.alloc(MemoryTag::OptimizerState, state_bytes(per_param.device));
  }

  // The batch (train/src/batch_prefetcher.cpp). On the CPU its arrays view the prefetcher's host
  // memory (not counted). On CUDA they are device copies (Activation, label "data"): ids, labels,
  // positions [T] i64, cu_seqlens, and for the VLM pixels [images, 3, S, S] already in the model dtype
  // (made so on the host, vlm_data.cpp) and image slots [Ti] i64; with prefetch on, the next
  // micro-batch is uploaded as the step starts, so two batches are live. The step's pixels die
  // with the forward.
  const int64_t S = mc.vision_config.image_size;
  auto block = [&](int64_t bytes) { return on_cuda ? cuda_block_bytes(bytes) : bytes; };
  const int64_t pixels = on_cuda && vlm ? block(s.B * 3 * S * S * b) : 0;
  const int64_t batch_bytes =
      on_cuda ? 3 * block(T * 8) + block((B + 1) * 4) + (vlm ? pixels + block(s.Ti * 8) : 0) : 0;
  const int64_t batches = on_cuda && cfg.value("prefetch", 0) > 0 ? 2 : 1;
  L.where = "data";
  L.alloc(kAct, batches * batch_bytes);

  // One micro-batch; with train.grad_accum > 1 a second one replays with the first one's parameter
  // gradients held (they are the peak of accumulation: later micro-batches add into them).
  const int64_t accum = cfg["train"]["grad_accum"].get<int64_t>();
  // ZeRO-2 (one micro-batch per step): a rank drops the gradients it does not own as their bucket
  // is reduced to the owner, about where step_in_backward drops them; it keeps ~1/W.
  const int64_t grad_shard = plan.zero == 2 && accum == 1 && !drop_grads ? W : 1;
  if (grad_shard > 1) plan.bytes_per_param_grads /= static_cast<double>(grad_shard);
  auto shed = [&](int64_t bytes) {
    if (grad_shard > 1) L.free(kGrad, bytes - bytes / grad_shard);
  };
  auto micro_batch = [&](bool first) {
    if (!first) L.alloc(kAct, pixels);  // the next micro-batch's pixels (the forward frees them)
    // ---- forward ----
    const bool regions = policy != RecomputePolicy::None;
    L.where = "forward: embed";
    L.alloc(kAct, T * C * b);  // token embeddings (live until the splice)
    const int64_t Tv = s.Tv, TE = Tv * E * b, P2 = mc.vision_config.patch_size * mc.vision_config.patch_size;
    const int64_t Ti = s.Ti, sf = mc.pixel_shuffle_factor;
    const int64_t Hp = mc.projector_hidden_size > 0 ? mc.projector_hidden_size : C;
    if (vlm) {
      L.where = "forward: vision";
      L.alloc(kAct, Tv * 3 * P2 * b);  // unfolded patches (saved by the patch GEMM)
      L.alloc(kAct, TE);               // patch GEMM out
      L.alloc(kAct, TE + (s.B + 1) * 4); // + positions; cu_seqlens (one document per tower image)
      L.free(kAct, TE);
      // A frozen tower records nothing: its tensors die as the forward moves on.
      if (!vision_trains) L.free(kAct, Tv * 3 * P2 * b);
      for (int64_t l = 0; l < P.LV_; ++l) {
        L.where = "forward: vision.block." + std::to_string(l);
        if (regions || !vision_trains)
          P.vision_block_forward_nograd();
        else
          P.vision_block_forward_recorded(kAct);
        if (!vision_trains) L.free(kAct, TE);  // the block's input
      }
      L.where = "forward: projector";
      if (post_ln) {
        L.alloc(kAct, TE + 2 * Tv * 4);  // post layernorm y (freed when the projector returns), mean, rstd
        if (!vision_trains) L.free(kAct, TE + 2 * Tv * 4 + (s.B + 1) * 4);  // its input, mean, rstd; cu_seqlens
      } else if (!vision_trains) {
        L.free(kAct, (s.B + 1) * 4);  // cu_seqlens; the last block's output is the projector's input
      }
      L.alloc(kAct, TE);                    // pixel-shuffle contiguous copy
      L.alloc(kAct, 2 * Ti * Hp * b);       // linear_1, gelu
      L.alloc(kAct, Ti * C * b);            // linear_2 (img)
      L.free(kAct, TE);                     // the post-layernorm output (only views of it were recorded)
      L.where = "forward: splice";
      L.alloc(kAct, T * C * b);             // spliced embeddings
      L.free(kAct, Ti * C * b + T * C * b); // img and the token embeddings
    }
    // Offload regions (autograd/src/recompute.cpp, runtime/cuda/offloader.cpp): each region input
    // goes to pinned host memory after its region's forward; its block returns when the copy lands.
    // The offloader lets 256 MiB of copies, and always two, be in flight before the host waits.
    // Selective regions offload the kept attention output and lse after the input, as copies of their own.
    const bool offload = policy == RecomputePolicy::Offload && on_cuda;
    const int64_t region_input = T * C * b;
    const int64_t kept_out = P.selective_ ? T * P.Hq_ * P.D_ * b : 0, kept_lse = P.selective_ ? T * P.Hq_ * 4 : 0;
    if (offload && P.selective_) P.kept_tag_ = MemoryTag::Checkpoint;
    std::deque<int64_t> copies;  // offload copies in flight, oldest first (runtime/cuda/offloader.cpp: throttle)
    int64_t in_flight = 0;       // their bytes
    auto offload_copy = [&](int64_t bytes) {
      if (bytes == 0) return;
      copies.push_back(bytes);
      in_flight += bytes;
      while (in_flight > run.memory.offload_inflight && copies.size() > 2) {  // the host waits for the oldest
        L.free(kAct, copies.front());
        in_flight -= copies.front();
        copies.pop_front();
      }
    };
    for (int64_t l = 0; l < P.L_; ++l) {
      L.where = "forward: decoder.layer." + std::to_string(l);
      if (regions)
        P.decoder_layer_forward_nograd();
      else
        P.decoder_layer_forward_recorded(kAct);
      if (offload) {
        offload_copy(region_input);
        offload_copy(kept_out);
        offload_copy(kept_lse);
      }
    }
    L.where = "forward: final norm + loss";
    L.alloc(kAct, T * C * b + T * 4);  // final norm out, rstd
    L.alloc(kAct, 4 + T * 4);          // loss, lse (f32)
    L.free(kAct, in_flight);  // the last copies land during the loss
    if (offload) plan.host_activations = P.L_ * (region_input + kept_out + kept_lse);
    // The fused linear + cross-entropy scratch. CPU (ops/cpu/cross_entropy.cpp): [Nc, Vc] f32 logits,
    // and for bf16/f16 the converted hidden and weight chunks; backward adds the f32 d_weight and the
    // chunk's d_hidden. CUDA: the launcher's workspace in forward; in backward the lse-based pass's
    // (ops/cuda/fused_linear_cross_entropy_backward.cu: a logits block, its gradient, an f32 d_hidden).
    const int64_t Nc = std::min<int64_t>(512, T);
    const int64_t Vc = std::clamp<int64_t>(std::clamp<int64_t>((int64_t{4} << 20) / std::max<int64_t>(C, 1), 256, 4096), 1, V);
    const int64_t ce_forward = on_cuda ? cuda_cross_entropy_workspace_bytes(T, V, dtype, false)
                                       : Nc * Vc * 4 + (dtype == DType::F32 ? 0 : (Nc + Vc) * C * 4);
    const int64_t ce_backward =
        on_cuda ? cuda_cross_entropy_backward_workspace_bytes(T, V, C, dtype)
                : ce_forward + (dtype == DType::F32 ? 0 : V * C * 4 + Nc * C * 4);
    L.alloc(MemoryTag::Workspace, ce_forward);
    L.free(MemoryTag::Workspace, ce_forward);
    L.free(kAct, pixels);  // the step's batch copy of the pixels

    // ---- backward ----
    L.where = "backward: loss";
    L.alloc(kGrad, 4);  // the seed
    L.alloc(kGrad, T * C * b);  // d_hidden
    // d_lm_head (the tied embedding's gradient); later micro-batches add into it in place (the fused
    // cross-entropy's d_weight GEMM with beta = 1), no new buffer.
    const std::string head = tc.tie_word_embeddings ? "model.embed_tokens.weight" : "lm_head.weight";
    const int64_t head_grad = trains(tp + head) ? V * C * b : 0;
    if (first) L.alloc(kGrad, head_grad);
    L.alloc(MemoryTag::Workspace, ce_backward);
    L.free(MemoryTag::Workspace, ce_backward);
    // step_in_backward: an untied lm_head is complete here; its hook updates it and drops the gradient.
    if (drop_grads && !tc.tie_word_embeddings) L.free(kGrad, head_grad);
    if (!tc.tie_word_embeddings) shed(head_grad);
    L.free(kAct, T * 4 + T * C * b);  // lse and the final norm output (saved by the loss)
    L.free(kGrad, 4);
    L.where = "backward: final norm";
    const int64_t norm_grad = trains(tp + "model.norm.weight") ? C * b : 0;
    L.alloc(kGrad, T * C * b + norm_grad);
    P.workspace(cuda_norm_backward_workspace_bytes(T, C, 1));
    L.free(kGrad, T * C * b + (first ? 0 : norm_grad));
    if (drop_grads) L.free(kGrad, norm_grad);  // the final norm's weight gradient, at its hook
    shed(norm_grad);
    L.free(kAct, T * C * b + T * 4);  // its input (the last layer's output), rstd
    // Offloaded inputs come back one region ahead: the top region's at the loss, region l - 1's as
    // region l starts.
    if (offload && P.L_ > 0) L.alloc(MemoryTag::Checkpoint, region_input + kept_out + kept_lse);
    for (int64_t l = P.L_ - 1; l >= 0; --l) {
      L.where = "backward: decoder.layer." + std::to_string(l);
      if (offload && l > 0) L.alloc(MemoryTag::Checkpoint, region_input + kept_out + kept_lse);
      if (regions) P.decoder_layer_forward_recorded(kAct, true);  // the re-run on the inner tape (Activation)
      P.layer_ = l;
      P.decoder_layer_backward(first, !regions);
      if (offload) {
        L.free(kAct, T * C * b);                    // the re-run's output
        L.free(MemoryTag::Checkpoint, region_input);  // the restored region input
      } else if (regions) {
        L.free(kAct, 2 * T * C * b);  // the re-run's output and the region input, at the closure's end
      }
      // step_in_backward: the layer's parameters are complete once its region has run (their hooks
      // wait for the region entry); each is updated and its gradient dropped.
      if (drop_grads) L.free(kGrad, P.layer_param_grads);
      shed(P.layer_param_grads);
    }
    // Layer 0's input gradient [T, C] is live.
    // The embedding's scatter-add goes into the weight's gradient in place once it holds one (the tied
    // lm_head's, or an earlier micro-batch's); only an untied first micro-batch allocates [V, C].
    const int64_t embed_grad =
        first && !tc.tie_word_embeddings && trains(tp + "model.embed_tokens.weight") ? V * C * b : 0;
    if (!vlm) {
      L.where = "backward: embed";
      L.alloc(kGrad, embed_grad);
      L.free(kGrad, T * C * b);
      if (drop_grads) L.free(kGrad, embed_grad);  // updated (or streamed out) at its hook
      shed(embed_grad + (tc.tie_word_embeddings ? V * C * b : 0));
    } else {
      // Layer 0's input gradient [T, C] is live. splice: db = clone(go) (+ zero rows), ds = gather.
      L.where = "backward: splice";
      L.alloc(kGrad, T * C * b + 2 * Ti * C * b);
      L.free(kGrad, Ti * C * b + T * C * b);  // the zero rows, go
      // The token embeddings' gradient (db) waits: the engine walks the image branch first.
      L.where = "backward: projector";
      // A frozen projector weight gets no gradient; a frozen tower takes no dx and has no backward.
      const std::string mp = "multi_modal_projector.";
      const int64_t l2_grad = (trains(mp + "linear_2.weight") ? C * Hp * b : 0) + (trains(mp + "linear_2.bias") ? C * b : 0);
      const int64_t l1_grad =
          (trains(mp + "linear_1.weight") ? Hp * E * sf * sf * b : 0) + (trains(mp + "linear_1.bias") ? Hp * b : 0);
      L.alloc(kGrad, Ti * Hp * b + l2_grad);  // linear_2: dx, dW, db
      if (!first) L.free(kGrad, l2_grad);     // added into the held gradients
      L.free(kAct, Ti * Hp * b);
      L.free(kGrad, Ti * C * b);
      L.alloc(kGrad, Ti * Hp * b);  // gelu
      L.free(kGrad, Ti * Hp * b);
      L.free(kAct, Ti * Hp * b);
      const int64_t l1_dx = vision_trains ? TE : 0;
      L.alloc(kGrad, l1_dx + l1_grad);  // linear_1: dx, dW, db
      if (!first) L.free(kGrad, l1_grad);
      L.free(kAct, TE);
      L.free(kGrad, Ti * Hp * b);
      if (vision_trains) {
        const std::string vp = "vision_tower.vision_model.";
        const int64_t post_grad = (trains(vp + "post_layernorm.weight") ? E * b : 0) + (trains(vp + "post_layernorm.bias") ? E * b : 0);
        L.alloc(kGrad, TE);  // contiguous copy of the permuted gradient; post layernorm: dx, dw, db
        if (post_ln) {
          L.alloc(kGrad, TE + post_grad);
          P.workspace(cuda_norm_backward_workspace_bytes(Tv, E, 2));
          L.free(kGrad, 2 * TE + (first ? 0 : post_grad));
          L.free(kAct, TE + 2 * Tv * 4);  // its input (the last block's output), mean, rstd
        } else {
          L.free(kGrad, TE);  // linear_1's dx: the copy is the last block's output gradient
        }
        for (int64_t l = P.LV_ - 1; l >= 0; --l) {
          L.where = "backward: vision.block." + std::to_string(l);
          if (regions) P.vision_block_forward_recorded(kAct);
          P.vision_layer_ = l;
          P.vision_block_backward(first, !regions);
          if (regions) L.free(kAct, 2 * TE);
        }
        L.where = "backward: vision embed";
        const std::string ve = vp + "embeddings.";
        const int64_t embed_grads = (trains(ve + "patch_embedding.weight") ? E * 3 * P2 * b : 0) +
                                    (trains(ve + "patch_embedding.bias") ? E * b : 0) +
                                    (trains(ve + "position_embedding.weight") ? Tv / s.B * E * b : 0);
        L.alloc(kGrad, embed_grads);  // patch GEMM dW, db; position gradient
        L.free(kGrad, TE + (first ? 0 : embed_grads));
        L.free(kAct, Tv * 3 * P2 * b + (s.B + 1) * 4);  // unfolded patches, cu_seqlens
      }
      L.where = "backward: embed";
      L.alloc(kGrad, embed_grad);
      L.free(kGrad, T * C * b);
    }

  };
  micro_batch(true);
  if (accum > 1) micro_batch(false);

  // Data parallelism: the buckets' flat copies of the gradients live from their launch to the end of
  // backward (GradientAllReduce::finish): one more copy of the kept gradients.
  if (W > 1 && !drop_grads) {
    L.where = "backward: gradient buckets";
    const int64_t flat = plan.parameters * s.b / grad_shard;  // frozen ones included: an upper bound
    L.alloc(kGrad, flat);
    L.free(kGrad, flat);
  }

  // ---- optimizer ----
  L.where = "optimizer";
  L.free(kGrad, L.cur[static_cast<int>(kGrad)]);  // zero_grad
  L.free(kAct, batches * batch_bytes - pixels);

  plan.tag_peak = L.peak;
  plan.peak = L.peak_in_use;
  plan.peak_where = L.peak_where;
  plan.tag_peak[static_cast<int>(MemoryTag::External)] = plan.external;
  if (plan.budget > 0) {
    plan.headroom = plan.budget - (plan.peak + plan.external);
    plan.fits = plan.headroom >= 0;
  }
  return plan;
}

int64_t choose_mlp_tile_tokens(const json& config, const PlanOptions& options) {
  const RunConfig run = RunConfig::resolve(config);
  if (!run.mlp_tile_auto) return run.mlp_tile_tokens;
  if (!run.has_budget()) return 0;
  if (run.fp8) return 0;  // the tiled MLP's GEMMs are bf16 only: the decoder refuses a tile with fp8
  json cfg = config;
  cfg["mlp_tile_tokens"] = 0;
  MemoryPlan untiled = plan_memory(cfg, options);
  if (untiled.budget <= 0 || untiled.headroom >= untiled.budget / 10) return 0;
  for (int64_t tile : {16384, 8192, 4096, 2048, 1024}) {
    if (tile >= untiled.tokens && tile > 1024) continue;  // one tile would hold the whole micro-batch
    cfg["mlp_tile_tokens"] = tile;
    if (plan_memory(cfg, options).fits) return tile;
  }
  return 1024;
}

json MemoryPlan::to_json() const {
  json tags = json::object();
  for (int t = 0; t < kNumMemoryTags; ++t) tags[std::string(tag_name(static_cast<MemoryTag>(t)))] = tag_peak[t];
  return json{{"peak", peak},           {"peak_where", peak_where}, {"external", external}, {"budget", budget},
              {"fits", fits},           {"headroom", headroom},     {"tokens", tokens},     {"parameters", parameters},
              {"trainable_parameters", trainable_parameters},
              {"precision", precision}, {"recompute", recompute}, {"layer_bytes_per_token", layer_bytes_per_token},   {"device", device},     {"tags", tags},
              {"optimizer_offload", optimizer_offload}, {"mlp_tile_tokens", mlp_tile_tokens},
              {"world_size", world_size}, {"zero", zero},
              {"host_activations", host_activations}, {"host_gradients", host_gradients},
              {"optimizer",
               {{"master_weights", master_weights},
                {"state_dtype", state_dtype},
                {"step_in_backward", step_in_backward},
                {"bytes_per_param",
                 {{"weights", bytes_per_param_weights},
                  {"grads", bytes_per_param_grads},
                  {"device_state", bytes_per_param_device_state},
                  {"host_state", bytes_per_param_host_state}}}}},
              {"host", {{"optimizer_state", host_optimizer_state}, {"pinned", host_pinned},
                        {"total", host_optimizer_state + host_pinned}}}};
}

std::string MemoryPlan::table() const {
  std::ostringstream os;
  char buf[200];
  std::snprintf(buf, sizeof buf, "plan: %s, %s, recompute %s, %.2fM parameters, %lld tokens per micro-batch\n",
                device.c_str(), precision.c_str(), recompute.c_str(), parameters / 1e6, static_cast<long long>(tokens));
  os << buf;
  if (world_size > 1) {
    std::snprintf(buf, sizeof buf, "  data parallel: per GPU of %lld ranks (1/%lld of each micro-batch), ZeRO-%d%s\n",
                  static_cast<long long>(world_size), static_cast<long long>(world_size), zero,
                  zero == 0 ? ": every rank holds all gradients and optimizer state"
                  : zero == 1 ? ": optimizer state divided over the ranks"
                              : ": optimizer state and kept gradients divided over the ranks");
    os << buf;
  }
  if (trainable_parameters != parameters) {
    std::snprintf(buf, sizeof buf, "  train.trainable: %.2fM of them train (gradients and optimizer state for those only)\n",
                  trainable_parameters / 1e6);
    os << buf;
  }
  if (mlp_tile_tokens > 0) {
    std::snprintf(buf, sizeof buf, "  MLP over tiles of %lld tokens\n", static_cast<long long>(mlp_tile_tokens));
    os << buf;
  }
  std::snprintf(buf, sizeof buf,
                "  AdamW: master_weights %s, state_dtype %s%s; bytes/parameter: weights %.2f, grads %.2f%s, state "
                "%.3f on the device + %.3f on the host\n",
                master_weights.c_str(), state_dtype.c_str(), step_in_backward ? ", step_in_backward" : "",
                bytes_per_param_weights, bytes_per_param_grads, step_in_backward ? " (one layer at a time)" : "",
                bytes_per_param_device_state, bytes_per_param_host_state);
  os << buf;
  for (int t = 0; t < kNumMemoryTags; ++t) {
    if (tag_peak[t] == 0) continue;
    std::snprintf(buf, sizeof buf, "  %-16s %14s\n", std::string(tag_name(static_cast<MemoryTag>(t))).c_str(),
                  format_bytes(tag_peak[t]).c_str());
    os << buf;
  }
  std::snprintf(buf, sizeof buf, "  %-16s %14s  (%s)\n", "peak in use", format_bytes(peak).c_str(), peak_where.c_str());
  os << buf;
  std::snprintf(buf, sizeof buf, "  %-16s %14s\n", "+ external", format_bytes(peak + external).c_str());
  os << buf;
  if (host_optimizer_state > 0) {
    std::snprintf(buf, sizeof buf, "host (optimizer.offload=host): AdamW state %s + pinned staging %s = %s\n",
                  format_bytes(host_optimizer_state).c_str(), format_bytes(host_pinned).c_str(),
                  format_bytes(host_optimizer_state + host_pinned).c_str());
    os << buf;
  }
  if (host_gradients > 0) {
    std::snprintf(buf, sizeof buf, "host (optimizer.gradients=host): gradients %s in pinned memory\n",
                  format_bytes(host_gradients).c_str());
    os << buf;
  }
  if (host_activations > 0) {
    std::snprintf(buf, sizeof buf, "host (recompute with offload): region inputs %s in pinned memory\n",
                  format_bytes(host_activations).c_str());
    os << buf;
  }
  if (budget > 0) {
    std::snprintf(buf, sizeof buf, "%s: budget %s, headroom %s\n", fits ? "FITS" : "DOES NOT FIT",
                  format_bytes(budget).c_str(), format_bytes(headroom).c_str());
    os << buf;
  }
  return os.str();
}

}  // namespace kestrel::train
