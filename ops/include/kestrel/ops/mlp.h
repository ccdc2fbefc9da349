// The SwiGLU MLP of Llama-family decoders, down(silu(x gate^T) * (x up^T)), run over token tiles.
//
// Composed of linear/swiglu ops, the MLP keeps three [T, I] activations for backward (gate, up and
// their product): at long contexts the largest thing a layer holds. swiglu_mlp_tiled keeps only its
// input x: the forward runs tile by tile (rows of x), and the backward recomputes each tile's gate and
// up before forming its gradients, so the working set is a few [tile_rows, I] buffers whatever T is.
// The price is two extra GEMMs per tile in backward (the gate and up projections again).
// Weight gradients are summed over the tiles by their GEMMs (beta = 1); a weight that already holds a
// gradient (accumulation over micro-batches) gets this one added in place, with no second buffer.
#pragma once

#include "kestrel/runtime/tensor.h"

namespace kestrel {

// x [T, C]; gate_w, up_w [I, C]; down_w [C, I]; one dtype and device. tile_rows > 0. Returns [T, C].
// Differentiable in x and the three weights.
Tensor swiglu_mlp_tiled(const Tensor& x, const Tensor& gate_w, const Tensor& up_w, const Tensor& down_w,
                        int64_t tile_rows);

}  // namespace kestrel
