// The memory planner (see memory_plan.h): a replay of one optimizer step's allocations, block by
// block, on a ledger of bytes per tag. This file replays the step (setup, data, optimizer state, the
// micro-batches, the embeddings, vision tower, projector, splice and loss around the layers);
// memory_plan_layers.cpp and memory_plan_fp8.cpp replay one decoder layer or vision block
// (models/src/{vision,vlm,decoder}.cpp and the tape entries of ops/src/*); when that code changes
// what it allocates or saves, change the matching lines and the plan-vs-profile test says so.
#include "kestrel/train/memory_plan.h"

#include <algorithm>
#include <deque>

#include "kestrel/autograd/recompute.h"
#include "kestrel/models/config.h"
#include "kestrel/models/decoder.h"
#include "kestrel/runtime/dtype.h"
#include "kestrel/runtime/error.h"
#include "kestrel/runtime/memory_budget.h"
#include "kestrel/train/optimizer.h"
#include "kestrel/train/run_config.h"
#include "kestrel/train/image_tiling.h"
#include "kestrel/train/shapes_dataset.h"
#include "kestrel/train/tokenizer.h"
#include "memory_plan_planner.h"
#include "memory_plan_workspace.h"
#include "param_groups.h"
#include "vlm_init.h"

namespace kestrel::train {

using nlohmann::json;
using autograd::RecomputePolicy;
using namespace plan_detail;

namespace {

int64_t decoder_parameter_count(const models::TextConfig& t) {
  const int64_t C = t.hidden_size, D = t.head_dim, Hq = t.num_attention_heads, Hkv = t.num_key_value_heads;
  const int64_t I = t.intermediate_size;
  int64_t layer = 2 * C + (Hq + 2 * Hkv) * D * C + C * Hq * D + 3 * I * C;
  if (t.qkv_bias()) layer += (Hq + 2 * Hkv) * D;
  if (t.o_proj_bias()) layer += C;
  return t.vocab_size * C + t.num_hidden_layers * layer + C + (t.tie_word_embeddings ? 0 : t.vocab_size * C);
}

int64_t vlm_parameter_count(const models::VlmConfig& mc) {
  const auto& v = mc.vision_config;
  const auto& t = mc.text_config;
  const int64_t E = v.hidden_size, IV = v.intermediate_size, P = v.patch_size, N = v.num_patches();
  int64_t vision = E * v.num_channels * P * P + E + N * E +
                   v.num_hidden_layers * (4 * (E * E + E) + 4 * E + IV * E + IV + E * IV + E) + 2 * E;
  const int64_t s = mc.pixel_shuffle_factor, C = t.hidden_size;
  const int64_t Hp = mc.projector_hidden_size > 0 ? mc.projector_hidden_size : C;
  int64_t proj = Hp * E * s * s + Hp + C * Hp + C;
  return vision + proj + decoder_parameter_count(t);
}

}  // namespace

MemoryPlan plan_memory(const json& cfg, const PlanOptions& options) {
  if (RunConfig::resolve(cfg).recompute_auto) {
    json chosen = cfg;
    chosen["recompute"] = choose_recompute(cfg, options);
    MemoryPlan p = plan_memory(chosen, options);
    p.recompute += " (auto)";
    return p;
  }
  MemoryPlan plan;
  std::string type = cfg["model"]["type"];
  KESTREL_CHECK(type == "vlm" || type == "decoder", "plan", "model.type '", type,
                "' is not supported; use \"vlm\" or \"decoder\"");
  // A decoder-only run is planned as a VLM without a vision tower, projector or splice.
  const bool vlm = type == "vlm";
  const std::string config_path = cfg["model"]["config_path"];
  models::VlmConfig mc;
  if (vlm) {
    mc = resolve_vlm_config(cfg);  // towers' configs from model.vision_from / text_from (vlm_init.h)
  } else {
    mc.text_config = config_path.empty() ? models::TextConfig::from_json(cfg["model"]["config"], "model.config")
                                         : models::TextConfig::from_file(config_path);
    mc.vision_config.num_hidden_layers = 0;
  }
  const RunConfig run = RunConfig::resolve(cfg);
  // The cuDNN attention backward's workspace holds the engine workspace that cuDNN's heuristics pick
  // on the device at run time; without it any figure would be a guess (the planner models Kestrel's
  // kernels, which "auto" runs).
  KESTREL_CHECK(run.attention_backend != AttentionBackend::Cudnn, "plan",
                "attention.backend \"cudnn\" is not modelled by the memory planner (its backward workspace "
                "depends on the engine cuDNN picks at run time); plan with attention.backend \"auto\" or "
                "\"kestrel\", or give recompute and mlp_tile_tokens explicitly instead of \"auto\"");
  const bool on_cuda = run.on_cuda();
  const DType dtype = run.dtype;
  const RecomputePolicy policy = run.recompute;
  const json& tr = cfg["train"];
  // Data parallelism (train/src/data_parallel.h, zero.h): one rank's share of each micro-batch.
  const int64_t W = options.world_size;
  KESTREL_CHECK(W >= 1 && tr["batch_size"].get<int64_t>() % W == 0, "plan", "train.batch_size ",
                tr["batch_size"].dump(), " (the global micro-batch) does not split evenly over ", W, " ranks");
  const int64_t B = tr["batch_size"].get<int64_t>() / W;
  plan.world_size = W;
  plan.zero = W > 1 && cfg.contains("distributed") ? static_cast<int>(cfg["distributed"]["zero"].get<int64_t>()) : 0;
  const int64_t state_shard = plan.zero >= 1 ? W : 1;  // ZeRO-1/2: each rank's AdamW owns ~1/W
  plan.device = on_cuda ? "cuda" : "cpu";
  plan.precision = std::string(dtype_name(dtype));
  plan.recompute = run.recompute_name();
  plan.external = options.external_bytes >= 0 ? options.external_bytes : (on_cuda ? int64_t{560} << 20 : 0);
  plan.budget = run.memory_budget_bytes;

  // Tokens: the largest micro-batch of the planned steps (captions vary in length).
  Shapes s;
  s.b = static_cast<int64_t>(dtype_size(dtype));
  // data.image_tiling (image_tiling.h): a record's picture is several tower images. Shapes pictures
  // all share one grid; other data is planned at the most a picture can have.
  const ImageTiling tiling = vlm ? image_tiling_from_config(cfg["data"]) : ImageTiling{};
  int64_t per_record = 1;
  if (tiling.enabled())
    per_record = cfg["data"]["type"] == "shapes"
                     ? choose_tile_grid(cfg["data"]["image_size"].get<int64_t>(), cfg["data"]["image_size"].get<int64_t>(),
                                        mc.vision_config.image_size, tiling)
                           .images()
                     : tiling.max_tiles + (tiling.thumbnail ? 1 : 0);
  s.B = vlm ? B * per_record : 0;
  const int64_t tpi = vlm ? mc.image_tokens_per_image() * per_record : 0;  // image slots per record
  s.Tv = s.B * mc.vision_config.num_patches();
  s.Ti = B * tpi;
  if (!vlm) s.T = B * cfg["data"]["seq_len"].get<int64_t>();  // rows x seq_len, every micro-batch alike
  if (vlm && cfg["data"]["type"] == "chat") {
    // Conversations (chat_data.h): rows of seq_len, padded; a row's images vary, planned at the most a
    // row can hold (seq_len / tokens_per_image: its slots alone would fill it), an upper bound.
    const int64_t seq_len = cfg["data"]["seq_len"];
    KESTREL_CHECK(seq_len > mc.image_tokens_per_image(), "memory_plan", "data.seq_len (", seq_len,
                  ") must exceed one image's ", mc.image_tokens_per_image(), " image-token slots");
    s.B = B * (seq_len / mc.image_tokens_per_image());
    s.Tv = s.B * mc.vision_config.num_patches();
    s.Ti = s.B * mc.image_tokens_per_image();
    s.T = B * seq_len;
  } else if (vlm) {
    const json& d = cfg["data"];
    ShapesConfig sc;
    sc.image_size = d["image_size"];
    sc.seed = d["seed"];
    sc.noise = d["noise"];
    sc.shape_scale = d["shape_scale"];
    ShapesDataset ds(sc);
    ByteTokenizer tok;
    std::vector<uint8_t> img(static_cast<size_t>(ds.image_bytes()));
    const int64_t micro = std::clamp<int64_t>(options.steps > 0 ? options.steps : tr["steps"].get<int64_t>(), 1, 64) *
                          tr["grad_accum"].get<int64_t>();
    for (int64_t m = 0; m < micro; ++m) {
      int64_t T = 0;
      for (int64_t i = 0; i < B; ++i)
        T += tpi + 2 + static_cast<int64_t>(tok.encode(ds.render(static_cast<uint64_t>(m * B + i), img).caption).size());
      s.T = std::max(s.T, T);
    }
  }
  plan.tokens = s.T;
  plan.parameters = vlm ? vlm_parameter_count(mc) : decoder_parameter_count(mc.text_config);
  // train.trainable (param_groups.h): gradients and optimizer state exist for trainable parameters only.
  const ParameterGroupRules rules = ParameterGroupRules::from_config(cfg);
  const std::vector<std::pair<std::string, int64_t>> sizes = model_parameter_sizes(mc, vlm);
  {
    std::vector<std::string> names;
    for (const auto& [name, n] : sizes) names.push_back(name), plan.trainable_parameters += rules.is_trainable(name) ? n : 0;
    rules.check_names(names);
  }
  const auto trains = [&rules](const std::string& name) { return rules.is_trainable(name); };
  bool vision_trains = false;  // any tower parameter: else the tower records nothing and has no backward
  for (const auto& [name, n] : sizes) vision_trains |= name.starts_with("vision_tower.") && rules.is_trainable(name);

  plan.mlp_tile_tokens = run.mlp_tile_auto ? choose_mlp_tile_tokens(cfg, options) : run.mlp_tile_tokens;
  Planner P(mc, s, policy, on_cuda, plan.mlp_tile_tokens);
  // LLaVA's features (vision_feature_layer): the blocks up to that hidden state run, no post_layernorm.
  const bool post_ln = !mc.vision_feature_layer;
  P.LV_ = vlm ? mc.vision_blocks_used() : 0;
  P.selective_ = run.recompute_selective && policy != RecomputePolicy::None;
  P.fp8_ = run.fp8;
  plan.layer_bytes_per_token = policy == RecomputePolicy::None
                                   ? P.decoder_layer_saved() / std::max<int64_t>(s.T, 1)
                                   : P.C_ * s.b + (P.selective_ ? P.Hq_ * P.D_ * s.b + P.Hq_ * 4 : 0);
  P.trains = trains;
  P.text_prefix = vlm ? "language_model." : "";
  const std::string tp = P.text_prefix;
  Ledger& L = P.led;
  const int64_t b = s.b, T = s.T, C = P.C_, E = P.E_, V = P.V_;
  const auto& tc = mc.text_config;
  const int64_t pbytes = plan.parameters * b;
  L.where = "setup";
  // The CUDA context's cuBLASLt workspace exists before the model (it is live for the whole run).
  if (on_cuda) L.alloc(MemoryTag::Workspace, cuda_context_workspace_bytes());
  L.alloc(MemoryTag::Parameter, pbytes);
  if (!on_cuda) {
    // CPU initialisation draws each weight as an f32 tensor (tagged Parameter) before copying it in;
    // the last one drawn comes when every other parameter exists: the VLM's projector linear_2
    // [C, Hp]; a decoder's untied lm_head [V, C], or with tied embeddings its last down_proj [C, I].
    const int64_t Cx = mc.text_config.hidden_size;
    const int64_t Hpx = mc.projector_hidden_size > 0 ? mc.projector_hidden_size : Cx;
    const int64_t last = vlm ? Cx * Hpx
                             : (mc.text_config.tie_word_embeddings ? Cx * mc.text_config.intermediate_size
                                                                   : Cx * mc.text_config.vocab_size);
    L.alloc(MemoryTag::Parameter, last * 4);
    L.free(MemoryTag::Parameter, last * 4);
  }
  // fp8.enabled: the decoder's Fp8State (ops/src/fp8.cpp), made by enable_fp8 outside any tag scope:
  // f32 amax [3 n], history [3 n, H] and scale [3 n] for its n = layers x 7 projections.
  if (run.fp8) {
    const int64_t rows = 3 * models::Decoder::kFp8LinearsPerLayer * mc.text_config.num_hidden_layers;
    L.alloc(MemoryTag::Temporary, rows * (run.fp8_recipe.amax_history + 2) * 4);
  }
  // AdamW state (train/src/optimizer.cpp, one rule: optimizer_state_bytes_per_param): moments (f32,
  // or q8: 2 bytes + two f32 scales per 2048), plus f32 masters for 16-bit parameters unless
  // optimizer.master_weights is "none", on the device; with optimizer.offload "host" (CUDA) the
  // f32 master + moments live in host memory instead and the device holds nothing of it; the host
  // also pins 2 x staging_slots x staging_slot_mib.
  const OptimizerPlacement placement = optimizer_placement_from_config(cfg, on_cuda ? Device::cuda(0) : Device::cpu());
  OptimizerStateBytes per_param = optimizer_state_bytes_per_param(placement, dtype, on_cuda);
  per_param.device /= static_cast<double>(state_shard);  // ZeRO-1/2: per GPU
  per_param.host /= static_cast<double>(state_shard);
  const bool step_in_backward = placement.step_in_backward;
  // optimizer.gradients "host" (train/src/gradient_stream.h) copies each gradient out at the hook where
  // step_in_backward would update it: on the device both drop it at the same point.
  const bool stream_grads = on_cuda && cfg["optimizer"]["gradients"] == "host";
  const bool drop_grads = step_in_backward || stream_grads;
  if (stream_grads) plan.host_gradients = plan.parameters * b;  // GradientStream pins a slice for every parameter
  plan.optimizer_offload = optimizer_offload_name(placement.offload);
  plan.master_weights = master_weights_name(placement.master_weights);
  plan.state_dtype = optimizer_state_dtype_name(placement.state_dtype);
  plan.step_in_backward = step_in_backward;
  plan.bytes_per_param_weights = static_cast<double>(b);
  plan.bytes_per_param_grads = step_in_backward ? 0.0 : static_cast<double>(b);
  plan.bytes_per_param_device_state = per_param.device;
  plan.bytes_per_param_host_state = per_param.host;
  const auto state_bytes = [&](double per) {
    return static_cast<int64_t>(std::ceil(per * static_cast<double>(plan.trainable_parameters)));
  };
  if (placement.offload == OptimizerOffload::Host && on_cuda) {
    plan.host_optimizer_state = state_bytes(per_param.host);
    plan.host_pinned = 2 * static_cast<int64_t>(placement.staging_slots) * placement.staging_slot_bytes;
  } else if (placement.offload == OptimizerOffload::Host) {
    L.alloc(MemoryTag::OptimizerState, state_bytes(per_param.host));  // CPU parameters: host memory anyway
  } else {
    L.alloc(MemoryTag::OptimizerState, state_bytes(per_param.device));
  }

  // The batch (train/src/batch_prefetcher.cpp). On the CPU its arrays view the prefetcher's host
  // memory (not counted). On CUDA they are device copies (Activation, label "data"): ids, labels,
  // positions [T] i64, cu_seqlens, and for the VLM pixels [images, 3, S, S] already in the model dtype
  // (made so on the host, vlm_data.cpp) and image slots [Ti] i64; with prefetch on, the next
  // micro-batch is uploaded as the step starts, so two batches are live. The step's pixels die
  // with the forward.
  const int64_t S = mc.vision_config.image_size;
  auto block = [&](int64_t bytes) { return on_cuda ? cuda_block_bytes(bytes) : bytes; };
  const int64_t pixels = on_cuda && vlm ? block(s.B * 3 * S * S * b) : 0;
  const int64_t batch_bytes =
      on_cuda ? 3 * block(T * 8) + block((B + 1) * 4) + (vlm ? pixels + block(s.Ti * 8) : 0) : 0;
  const int64_t batches = on_cuda && cfg.value("prefetch", 0) > 0 ? 2 : 1;
  L.where = "data";
  L.alloc(kAct, batches * batch_bytes);

  // One micro-batch; with train.grad_accum > 1 a second one replays with the first one's parameter
  // gradients held (they are the peak of accumulation: later micro-batches add into them).
  const int64_t accum = cfg["train"]["grad_accum"].get<int64_t>();
  // ZeRO-2 (one micro-batch per step): a rank drops the gradients it does not own as their bucket
  // is reduced to the owner, about where step_in_backward drops them; it keeps ~1/W.
  const int64_t grad_shard = plan.zero == 2 && accum == 1 && !drop_grads ? W : 1;
  if (grad_shard > 1) plan.bytes_per_param_grads /= static_cast<double>(grad_shard);
  auto shed = [&](int64_t bytes) {
    if (grad_shard > 1) L.free(kGrad, bytes - bytes / grad_shard);
  };
  // train.loss_gradient "forward": the loss head computes its gradients in the forward, for the seed the
  // loop allocates before it (CrossEntropyOptions::known_grad); "backward": from the saved lse.
  const bool loss_grad_forward = run.loss_gradient_forward;
  auto micro_batch = [&](bool first) {
    if (!first) L.alloc(kAct, pixels);  // the next micro-batch's pixels (the forward frees them)
    if (loss_grad_forward) L.alloc(kGrad, 4);  // the seed
    // ---- forward ----
    const bool regions = policy != RecomputePolicy::None;
    L.where = "forward: embed";
    L.alloc(kAct, T * C * b);  // token embeddings (live until the splice)
    const int64_t Tv = s.Tv, TE = Tv * E * b, P2 = mc.vision_config.patch_size * mc.vision_config.patch_size;
    const int64_t Ti = s.Ti, sf = mc.pixel_shuffle_factor;
    const int64_t Hp = mc.projector_hidden_size > 0 ? mc.projector_hidden_size : C;
    if (vlm) {
      L.where = "forward: vision";
      L.alloc(kAct, Tv * 3 * P2 * b);  // unfolded patches (saved by the patch GEMM)
      L.alloc(kAct, TE);               // patch GEMM out
      L.alloc(kAct, TE + (s.B + 1) * 4); // + positions; cu_seqlens (one document per tower image)
      L.free(kAct, TE);
      // A frozen tower records nothing: its tensors die as the forward moves on.
      if (!vision_trains) L.free(kAct, Tv * 3 * P2 * b);
      for (int64_t l = 0; l < P.LV_; ++l) {
        L.where = "forward: vision.block." + std::to_string(l);
        if (regions || !vision_trains)
          P.vision_block_forward_nograd();
        else
          P.vision_block_forward_recorded(kAct);
        if (!vision_trains) L.free(kAct, TE);  // the block's input
      }
      L.where = "forward: projector";
      if (post_ln) {
        L.alloc(kAct, TE + 2 * Tv * 4);  // post layernorm y (freed when the projector returns), mean, rstd
        if (!vision_trains) L.free(kAct, TE + 2 * Tv * 4 + (s.B + 1) * 4);  // its input, mean, rstd; cu_seqlens
      } else if (!vision_trains) {
        L.free(kAct, (s.B + 1) * 4);  // cu_seqlens; the last block's output is the projector's input
      }
      L.alloc(kAct, TE);                    // pixel-shuffle contiguous copy
      L.alloc(kAct, 2 * Ti * Hp * b);       // linear_1, gelu
      L.alloc(kAct, Ti * C * b);            // linear_2 (img)
      L.free(kAct, TE);                     // the post-layernorm output (only views of it were recorded)
      L.where = "forward: splice";
      L.alloc(kAct, T * C * b);             // spliced embeddings
      L.free(kAct, Ti * C * b + T * C * b); // img and the token embeddings
    }
    // Offload regions (autograd/src/recompute.cpp, runtime/cuda/offloader.cpp): each region input
    // goes to pinned host memory after its region's forward; its block returns when the copy lands.
    // The offloader lets 256 MiB of copies, and always two, be in flight before the host waits.
    // Selective regions offload the kept attention output and lse after the input, as copies of their own.
    const bool offload = policy == RecomputePolicy::Offload && on_cuda;
    const int64_t region_input = T * C * b;
    const int64_t kept_out = P.selective_ ? T * P.Hq_ * P.D_ * b : 0, kept_lse = P.selective_ ? T * P.Hq_ * 4 : 0;
    if (offload && P.selective_) P.kept_tag_ = MemoryTag::Checkpoint;
    std::deque<int64_t> copies;  // offload copies in flight, oldest first (runtime/cuda/offloader.cpp: throttle)
    int64_t in_flight = 0;       // their bytes
    auto offload_copy = [&](int64_t bytes) {
      if (bytes == 0) return;
      copies.push_back(bytes);
      in_flight += bytes;
      while (in_flight > run.memory.offload_inflight && copies.size() > 2) {  // the host waits for the oldest
        L.free(kAct, copies.front());
        in_flight -= copies.front();
        copies.pop_front();
      }
    };
    for (int64_t l = 0; l < P.L_; ++l) {
      L.where = "forward: decoder.layer." + std::to_string(l);
      if (regions)
        P.decoder_layer_forward_nograd();
      else
        P.decoder_layer_forward_recorded(kAct);
      if (offload) {
        offload_copy(region_input);
        offload_copy(kept_out);
        offload_copy(kept_lse);
      }
    }
    L.where = "forward: final norm + loss";
    L.alloc(kAct, T * C * b + T * 4);  // final norm out, rstd
    // The fused linear + cross-entropy scratch. CPU (ops/cpu/cross_entropy.cpp): [Nc, Vc] f32 logits,
    // and for bf16/f16 the converted hidden and weight chunks; backward adds the f32 d_weight and the
    // chunk's d_hidden. CUDA: the launcher's workspace in forward (with the kept 16-bit rows when it
    // forms the gradients too); in backward the lse-based pass's
    // (ops/cuda/fused_linear_cross_entropy_backward.cu: a logits block, its gradient, an f32 d_hidden).
    const int64_t Nc = std::min<int64_t>(512, T);
    const int64_t Vc = std::clamp<int64_t>(std::clamp<int64_t>((int64_t{4} << 20) / std::max<int64_t>(C, 1), 256, 4096), 1, V);
    const int64_t ce_forward = on_cuda ? cuda_cross_entropy_workspace_bytes(T, V, dtype, false)
                                       : Nc * Vc * 4 + (dtype == DType::F32 ? 0 : (Nc + Vc) * C * 4);
    const int64_t ce_backward =
        on_cuda ? cuda_cross_entropy_backward_workspace_bytes(T, V, C, dtype)
                : ce_forward + (dtype == DType::F32 ? 0 : V * C * 4 + Nc * C * 4);
    // d_lm_head (the tied embedding's gradient); later micro-batches add into it in place (the fused
    // cross-entropy's d_weight GEMM with beta = 1), no new buffer.
    const std::string head = tc.tie_word_embeddings ? "model.embed_tokens.weight" : "lm_head.weight";
    const int64_t head_grad = trains(tp + head) ? V * C * b : 0;
    if (loss_grad_forward) {
      // Loss and both gradients now (ops/src/cross_entropy.cpp): d_hidden held for the backward, the
      // head's gradient allocated (first micro-batch) or added into; nothing keeps the final norm output.
      L.alloc(kAct, 4);           // loss
      L.free(kAct, in_flight);    // the last copies land during the loss
      L.alloc(kGrad, T * C * b);  // d_hidden
      if (first) L.alloc(kGrad, head_grad);
      if (on_cuda) {
        const int64_t ce_single = cuda_cross_entropy_workspace_bytes(T, V, dtype, true);
        L.alloc(MemoryTag::Workspace, ce_single);
        L.free(MemoryTag::Workspace, ce_single);
      } else {
        L.alloc(kAct, T * 4);  // the CPU's lse, between its forward and backward kernels
        L.alloc(MemoryTag::Workspace, ce_forward);
        L.free(MemoryTag::Workspace, ce_forward);
        L.alloc(MemoryTag::Workspace, ce_backward);
        L.free(MemoryTag::Workspace, ce_backward);
        L.free(kAct, T * 4);
      }
      L.free(kAct, T * C * b);  // the final norm output
    } else {
      L.alloc(kAct, 4 + T * 4);  // loss, lse (f32)
      L.free(kAct, in_flight);  // the last copies land during the loss
      L.alloc(MemoryTag::Workspace, ce_forward);
      L.free(MemoryTag::Workspace, ce_forward);
    }
    if (offload) plan.host_activations = P.L_ * (region_input + kept_out + kept_lse);
    L.free(kAct, pixels);  // the step's batch copy of the pixels

    // ---- backward ----
    L.where = "backward: loss";
    if (!loss_grad_forward) {
      L.alloc(kGrad, 4);  // the seed
      L.alloc(kGrad, T * C * b);  // d_hidden
      if (first) L.alloc(kGrad, head_grad);
      L.alloc(MemoryTag::Workspace, ce_backward);
      L.free(MemoryTag::Workspace, ce_backward);
    }
    // step_in_backward: an untied lm_head is complete here; its hook updates it and drops the gradient.
    if (drop_grads && !tc.tie_word_embeddings) L.free(kGrad, head_grad);
    if (!tc.tie_word_embeddings) shed(head_grad);
    if (!loss_grad_forward) L.free(kAct, T * 4 + T * C * b);  // lse and the final norm output (saved by the loss)
    L.free(kGrad, 4);
    L.where = "backward: final norm";
    const int64_t norm_grad = trains(tp + "model.norm.weight") ? C * b : 0;
    L.alloc(kGrad, T * C * b + norm_grad);
    P.workspace(cuda_norm_backward_workspace_bytes(T, C, 1));
    L.free(kGrad, T * C * b + (first ? 0 : norm_grad));
    if (drop_grads) L.free(kGrad, norm_grad);  // the final norm's weight gradient, at its hook
    shed(norm_grad);
    L.free(kAct, T * C * b + T * 4);  // its input (the last layer's output), rstd
    // Offloaded inputs come back one region ahead: the top region's at the loss, region l - 1's as
    // region l starts.
    if (offload && P.L_ > 0) L.alloc(MemoryTag::Checkpoint, region_input + kept_out + kept_lse);
    for (int64_t l = P.L_ - 1; l >= 0; --l) {
      L.where = "backward: decoder.layer." + std::to_string(l);
      if (offload && l > 0) L.alloc(MemoryTag::Checkpoint, region_input + kept_out + kept_lse);
      if (regions) P.decoder_layer_forward_recorded(kAct, true);  // the re-run on the inner tape (Activation)
      P.layer_ = l;
      P.decoder_layer_backward(first, !regions);
      if (offload) {
        L.free(kAct, T * C * b);                    // the re-run's output
        L.free(MemoryTag::Checkpoint, region_input);  // the restored region input
      } else if (regions) {
        L.free(kAct, 2 * T * C * b);  // the re-run's output and the region input, at the closure's end
      }
      // step_in_backward: the layer's parameters are complete once its region has run (their hooks
      // wait for the region entry); each is updated and its gradient dropped.
      if (drop_grads) L.free(kGrad, P.layer_param_grads);
      shed(P.layer_param_grads);
    }
    // Layer 0's input gradient [T, C] is live.
    // The embedding's scatter-add goes into the weight's gradient in place once it holds one (the tied
    // lm_head's, or an earlier micro-batch's); only an untied first micro-batch allocates [V, C].
    const int64_t embed_grad =
        first && !tc.tie_word_embeddings && trains(tp + "model.embed_tokens.weight") ? V * C * b : 0;
    if (!vlm) {
      L.where = "backward: embed";
      L.alloc(kGrad, embed_grad);
      L.free(kGrad, T * C * b);
      if (drop_grads) L.free(kGrad, embed_grad);  // updated (or streamed out) at its hook
      shed(embed_grad + (tc.tie_word_embeddings ? V * C * b : 0));
    } else {
      // Layer 0's input gradient [T, C] is live. splice: db = clone(go) (+ zero rows), ds = gather.
      L.where = "backward: splice";
      L.alloc(kGrad, T * C * b + 2 * Ti * C * b);
      L.free(kGrad, Ti * C * b + T * C * b);  // the zero rows, go
      // The token embeddings' gradient (db) waits: the engine walks the image branch first.
      L.where = "backward: projector";
      // A frozen projector weight gets no gradient; a frozen tower takes no dx and has no backward.
      const std::string mp = "multi_modal_projector.";
      const int64_t l2_grad = (trains(mp + "linear_2.weight") ? C * Hp * b : 0) + (trains(mp + "linear_2.bias") ? C * b : 0);
      const int64_t l1_grad =
          (trains(mp + "linear_1.weight") ? Hp * E * sf * sf * b : 0) + (trains(mp + "linear_1.bias") ? Hp * b : 0);
      L.alloc(kGrad, Ti * Hp * b + l2_grad);  // linear_2: dx, dW, db
      if (!first) L.free(kGrad, l2_grad);     // added into the held gradients
      L.free(kAct, Ti * Hp * b);
      L.free(kGrad, Ti * C * b);
      L.alloc(kGrad, Ti * Hp * b);  // gelu
      L.free(kGrad, Ti * Hp * b);
      L.free(kAct, Ti * Hp * b);
      const int64_t l1_dx = vision_trains ? TE : 0;
      L.alloc(kGrad, l1_dx + l1_grad);  // linear_1: dx, dW, db
      if (!first) L.free(kGrad, l1_grad);
      L.free(kAct, TE);
      L.free(kGrad, Ti * Hp * b);
      if (vision_trains) {
        const std::string vp = "vision_tower.vision_model.";
        const int64_t post_grad = (trains(vp + "post_layernorm.weight") ? E * b : 0) + (trains(vp + "post_layernorm.bias") ? E * b : 0);
        L.alloc(kGrad, TE);  // contiguous copy of the permuted gradient; post layernorm: dx, dw, db
        if (post_ln) {
          L.alloc(kGrad, TE + post_grad);
          P.workspace(cuda_norm_backward_workspace_bytes(Tv, E, 2));
          L.free(kGrad, 2 * TE + (first ? 0 : post_grad));
          L.free(kAct, TE + 2 * Tv * 4);  // its input (the last block's output), mean, rstd
        } else {
          L.free(kGrad, TE);  // linear_1's dx: the copy is the last block's output gradient
        }
        for (int64_t l = P.LV_ - 1; l >= 0; --l) {
          L.where = "backward: vision.block." + std::to_string(l);
          if (regions) P.vision_block_forward_recorded(kAct);
          P.vision_layer_ = l;
          P.vision_block_backward(first, !regions);
          if (regions) L.free(kAct, 2 * TE);
        }
        L.where = "backward: vision embed";
        const std::string ve = vp + "embeddings.";
        const int64_t embed_grads = (trains(ve + "patch_embedding.weight") ? E * 3 * P2 * b : 0) +
                                    (trains(ve + "patch_embedding.bias") ? E * b : 0) +
                                    (trains(ve + "position_embedding.weight") ? Tv / s.B * E * b : 0);
        L.alloc(kGrad, embed_grads);  // patch GEMM dW, db; position gradient
        L.free(kGrad, TE + (first ? 0 : embed_grads));
        L.free(kAct, Tv * 3 * P2 * b + (s.B + 1) * 4);  // unfolded patches, cu_seqlens
      }
      L.where = "backward: embed";
      L.alloc(kGrad, embed_grad);
      L.free(kGrad, T * C * b);
    }

  };
  micro_batch(true);
  if (accum > 1) micro_batch(false);

  // Data parallelism: the buckets' flat copies of the gradients live from their launch to the end of
  // backward (GradientAllReduce::finish): one more copy of the kept gradients.
  if (W > 1 && !drop_grads) {
    L.where = "backward: gradient buckets";
    const int64_t flat = plan.parameters * s.b / grad_shard;  // frozen ones included: an upper bound
    L.alloc(kGrad, flat);
    L.free(kGrad, flat);
  }

  // ---- optimizer ----
  L.where = "optimizer";
  L.free(kGrad, L.cur[static_cast<int>(kGrad)]);  // zero_grad
  L.free(kAct, batches * batch_bytes - pixels);

  plan.tag_peak = L.peak;
  plan.peak = L.peak_in_use;
  plan.peak_where = L.peak_where;
  plan.tag_peak[static_cast<int>(MemoryTag::External)] = plan.external;
  if (plan.budget > 0) {
    plan.headroom = plan.budget - (plan.peak + plan.external);
    plan.fits = plan.headroom >= 0;
  }
  return plan;
}

int64_t choose_mlp_tile_tokens(const json& config, const PlanOptions& options) {
  const RunConfig run = RunConfig::resolve(config);
  if (!run.mlp_tile_auto) return run.mlp_tile_tokens;
  if (!run.has_budget()) return 0;
  if (run.fp8) return 0;  // the tiled MLP's GEMMs are bf16 only: the decoder refuses a tile with fp8
  json cfg = config;
  cfg["mlp_tile_tokens"] = 0;
  MemoryPlan untiled = plan_memory(cfg, options);
  if (untiled.budget <= 0 || untiled.headroom >= untiled.budget / 10) return 0;
  for (int64_t tile : {16384, 8192, 4096, 2048, 1024}) {
    if (tile >= untiled.tokens && tile > 1024) continue;  // one tile would hold the whole micro-batch
    cfg["mlp_tile_tokens"] = tile;
    if (plan_memory(cfg, options).fits) return tile;
  }
  return 1024;
}

}  // namespace kestrel::train
