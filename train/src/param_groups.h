// Private: which parameters train, and with which weight decay and learning rate (issue 24).
//
// Config keys (train/src/train_config.cpp has the defaults):
// - train.trainable: glob patterns over the Hugging Face parameter names ("*" any run of characters,
//   dots included; "?" one character; everything else literal). A parameter trains when any pattern
//   matches its whole name; the others are frozen: requires_grad = false on the leaf, so no op
//   computes their gradient, AdamW keeps no state for them and the planner counts neither. Default
//   ["*"]. A pattern that matches no parameter is an error naming it (a typo would otherwise freeze
//   everything it meant to train), and so is a run with nothing to train.
//   Stage 1 of a LLaVA recipe: ["multi_modal_projector.*"]; stage 2: ["*"] or
//   ["multi_modal_projector.*", "language_model.*"] (tower frozen).
// - train.weight_decay_params: "matrices" (default; decay only tensors of >= 2 dimensions: weights of
//   linears, embeddings, the patch embedding, position tables; norms and biases do not decay, the
//   common practice of HF Trainer / nanoGPT) or "all" (every parameter decays, Kestrel's rule before).
// - train.vision_lr_scale: the vision tower's learning rate ("vision_tower.*") as a multiple of the
//   schedule's (default 1; e.g. 0.1 for a pretrained SigLIP under a fresh projector).
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "kestrel/models/config.h"
#include "kestrel/models/parameters.h"
#include "kestrel/train/optimizer.h"

namespace kestrel::train {

// Whole-string glob: '*' matches any run (dots too), '?' one character.
bool glob_match(std::string_view pattern, std::string_view name);

struct ParameterGroupRules {
  std::vector<std::string> trainable{"*"};
  bool decay_all = false;        // train.weight_decay_params "all"
  double vision_lr_scale = 1.0;  // train.vision_lr_scale

  // From a resolved trainer config; errors name the key.
  static ParameterGroupRules from_config(const nlohmann::json& cfg);
  bool trains_everything() const;
  bool is_trainable(const std::string& name) const;
  // AdamW's group of one parameter: its weight decay (`weight_decay` or 0) and lr multiplier.
  ParameterGroup group(const std::string& name, int64_t dim, double weight_decay) const;
  // Throws naming the first pattern that matches none of `names`, when none is trainable, or when
  // vision_lr_scale is not 1 and no name is a vision tower's.
  void check_names(const std::vector<std::string>& names) const;
};

// Freezes (requires_grad = false) every parameter the rules do not train; returns the trainable
// element count. Errors as check_names.
int64_t apply_trainable(const models::ParameterList& params, const ParameterGroupRules& rules);

}  // namespace kestrel::train

namespace kestrel::train {
// The parameters a model of `config` registers (HF name, element count), in the models' order, without
// allocating it: the planner counts trainable gradient and optimizer bytes from it. `vlm` false: the
// text decoder alone (no prefix). Tested equal to the models' own lists.
std::vector<std::pair<std::string, int64_t>> model_parameter_sizes(const models::VlmConfig& config, bool vlm);
}  // namespace kestrel::train
