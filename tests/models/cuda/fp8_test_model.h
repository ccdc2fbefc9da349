// The small llama the FP8 decoder GPU tests train (test_fp8_decoder_cuda.cpp,
// test_fp8_decoder_fused_cuda.cpp): every FP8 dimension a multiple of 16, two layers, GQA.
#pragma once

#include "kestrel/models/config.h"

namespace kestrel::models::testing_fp8 {

inline TextConfig fp8_text() {
  TextConfig c = TextConfig::defaults_for("llama");
  c.vocab_size = 512;
  c.hidden_size = 256;
  c.intermediate_size = 512;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 64;
  c.tie_word_embeddings = false;
  return c;
}

}  // namespace kestrel::models::testing_fp8
