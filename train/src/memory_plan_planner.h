// The memory planner's replay machinery (memory_plan.cpp): the ledger of bytes per tag, the
// micro-batch shapes and the Planner, which replays one decoder layer or vision block, forward and
// backward, allocation by allocation. The layers' accounting is in memory_plan_layers.cpp, the FP8
// projections' in memory_plan_fp8.cpp; the step around them (data, optimizer state, loss, the
// micro-batch loop) in memory_plan.cpp.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <string>

#include "kestrel/autograd/recompute.h"
#include "kestrel/models/config.h"
#include "kestrel/runtime/memory.h"

namespace kestrel::train::plan_detail {

inline constexpr MemoryTag kAct = MemoryTag::Activation, kGrad = MemoryTag::Gradient;

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

class Planner {
 public:
  Planner(const models::VlmConfig& mc, const Shapes& s, autograd::RecomputePolicy policy, bool cuda, int64_t mlp_tile)
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
  // linear_fp8(x [T, K], weights [N_i, K]) forward: x cast once (X8 [Tp, K], and X8T [K, Tp] when
  // recording; the cast writes the zero rows up to Tp itself, or the op producing x does); per weight
  // its cast W8 [N, K], the GEMM's [Tp, N] (narrowed into a [T, N] copy when padded; the bias added out
  // of place), W8 gone after the GEMM; X8 goes when the call returns. The outputs stay; recording
  // keeps fp8_kept(K, weights).
  void fp8_linear_forward(MemoryTag tag, int64_t K, std::initializer_list<int64_t> Ns, bool record, bool bias);
  // linear_fp8's backward of one weight [N, K], live while its GEMMs write dx [T, K] and dW [N, K] (which
  // the caller allocates as for a bf16 linear): dY cast into Tp rows plain (dgrad) and transposed
  // (wgrad) with its scales, W8T [K, N] re-cast with its scales, and the [Tp, K] dx before its
  // narrowed copy when padded.
  int64_t fp8_backward_scratch(int64_t N, int64_t K) const;
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
  void decoder_layer_forward_recorded(MemoryTag tag, bool rerun = false);
  // The same with FP8 projections (the tiled MLP is refused with fp8): the norm outputs and the SwiGLU
  // product are no longer kept (only their casts' X8T), the attention output keeps o_proj's X8T too.
  void decoder_layer_forward_recorded_fp8(MemoryTag tag, bool rerun);
  int64_t decoder_layer_saved_fp8() const;
  void decoder_layer_forward_nograd_fp8();
  // swiglu_mlp_tiled's [tile, I] buffers (ops/src/mlp.cpp), allocated and freed around its tile loop.
  void tile_scratch(MemoryTag tag, int buffers) {
    const int64_t bytes = buffers * std::min(mlp_tile_, s_.T) * I_ * s_.b;
    led.alloc(tag, bytes);
    led.free(tag, bytes);
  }
  int64_t decoder_layer_saved() const;
  // Forward of a region without recording (no-grad): locals die with their scopes.
  void decoder_layer_forward_nograd();
  // Backward through one recorded layer; `g` [T, C] arrives (live), the layer input's gradient
  // leaves (live). Frees the layer's saved tensors and allocates its parameter gradients.
  int64_t layer_param_grads = 0;  // parameter gradients of the last decoder layer's backward
  void decoder_layer_backward(bool params_first_time, bool free_input);

  // --- vision block (models/src/vision.cpp: block_forward) ---
  void vision_block_forward_recorded(MemoryTag tag);
  void vision_block_forward_nograd();
  void vision_block_backward(bool first, bool free_input);

  int64_t C_, I_, D_, Hq_, Hkv_, V_, L_, E_, IV_, HV_, LV_;
  const models::VlmConfig& mc_;
  Shapes s_;
  autograd::RecomputePolicy policy_;
};

}  // namespace kestrel::train::plan_detail
