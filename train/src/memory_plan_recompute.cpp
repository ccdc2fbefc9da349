// Choosing the recompute setting for a budget, and what each setting costs (memory_plan.h):
// the fastest that fits wins. Speed order: "none" re-runs nothing; "selective" re-runs each decoder
// layer but attention (norms, projections, RoPE, MLP: about the forward's GEMMs again); "recompute"
// (full) re-runs attention too; the offload settings add the host copies of what the regions keep.
#include <cstdio>
#include <sstream>

#include "kestrel/runtime/memory_budget.h"
#include "kestrel/train/memory_plan.h"
#include "kestrel/train/run_config.h"

namespace kestrel::train {

using nlohmann::json;

namespace {

std::vector<std::string> candidates(const json& config) {
  std::vector<std::string> c = {"none", "selective", "recompute"};
  if (RunConfig::resolve(config).on_cuda()) {  // offload moves bytes on CUDA only (the CPU keeps them in place)
    c.push_back("selective+offload");
    c.push_back("offload");
  }
  return c;
}

// The config with one recompute setting, an "auto" MLP tile planned untiled.
json with_recompute(const json& config, const std::string& name) {
  json c = config;
  c["recompute"] = name;
  if (c["mlp_tile_tokens"].is_string()) c["mlp_tile_tokens"] = 0;
  return c;
}

}  // namespace

std::string choose_recompute(const json& config, const PlanOptions& options) {
  const RunConfig run = RunConfig::resolve(config);
  if (!run.recompute_auto) return run.recompute_name();
  if (!run.has_budget()) return "none";
  const std::vector<std::string> names = candidates(config);
  for (const std::string& name : names) {
    const MemoryPlan p = plan_memory(with_recompute(config, name), options);
    if (p.budget <= 0 || p.headroom >= p.budget / 10) return name;
  }
  return names.back();
}

std::vector<RecomputeCost> recompute_costs(const json& config, const PlanOptions& options) {
  std::vector<RecomputeCost> out;
  for (const std::string& name : candidates(config)) {
    json c = config;
    c["recompute"] = name;  // the MLP tile as configured ("auto" chooses for each setting)
    const MemoryPlan p = plan_memory(c, options);
    RecomputeCost r;
    r.name = name;
    r.layer_bytes_per_token = p.layer_bytes_per_token;
    r.peak = p.peak;
    r.host_activations = p.host_activations;
    r.headroom = p.headroom;
    r.fits = p.fits;
    r.recomputes_attention = name == "recompute" || name == "offload";
    out.push_back(r);
  }
  return out;
}

std::string recompute_costs_table(const std::vector<RecomputeCost>& costs, int64_t budget) {
  std::ostringstream os;
  char buf[256];
  os << "recompute settings (kept = bytes per token per decoder layer kept for backward; saves = peak below \"none\"):\n";
  std::snprintf(buf, sizeof buf, "  %-18s %8s %14s %14s %14s  %-24s%s\n", "setting", "kept", "peak in use", "saves",
                "host", "backward re-runs", budget > 0 ? " budget" : "");
  os << buf;
  const int64_t none_peak = costs.empty() ? 0 : costs.front().peak;
  for (const RecomputeCost& c : costs) {
    const char* reruns = c.name == "none" ? "nothing" : c.recomputes_attention ? "layers incl. attention" : "layers but attention";
    std::snprintf(buf, sizeof buf, "  %-18s %6lld B %14s %14s %14s  %-24s%s\n", c.name.c_str(),
                  static_cast<long long>(c.layer_bytes_per_token), format_bytes(c.peak).c_str(),
                  format_bytes(none_peak - c.peak).c_str(), format_bytes(c.host_activations).c_str(), reruns,
                  budget > 0 ? (c.fits ? " fits" : " does not fit") : "");
    os << buf;
  }
  os << "  (each with the MLP tile as configured: \"auto\" tiles a setting whose untiled plan leaves under 10% of the\n"
        "   budget, so its kept bytes can be below the untiled figure; recompute \"auto\" plans untiled)\n";
  return os.str();
}

}  // namespace kestrel::train
