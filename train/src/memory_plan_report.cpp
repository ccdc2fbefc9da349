// MemoryPlan's report (memory_plan.h): the JSON of `kestrel-mem plan --json` and the table it prints.
#include <cstdio>
#include <sstream>

#include "kestrel/runtime/memory_budget.h"
#include "kestrel/train/memory_plan.h"

namespace kestrel::train {

using nlohmann::json;

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
