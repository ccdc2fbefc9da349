// Private: ZeRO-1/2 for the trainer's data parallelism (distributed.zero). Policy:
// - Ownership: whole parameters, not slices of a flattened parameter space. The parameters, in the
//   ParameterList's order, are cut into `world` contiguous runs of about equal element counts:
//   parameter i (elements [start, start + n) of the flat order) belongs to the rank
//   floor((start + n/2) * world / total), its midpoint's rank. The elements counted are the
//   trainable ones (a frozen parameter of train.trainable has n = 0: it has no state or gradient
//   to shard), or all of them when nothing is trainable. Whole parameters keep AdamW, its
//   offload, its checkpoint names and resharding unchanged (an owned ParameterList is just a smaller
//   model to it); the price is balance, which is within one parameter's size of even (the embedding
//   and the LM head dominate a small model; a large one has hundreds of similar matrices).
// - Stage 1: gradients all-reduced as in stage 0 (every rank holds every mean gradient), the global
//   norm and clipping computed over all of them exactly as stage 0 does, AdamW (state for the owned
//   parameters only) steps the owned parameters, then each parameter is broadcast from its owner
//   (the all-gather of whole parameters).
// - Stage 2: each gradient bucket holds the parameters of one owner and is reduced to that owner
//   (Communicator::reduce); the other ranks drop those gradients as soon as the bucket is issued, so
//   a rank keeps only its own parameters' gradients after the step's last backward. The global norm
//   is the square root of the all-reduced sum of the ranks' squared partial norms (f32), so it and
//   the clipped gradients equal stage 0's up to the summation order; the clip factor is computed
//   and applied on the device (no host synchronisation).
#pragma once

#include <vector>

#include "kestrel/models/parameters.h"
#include "kestrel/runtime/communicator.h"

namespace kestrel::train {

// The owning rank of each parameter (ParameterList order), by the rule above.
std::vector<int> assign_parameter_owners(const models::ParameterList& params, int world);

// The parameters `rank` owns, in the list's order, under their names.
models::ParameterList owned_parameters(const models::ParameterList& params, const std::vector<int>& owners, int rank);

// Every rank's parameters become their owners' (one broadcast per parameter, in list order).
void gather_parameters(const models::ParameterList& params, const std::vector<int>& owners, Communicator& comm);

// Stage 2: the global L2 norm of the gradients spread over the ranks (each rank passes the ones it
// owns), and, when max_norm > 0, every passed gradient scaled in place by min(1, max_norm / (norm +
// 1e-6)) (clip_grad_norm's rule; a non-finite norm makes the gradients non-finite too, and the
// trainer's train.nonfinite then skips or stops the step). A [] f32 tensor on `device`.
Tensor clip_sharded_grad_norm(const std::vector<Tensor>& owned_grads, double max_norm, Communicator& comm,
                              Device device);

}  // namespace kestrel::train
