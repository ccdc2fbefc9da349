// RunConfig::resolve: the one place that turns device / precision / recompute / memory_budget /
// memory.* / train.deterministic / train.loss_gradient / fp8.* / attention.* into typed values (run_config.h states the rules).
#include "kestrel/train/run_config.h"

#include <limits>

#include "kestrel/runtime/error.h"
#include "kestrel/runtime/parse_number.h"

namespace kestrel::train {

std::string RunConfig::recompute_name() const {
  if (recompute_auto) return "auto";
  if (recompute_selective) return recompute == autograd::RecomputePolicy::Offload ? "selective+offload" : "selective";
  return autograd::policy_name(recompute);
}

Device RunConfig::resolve_device(const nlohmann::json& cfg) {
  const std::string dev = cfg["device"];
  if (dev == "auto") return cuda_available() ? Device::cuda(0) : Device::cpu();
  return parse_device(dev);
}

RunConfig RunConfig::resolve(const nlohmann::json& cfg) {
  RunConfig r;
  r.device = resolve_device(cfg);
  const std::string prec = cfg["precision"];
  if (prec == "auto") {
    r.dtype = r.device.is_cuda() ? DType::BF16 : DType::F32;
  } else {
    bool ok = true;
    try {
      r.dtype = parse_dtype(prec);
    } catch (const Error&) {
      ok = false;
    }
    ok = ok && (r.dtype == DType::F32 || r.dtype == DType::BF16 || r.dtype == DType::F16);
    KESTREL_CHECK(ok, "train", "precision must be auto, f32, bf16 or f16, got '", prec, "'");
  }
  const std::string recompute = cfg["recompute"];
  r.recompute_auto = recompute == "auto";
  r.recompute_selective = recompute == "selective" || recompute == "selective+offload";
  if (r.recompute_selective)
    r.recompute = recompute == "selective" ? autograd::RecomputePolicy::Keep : autograd::RecomputePolicy::Offload;
  else if (!r.recompute_auto) {
    try {
      r.recompute = autograd::parse_recompute_policy(recompute);
    } catch (const Error&) {
      throw make_error("train", "recompute must be none, recompute (or full), offload (or full+offload), selective, ",
                       "selective+offload or auto, got '", recompute, "'");
    }
  }
  const nlohmann::json& tile = cfg["mlp_tile_tokens"];
  r.mlp_tile_auto = tile.is_string();
  KESTREL_CHECK(r.mlp_tile_auto ? tile == "auto" : tile.is_number_integer() && tile.get<int64_t>() >= 0, "train",
                "mlp_tile_tokens must be \"auto\" or a token count >= 0 (0 = untiled), got ", tile.dump());
  r.mlp_tile_tokens = r.mlp_tile_auto ? 0 : tile.get<int64_t>();
  const nlohmann::json det = cfg["train"].value("deterministic", nlohmann::json(false));
  KESTREL_CHECK(det.is_boolean(), "train", "train.deterministic must be true or false, got ", det.dump());
  r.deterministic = det.get<bool>();
  const nlohmann::json lg = cfg["train"].value("loss_gradient", nlohmann::json("forward"));
  KESTREL_CHECK(lg == "forward" || lg == "backward", "train", "train.loss_gradient must be \"forward\" or ",
                "\"backward\", got ", lg.dump());
  r.loss_gradient_forward = lg == "forward";
  const nlohmann::json& fp8 = cfg["fp8"];
  r.fp8 = fp8["enabled"];
  const std::string scaling = fp8["scaling"];
  KESTREL_CHECK(scaling == "delayed", "train", "fp8.scaling must be \"delayed\" (per-tensor scales from an amax ",
                "history), got '", scaling, "'", scaling == "tile" || scaling == "tilewise" || scaling == "tile-wise"
                                                     ? ": tile-wise scaling is not implemented yet"
                                                     : "");
  r.fp8_recipe.amax_history = fp8["amax_history"];
  r.fp8_recipe.margin = fp8["margin"];
  r.fp8_recipe.grad_format = parse_fp8_format(fp8["grad_format"].get<std::string>(), "fp8.grad_format");
  r.fp8_recipe.fast_accum_forward = fp8["fast_accum_forward"];
  r.fp8_fused_casts = fp8["fused_casts"];
  KESTREL_CHECK(r.fp8_recipe.amax_history >= 1 && r.fp8_recipe.amax_history <= 1024, "train",
                "fp8.amax_history must be in [1, 1024], got ", r.fp8_recipe.amax_history);
  KESTREL_CHECK(r.fp8_recipe.margin <= 32, "train", "fp8.margin must be in [0, 32], got ", r.fp8_recipe.margin);
  KESTREL_CHECK(!r.fp8 || r.dtype == DType::BF16 || (r.dtype == DType::F32 && !r.device.is_cuda()), "train",
                "fp8.enabled needs precision bf16 (or f32 on the CPU, emulated), got ", dtype_name(r.dtype), " on ",
                r.device.str());
  const nlohmann::json& attn = cfg["attention"];
  KESTREL_CHECK(attn["backend"].is_string(), "train", "attention.backend must be \"auto\", \"kestrel\" or \"cudnn\", got ",
                attn["backend"].dump());
  r.attention_backend = parse_attention_backend(attn["backend"].get<std::string>(), "attention.backend");
  if (r.attention_backend == AttentionBackend::Cudnn) {
    KESTREL_CHECK(r.device.is_cuda(), "train", "attention.backend \"cudnn\" needs a CUDA device, the run is on ",
                  r.device.str());
    KESTREL_CHECK(r.dtype == DType::BF16 || r.dtype == DType::F16, "train",
                  "attention.backend \"cudnn\" needs precision bf16 or f16, got ", dtype_name(r.dtype));
    KESTREL_CHECK(!r.deterministic, "train", "attention.backend \"cudnn\" and train.deterministic together: the ",
                  "cuDNN backward adds dq by atomics (use attention.backend \"kestrel\" for a deterministic run)");
  }
  r.memory_budget = cfg["memory_budget"];
  if (!r.memory_budget.empty())
    r.memory_budget_bytes =
        parse_size(r.memory_budget, "memory_budget", 0, std::numeric_limits<int64_t>::max(), "train");
  const nlohmann::json& mem = cfg["memory"];
  r.memory.budget = r.memory_budget_bytes;
  r.memory.pinned_limit = parse_size(mem["pinned_limit"].get<std::string>(), "memory.pinned_limit", 1,
                                     std::numeric_limits<int64_t>::max(), "train");
  r.memory.offload_inflight = parse_size(mem["offload_inflight"].get<std::string>(), "memory.offload_inflight", 1,
                                         std::numeric_limits<int64_t>::max(), "train");
  r.memory.allocator = parse_allocator_backend(mem["allocator"].get<std::string>(), "memory.allocator");
  r.memory.matmul_tf32 = mem["matmul_tf32"];
  return r;
}

}  // namespace kestrel::train
