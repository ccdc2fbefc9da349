// The memory planner's per-layer accounting: one decoder layer (models/src/decoder.cpp) and one vision
// block (models/src/vision.cpp), forward with and without recording and backward, allocation by
// allocation in the order the ops and their tape entries make them (ops/src/*). When that code
// changes what it allocates or saves, change the matching lines here; the plan-vs-profile tests say so.
#include "memory_plan_planner.h"
#include "memory_plan_workspace.h"

namespace kestrel::train::plan_detail {

void Planner::decoder_layer_forward_recorded(MemoryTag tag, bool rerun) {
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

int64_t Planner::decoder_layer_saved() const {
  if (fp8_) return decoder_layer_saved_fp8();
  const int64_t T = s_.T, b = s_.b;
  return T * C_ * b + T * 4 + T * Hq_ * D_ * b + 2 * T * Hkv_ * D_ * b + T * Hq_ * D_ * b + T * Hq_ * 4 +
         2 * T * C_ * b + T * 4 + (mlp_tile_ > 0 ? 0 : 3 * T * I_ * b) + T * C_ * b;
}

void Planner::decoder_layer_forward_nograd() {
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

void Planner::decoder_layer_backward(bool params_first_time, bool free_input) {
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

void Planner::vision_block_forward_recorded(MemoryTag tag) {
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

void Planner::vision_block_forward_nograd() {
  const int64_t T = s_.Tv, b = s_.b, TE = T * E_ * b;
  int64_t attn = TE + 2 * T * 4 + 3 * TE + TE + T * HV_ * 4 + TE + TE;
  led.alloc(kAct, attn);
  led.free(kAct, attn - TE);  // h stays
  int64_t mlp = TE + 2 * T * 4 + 2 * T * IV_ * b + TE + TE;
  led.alloc(kAct, mlp);
  led.free(kAct, mlp - TE + TE);  // output stays, h goes
}

void Planner::vision_block_backward(bool first, bool free_input) {
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

}  // namespace kestrel::train::plan_detail
