// The memory planner's FP8 projections (fp8.enabled: kestrel/ops/fp8.h, linear_fp8 in ops/src/fp8.cpp):
// what each cast, GEMM and kept X8T allocates, and the decoder layer's forward with FP8 q/k/v, o_proj,
// gate/up and down projections. The backward's FP8 scratch wraps the bf16 accounting of
// memory_plan_layers.cpp (Planner::projection_backward).
#include "memory_plan_planner.h"

namespace kestrel::train::plan_detail {

void Planner::fp8_linear_forward(MemoryTag tag, int64_t K, std::initializer_list<int64_t> Ns, bool record, bool bias) {
  const int64_t T = s_.T, Tp = this->Tp(), b = s_.b;
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
  led.free(tag, Tp * K + (record ? 0 : kFp8Scales));
}

int64_t Planner::fp8_backward_scratch(int64_t N, int64_t K) const {
  const int64_t T = s_.T, Tp = this->Tp(), b = s_.b;
  return (T != Tp ? Tp * K * b : 0) + 2 * kFp8Scales + 2 * Tp * N + K * N;
}

void Planner::decoder_layer_forward_recorded_fp8(MemoryTag tag, bool rerun) {
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

int64_t Planner::decoder_layer_saved_fp8() const {
  const int64_t T = s_.T, b = s_.b, Q = T * Hq_ * D_ * b, Kv = T * Hkv_ * D_ * b;
  return T * 4 + fp8_kept(C_, 3) + Q + 2 * Kv + attention_kept_bytes() + fp8_kept(Hq_ * D_, 1) + T * C_ * b +
         T * 4 + fp8_kept(C_, 2) + 2 * T * I_ * b + fp8_kept(I_, 1) + T * C_ * b;
}

void Planner::decoder_layer_forward_nograd_fp8() {
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

}  // namespace kestrel::train::plan_detail
