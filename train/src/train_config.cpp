#include "kestrel/train/train_config.h"

#include <cmath>
#include <limits>

#include "kestrel/runtime/error.h"
#include "kestrel/runtime/memory_config.h"
#include "kestrel/runtime/parse_number.h"

namespace kestrel::train {

using nlohmann::json;

// A byte count as the config writes it: "64GiB", "256MiB", else the plain number.
static std::string size_text(int64_t bytes) {
  for (auto [shift, unit] : {std::pair{40, "TiB"}, {30, "GiB"}, {20, "MiB"}, {10, "KiB"}})
    if (bytes > 0 && bytes % (int64_t{1} << shift) == 0) return std::to_string(bytes >> shift) + unit;
  return std::to_string(bytes);
}

json default_train_config() {
  // The memory settings default to the environment's (KESTREL_*; memory_config.h lists them).
  const MemoryConfig& mem = default_memory_config();
  return json{
      // vision_from / text_from: pretrained towers from HF folders under a fresh projector (vlm_init.h).
      {"model",
       {{"type", "vlm"},
        {"config", json::object()},
        {"config_path", ""},
        {"init_from", ""},
        {"vision_from", ""},
        {"text_from", ""}}},
      {"data",
       {{"type", "shapes"},
        {"image_size", 32},
        {"seed", 1},
        {"noise", 8},
        {"shape_scale", 1.0},
        // Dynamic high-resolution tiling (image_tiling.h): max_tiles 1 = off.
        {"image_tiling", {{"max_tiles", 1}, {"thumbnail", true}}},
        {"train_files", ""},
        {"seq_len", 256},
        {"doc_start_token", -1},
        {"tokenizer", "byte"},
        {"chat_template", "auto"},
        {"eval_offset", 1000000000},
        {"eval_samples", 100},
        // Decoders on "tokens" data: held-out llm.c token files; eval_every and the end of the run
        // report their mean next-token loss over eval_samples sequences of seq_len (tasks.cpp).
        {"eval_files", ""}}},
      {"train",
       {{"steps", 100},
        {"batch_size", 16},
        {"grad_accum", 1},
        {"lr", 1e-3},
        {"min_lr", 1e-4},
        {"warmup_steps", 10},
        {"weight_decay", 0.01},
        // Parameter groups (train/src/param_groups.h): which parameters train (globs over HF names),
        // which decay ("matrices": >= 2-D only), the vision tower's lr as a multiple of lr.
        {"trainable", json::array({"*"})},
        {"weight_decay_params", "matrices"},
        {"vision_lr_scale", 1.0},
        {"beta1", 0.9},
        {"beta2", 0.95},
        {"eps", 1e-8},
        {"grad_clip", 1.0},
        {"nonfinite", "stop"},
        // Bit-reproducible GPU runs (run_config.h): fixed-order embedding and attention backward.
        {"deterministic", false},
        // Where the loss head's gradients are computed (run_config.h): "forward" (one pass, the seed known
        // up front) or "backward" (from the saved log-sum-exp, the logits recomputed).
        {"loss_gradient", "forward"},
        {"seed", 1234}}},
      {"optimizer",
       {{"offload", "none"},
        {"state_dtype", "f32"},
        {"master_weights", "f32"},
        {"step_in_backward", false},
        {"gradients", "device"},
        // "auto" | "on" | "off": the host update overlaps the next forward (trainer.cpp).
        {"update_overlap", "auto"},
        {"staging_slot_mib", 64},
        {"staging_slots", 4}}},
      // Data parallelism (train/src/data_parallel.h): the launcher's world size comes from the
      // environment (torchrun / Slurm conventions, rendezvous.h), not from here.
      {"distributed", {{"backend", "auto"}, {"bucket_mib", 25.0}, {"timeout_s", 300.0}, {"zero", 0}}},
      {"device", "auto"},
      {"precision", "auto"},
      {"recompute", "none"},
      {"mlp_tile_tokens", "auto"},
      // FP8 linear layers of the decoder (kestrel/ops/fp8.h; run_config.h): off by default. "scaling":
      // "delayed" only (tile-wise is refused). The recipe defaults are the one the 500-step quality A/B
      // measured within 1% of bf16 (bench/RESULTS.md: e4m3 gradients, the last step's amax); the
      // library's Fp8Recipe{} keeps Transformer Engine's e5m2 / history-16 defaults.
      {"fp8",
       {{"enabled", false},
        {"scaling", "delayed"},
        {"amax_history", 1},
        {"margin", 0},
        {"grad_format", "e4m3"},
        {"fast_accum_forward", true},
        // The q/k/v, gate/up and down input casts come from their producers (kestrel/ops/fp8_producers.h:
        // SwiGLU's in its own pass, the norms' right after them): the same bits; false for A/Bs.
        {"fused_casts", true}}},
      // The decoder's attention implementation (kestrel/ops/attention.h AttentionBackend): "auto"
      // (the measured rule of ops/cuda/attention_backend.cpp: Kestrel's kernels today), "kestrel" or "cudnn".
      {"attention", {{"backend", "auto"}}},
      {"memory_budget", mem.budget > 0 ? size_text(mem.budget) : ""},
      {"memory",
       {{"pinned_limit", size_text(mem.pinned_limit)},
        {"offload_inflight", size_text(mem.offload_inflight)},
        {"allocator", std::string(allocator_backend_name(mem.allocator))},
        {"matmul_tf32", mem.matmul_tf32}}},
      {"threads", 0},
      {"prefetch", 4},
      {"prefetch_threads", 0},
      {"log_every", 10},
      {"eval_every", 0},
      {"sample_every", 0},
      {"sample_count", 3},
      // Step N's device time per op (kestrel/runtime/op_profile.h) in the log and out_dir/op_profile.json; 0 = off.
      {"profile_step", 0},
      {"checkpoint_every", 0},
      {"keep_checkpoints", 2},
      {"checkpoint_optimizer_state", "full"},
      {"out_dir", "runs/train"},
      {"on_cpu", json::object()},
      {"on_cuda", json::object()},
  };
}

namespace {

std::string keys_of(const json& obj) {
  std::string s;
  for (auto it = obj.begin(); it != obj.end(); ++it) s += (s.empty() ? "" : ", ") + it.key();
  return s;
}

bool same_kind(const json& a, const json& b) {
  if (a.is_number() && b.is_number()) return true;
  return a.type() == b.type();
}

// Integer keys take integers: 2.5 would be truncated and -3 would wrap where the value is a count. A
// JSON float with no fractional part (1e3) is that integer. Counts stay within int32; seeds and the
// evaluation offset may use the int64 range; doc_start_token may be -1 (none).
json integer_value(const json& v, const std::string& key, const std::string& source) {
  const bool wide = key.ends_with("seed") || key == "data.eval_offset";
  const int64_t min = key == "data.doc_start_token" ? -1 : 0;
  const int64_t max = wide ? std::numeric_limits<int64_t>::max() : std::numeric_limits<int32_t>::max();
  bool ok = false;
  int64_t x = 0;
  if (v.is_number_unsigned()) {
    ok = v.get<uint64_t>() <= static_cast<uint64_t>(max);
    x = ok ? static_cast<int64_t>(v.get<uint64_t>()) : 0;
  } else if (v.is_number_integer()) {
    x = v.get<int64_t>();
    ok = true;
  } else {
    const double d = v.get<double>();
    ok = std::isfinite(d) && d == std::trunc(d) && std::fabs(d) < 9e18;
    x = ok ? static_cast<int64_t>(d) : 0;
  }
  KESTREL_CHECK(ok && x >= min && x <= max, "config", source, ": '", key, "' must be ", integer_range_text(min, max),
                ", got ", v.dump());
  return x;
}

void merge(json& base, const json& user, const std::string& path, const std::string& source) {
  KESTREL_CHECK(user.is_object(), "config", source, ": '", path.empty() ? "<root>" : path, "' must be an object");
  for (auto it = user.begin(); it != user.end(); ++it) {
    std::string key = path.empty() ? it.key() : path + "." + it.key();
    KESTREL_CHECK(base.contains(it.key()), "config", source, ": unknown key '", key, "'; valid keys",
                  path.empty() ? "" : " of '" + path + "'", ": ", keys_of(base));
    json& slot = base[it.key()];
    if (key == "model.config") {
      KESTREL_CHECK(it.value().is_object(), "config", source, ": 'model.config' must be an object (HF config.json)");
      slot = it.value();
    } else if (key == "on_cpu" || key == "on_cuda") {
      KESTREL_CHECK(it.value().is_object(), "config", source, ": '", key,
                    "' must be an object of dotted overrides, e.g. {\"train.steps\": 500}");
      for (auto o = it.value().begin(); o != it.value().end(); ++o) slot[o.key()] = o.value();
    } else if (key == "mlp_tile_tokens") {
      // "auto" (chosen from the memory budget) or a token count (0: untiled).
      const json& v = it.value();
      KESTREL_CHECK(v.is_number() || v == "auto", "config", source,
                    ": 'mlp_tile_tokens' must be \"auto\" or a token count (0 = untiled), got ", v.dump());
      slot = v.is_number() ? integer_value(v, key, source) : v;
    } else if (slot.is_object()) {
      merge(slot, it.value(), key, source);
    } else {
      KESTREL_CHECK(same_kind(slot, it.value()), "config", source, ": '", key, "' must be a ", slot.type_name(),
                    ", got ", it.value().type_name(), " (", it.value().dump(), ")");
      slot = slot.is_number_integer() ? integer_value(it.value(), key, source) : it.value();
    }
  }
}

}  // namespace

json resolve_train_config(const json& user, const std::string& source) {
  json cfg = default_train_config();
  merge(cfg, user, "", source);
  return cfg;
}

void apply_override(json& config, const std::string& assignment) {
  auto eq = assignment.find('=');
  KESTREL_CHECK(eq != std::string::npos && eq > 0, "config", "--set expects key=value, got '", assignment, "'");
  std::string key = assignment.substr(0, eq), text = assignment.substr(eq + 1);
  json value;
  try {
    value = json::parse(text);
  } catch (...) {
    value = text;
  }
  // Build a nested user object and merge it with the same checks as the file.
  json patch = value;
  std::string rest = key;
  std::vector<std::string> parts;
  size_t pos;
  while ((pos = rest.find('.')) != std::string::npos) {
    parts.push_back(rest.substr(0, pos));
    rest = rest.substr(pos + 1);
  }
  parts.push_back(rest);
  // Under model.config anything goes (validated by the model).
  if (parts.size() >= 3 && parts[0] == "model" && parts[1] == "config") {
    json* p = &config["model"]["config"];
    for (size_t i = 2; i + 1 < parts.size(); ++i) p = &(*p)[parts[i]];
    (*p)[parts.back()] = value;
    return;
  }
  for (auto it = parts.rbegin(); it != parts.rend(); ++it) patch = json{{*it, patch}};
  json base = config;
  merge(base, patch, "", "--set " + assignment);
  config = base;
}

std::vector<std::string> apply_device_overrides(json& config, bool on_cuda, const std::vector<std::string>& sets) {
  const char* key = on_cuda ? "on_cuda" : "on_cpu";
  std::vector<std::string> applied;
  json overrides = config[key];
  config["on_cpu"] = json::object();
  config["on_cuda"] = json::object();
  for (auto it = overrides.begin(); it != overrides.end(); ++it) {
    const std::string a = it.key() + "=" + it.value().dump();
    apply_override(config, a);
    applied.push_back(a);
  }
  for (const std::string& s : sets) apply_override(config, s);
  return applied;
}

}  // namespace kestrel::train
