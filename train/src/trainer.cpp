// The training loop. See trainer.h for what it does; the policies worth noting:
// - data order is a pure function of the micro-batch index (the data position, which advances by one
//   per micro-batch the model consumes and is what checkpoints store), so a resumed run sees exactly
//   the batches the uninterrupted run would have seen; the prefetcher only caches batches ahead;
// - checkpoints are written into a hidden temporary folder and renamed into place, carry a manifest
//   that resume verifies, and are refused when made with a config that changes the run's maths
//   (checkpoint_io.h); a fresh run does not start over another run's checkpoints;
// - a non-finite loss or gradient norm stops the run before the next checkpoint (train.nonfinite
//   "stop"), or ("skip") the step's update is not applied, at the cost of one host sync per step.
#include "kestrel/train/trainer.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <span>
#include <sstream>

#include "batch_prefetcher.h"
#include "checkpoint_io.h"
#include "data_parallel.h"
#include "zero.h"
#include "gradient_stream.h"
#include "param_groups.h"
#include "tasks.h"
#include "kestrel/autograd/recompute.h"
#include "kestrel/autograd/tape.h"
#include "kestrel/models/file_io.h"
#include "kestrel/ops/optim.h"
#include "kestrel/runtime/accumulate.h"
#include "kestrel/runtime/device_info.h"
#include "kestrel/runtime/log.h"
#include "kestrel/runtime/memory_budget.h"
#include "kestrel/runtime/memory_config.h"
#if KESTREL_WITH_CUDA
#include "kestrel/cuda/memory.h"
#endif
#include "kestrel/runtime/memory_trace.h"
#include "kestrel/runtime/op_profile.h"
#include "kestrel/runtime/parallel.h"
#include "kestrel/train/memory_plan.h"
#include "kestrel/train/memory_profile.h"
#include "kestrel/train/optimizer.h"
#include "kestrel/train/run_config.h"
#include "kestrel/train/schedule.h"
#include "kestrel/train/train_config.h"

namespace kestrel::train {

namespace fs = std::filesystem;
using nlohmann::json;

struct Trainer::Impl {
  json cfg;
  Device device;
  DType dtype;
  autograd::RecomputePolicy policy;
  std::string recompute_name;  // as the config names it (RunConfig::recompute_name)
  std::unique_ptr<Task> task;
  std::unique_ptr<AdamW> optim;
  LrSchedule schedule;
  std::unique_ptr<BatchPrefetcher> prefetcher;
  int64_t step = 0;             // completed steps
  uint64_t data_position = 0;   // index of the next micro-batch the model consumes
  std::vector<std::string> device_overrides;  // on_cpu / on_cuda entries left in the config
  int64_t batch_size, accum, total_steps;
  bool step_in_backward = false;  // optimizer.step_in_backward
  bool loss_gradient_forward = true;  // train.loss_gradient "forward" (run_config.h)
  std::unique_ptr<GradientStream> grad_stream;  // optimizer.gradients "host"
  bool overlap_update = false;                   // optimizer.update_overlap in effect
  std::shared_ptr<Communicator> comm;             // data parallelism (null: one rank)
  std::unique_ptr<GradientAllReduce> grad_reduce;  // with a communicator
  DataShard shard;
  int zero = 0;                 // distributed.zero with a communicator (zero.h)
  std::vector<int> owners;      // ZeRO: the owning rank of each parameter
  models::ParameterList owned;  // ZeRO: the parameters this rank's AdamW steps
  bool writer() const { return shard.rank == 0; }  // checkpoints, metrics, reports
  double grad_clip;
  std::string out_dir;
  // Checkpoint trust (checkpoint_io.h) and the non-finite policy.
  OptimizerStateForm checkpoint_form = OptimizerStateForm::Full;
  bool nonfinite_skip = false;
  bool last_step_skipped = false;  // "skip": the last step's update was not applied
  Fp8State* fp8 = nullptr;         // the decoder's FP8 scaling state when fp8.enabled (rolled per step)
  bool resumed = false, overwrite_out_dir = false;
  std::string last_checkpoint;     // written or resumed from by this process
  // The trace's event log: kept per step (cleared when a step starts) so an OutOfBudget report
  // has the failing step's timeline; a profiler that owns the log turns the clearing off.
  bool memory_profiling = false;
  MemorySnapshot log_start;
  // Progress lines go to the library's log callback when an embedding app installed one, else stdout.
  // Data parallelism: rank 0 logs; the other ranks only warnings, prefixed with their rank.
  std::function<void(const std::string&)> log = [this](const std::string& s) {
    const int rank = comm ? comm->rank() : 0;
    if (rank != 0 && s.rfind("warning", 0) != 0) return;
    const std::string line = rank != 0 ? "[rank " + std::to_string(rank) + "] " + s : s;
    if (log_callback_installed()) {
      log_message(LogLevel::Info, "train", line);
    } else {
      std::printf("%s\n", line.c_str());
      std::fflush(stdout);
    }
  };

  explicit Impl(const json& c, std::shared_ptr<Communicator> cm) : cfg(c), comm(std::move(cm)) {
    RunConfig run = RunConfig::resolve(cfg);
    if (run.recompute_auto) {
      // recompute "auto": the planner's choice for the budget (choose_recompute, memory_plan.h); the
      // config then names it, so the MLP tile below is planned with it.
      std::string chosen = "recompute";
      try {
        chosen = choose_recompute(cfg);
      } catch (const Error& e) {
        log(std::string("recompute auto: no plan for this run (") + e.what() + "); full recompute");
      }
      cfg["recompute"] = chosen;
      run = RunConfig::resolve(cfg);
      log("recompute auto: " + chosen + (run.has_budget() ? " (the fastest that fits " + run.memory_budget + ")" : ""));
    }
    recompute_name = run.recompute_name();
    device = run.device;
    dtype = run.dtype;
    policy = run.recompute;
    if (device.is_cuda())
      KESTREL_CHECK(cuda_available(), "train", "device ", device.str(), " requested but no CUDA device is available");
    // on_cpu / on_cuda are applied by whoever resolves the config (kestrel-train, before its --set);
    // here they are only reported, so a config means the same run to the trainer and the planner.
    for (const char* k : {"on_cpu", "on_cuda"})
      if (!cfg[k].empty()) device_overrides.push_back(std::string(k) + " " + cfg[k].dump());
    out_dir = cfg["out_dir"];
    // Budget, pinned limit, offload bound, allocator backend and TF32 go to the device in one push;
    // the caching allocator holds the budget from here (config -> RunConfig -> configure_memory ->
    // the CUDA context -> CachingAllocatorPolicy::set_budget).
    if (device.is_cuda())
      configure_memory(device, run.memory);
    else if (run.has_budget())
      log("memory_budget " + run.memory_budget + " applies to CUDA devices; ignored on the CPU");
#if KESTREL_WITH_CUDA
    if (device.is_cuda() && policy == autograd::RecomputePolicy::Offload) cuda::install_offloader(device.index);
#endif
    if (int t = cfg["threads"]; t > 0) set_num_cpu_threads(t);
    const json& tr = cfg["train"];
    batch_size = tr["batch_size"];
    accum = tr["grad_accum"];
    total_steps = tr["steps"];
    grad_clip = tr["grad_clip"];
    KESTREL_CHECK(batch_size > 0 && accum > 0 && total_steps > 0, "train",
                  "train.batch_size, train.grad_accum and train.steps must be positive");
    schedule = LrSchedule{tr["lr"], tr["min_lr"], tr["warmup_steps"], total_steps};
    checkpoint_form = parse_optimizer_state_form(cfg["checkpoint_optimizer_state"]);
    const std::string nonfinite = tr["nonfinite"];
    KESTREL_CHECK(nonfinite == "stop" || nonfinite == "skip", "train",
                  "train.nonfinite must be \"stop\" or \"skip\", got '", nonfinite, "'");
    nonfinite_skip = nonfinite == "skip";
    // profile_step past the run (or negative) would profile nothing without a word.
    const json& ps = cfg["profile_step"];
    KESTREL_CHECK(ps.is_number_integer() && ps.get<int64_t>() >= 0 && ps.get<int64_t>() <= total_steps, "train",
                  "profile_step must be 0 (off) or a step in [1, train.steps = ", total_steps, "], got ", ps.dump());

    task = make_task(cfg, dtype, device);
    // train.deterministic: the models' backward sums in a fixed order (no atomics) on the GPU.
    task->set_deterministic(run.deterministic);
    loss_gradient_forward = run.loss_gradient_forward;
    if (run.deterministic && device.is_cuda()) log("train.deterministic: fixed-order embedding and attention backward");
    if (models::Decoder* dec = task->decoder()) {
      dec->set_attention_backend(run.attention_backend);
      // Selective recompute: each layer's region also keeps attention's output and lse.
      dec->set_layer_recompute(run.recompute_selective ? models::LayerRecompute::Selective : models::LayerRecompute::Full);
      // The MLP's token tile: the configured one, or for "auto" the planner's choice for the budget.
      int64_t tile = run.mlp_tile_tokens;
      if (run.mlp_tile_auto && run.fp8) {
        // The tiled MLP's GEMMs are bf16 only, and the decoder refuses a tile with FP8.
        tile = 0;
        log("mlp_tile_tokens auto: the MLP runs untiled with fp8.enabled (the tiled MLP has no FP8 GEMMs)");
      } else if (run.mlp_tile_auto) {
        try {
          tile = choose_mlp_tile_tokens(cfg);
        } catch (const Error& e) {
          // The planner cannot model this run: keep the untiled MLP, and say so.
          tile = 0;
          log(std::string("mlp_tile_tokens auto: no plan for this run (") + e.what() +
              "); the MLP runs untiled (set mlp_tile_tokens to a token count to tile it)");
        }
      }
      dec->set_mlp_tile_tokens(tile);
      if (tile > 0)
        log("mlp_tile_tokens " + std::to_string(tile) + (run.mlp_tile_auto ? " (auto: the untiled MLP does not fit " +
                                                                                 run.memory_budget + ")" : ""));
      // fp8: the layers' projections through FP8 GEMMs; their scales roll after each optimizer step.
      if (run.fp8) {
        dec->enable_fp8(run.fp8_recipe);
        dec->set_fp8_fused_casts(run.fp8_fused_casts);
        fp8 = dec->fp8_state();
        log(std::string("fp8: decoder projections in FP8 (e4m3 x/w, ") + fp8_format_name(run.fp8_recipe.grad_format) +
            " gradients, amax history " + std::to_string(run.fp8_recipe.amax_history) + ")");
      }
    }
    KESTREL_CHECK(!run.fp8 || fp8 != nullptr, "train", "fp8.enabled needs a model with a decoder");
    if (std::string init = cfg["model"]["init_from"]; !init.empty()) models::load_safetensors(task->parameters(), init);
    // train.trainable / weight_decay_params / vision_lr_scale (param_groups.h): frozen parameters stop
    // requiring grad here, before anything registers hooks or optimizer state on them.
    const ParameterGroupRules groups = ParameterGroupRules::from_config(cfg);
    const int64_t trainable = apply_trainable(task->parameters(), groups);
    if (!groups.trains_everything())
      log("train.trainable: " + std::to_string(trainable) + " of " + std::to_string(num_params()) +
          " parameters train, the others are frozen");
    AdamWOptions ao;
    ao.lr = tr["lr"];
    ao.beta1 = tr["beta1"];
    ao.beta2 = tr["beta2"];
    ao.eps = tr["eps"];
    ao.weight_decay = tr["weight_decay"];
    // The optimizer's settings, checked against train.* (step_in_backward rules out accumulation,
    // clipping and "skip"): one parser shared with the planner.
    const OptimizerPlacement placement = optimizer_placement_from_config(cfg, device);
    // distributed.*: the communicator, this rank's data shard, and rank 0's parameters on every rank
    // before the optimizer copies them (its f32 master).
    if (!comm) comm = connect_data_parallel(cfg, device);
    shard = check_data_parallel(cfg, comm.get(), batch_size, placement.step_in_backward,
                                cfg["optimizer"]["gradients"] == "host");
    if (comm) broadcast_parameters(task->parameters(), *comm);
    if (comm) zero = static_cast<int>(cfg["distributed"]["zero"].get<int64_t>());
    if (zero > 0) {  // this rank's AdamW holds the state of the parameters it owns only
      owners = assign_parameter_owners(task->parameters(), comm->world_size());
      owned = owned_parameters(task->parameters(), owners, comm->rank());
    }
    optim = std::make_unique<AdamW>(zero > 0 ? owned : task->parameters(), ao, placement, [&](const std::string& name, const Tensor& p) {
      return groups.group(name, p.dim(), ao.weight_decay);
    });
    step_in_backward = placement.step_in_backward;
    // optimizer.gradients "host": each gradient leaves the device as backward completes it.
    const std::string grads_at = cfg["optimizer"]["gradients"];
    KESTREL_CHECK(grads_at == "device" || grads_at == "host", "train",
                  "optimizer.gradients must be \"device\" or \"host\", got '", grads_at, "'");
    if (grads_at == "host") {
      KESTREL_CHECK(placement.offload == OptimizerOffload::Host, "train",
                    "optimizer.gradients=\"host\" needs optimizer.offload=\"host\" (the update runs where the "
                    "gradients are); set both, or keep the gradients on the device");
      KESTREL_CHECK(accum == 1, "train", "optimizer.gradients=\"host\" streams each gradient out as backward "
                    "completes it, so a step takes one micro-batch: set train.grad_accum to 1 (got ", accum,
                    ") or keep the gradients on the device");
      KESTREL_CHECK(!step_in_backward, "train", "optimizer.gradients=\"host\" and optimizer.step_in_backward "
                    "exclude each other (the update either waits for every gradient on the host or runs inside "
                    "backward)");
      grad_stream = std::make_unique<GradientStream>(task->parameters());
      log("optimizer.gradients=host: " + format_bytes(grad_stream->host_bytes()) +
          " of pinned host memory receives each gradient as backward completes it");
    }
    setup_update_overlap(placement);
    // This rank trains on rows [rank, rank + 1) / world of each global micro-batch.
    if (comm) {  // world size > 1, or NCCL asked for by name (the same path at world size 1)
      grad_reduce = std::make_unique<GradientAllReduce>(
          task->parameters(), *comm, static_cast<int64_t>(cfg["distributed"]["bucket_mib"].get<double>() * (1 << 20)),
          zero == 2 ? owners : std::vector<int>{});
      log("data parallel: rank " + std::to_string(shard.rank) + " of " + std::to_string(shard.world) + " (" +
          comm->backend() + "), " + std::to_string(batch_size / shard.world) + " rows of each micro-batch of " +
          std::to_string(batch_size) + (zero > 0 ? ", ZeRO-" + std::to_string(zero) + ": AdamW state for " +
          std::to_string(owned.size()) + " of " + std::to_string(task->parameters().size()) + " parameters (" +
          std::to_string(owned.numel()) + " of " + std::to_string(task->parameters().numel()) + " elements)" : ""));
    }
    const int64_t depth = cfg["prefetch"];
    KESTREL_CHECK(depth >= 0 && depth <= 64, "train", "prefetch must lie in [0, 64], got ", depth);
    Task* t = task.get();
    const int64_t bs = batch_size;
    int threads = cfg["prefetch_threads"];
    KESTREL_CHECK(threads >= 0 && threads <= 64, "train", "prefetch_threads must lie in [0, 64], got ", threads);
    // Auto: one thread beside the CPU's compute threads; four feeding a GPU.
    if (threads == 0) threads = device.is_cuda() ? 4 : 1;
    prefetcher = std::make_unique<BatchPrefetcher>(
        [t, bs, sh = shard](uint64_t index) { return t->prepare(sh.index(index), bs / sh.world); }, device,
                                                   static_cast<int>(depth), threads);
  }

  int64_t num_params() const { return task->parameters().numel(); }
  // The last train_step's attention FLOPs (decoder tasks; TextConfig::attention_training_flops), for MFU.
  double step_attention_flops = 0;

  // A pending overlapped update reads the host gradient buffers (grad_stream) and writes the
  // parameters: it ends before any member goes. Its error, if any, is dropped with the run.
  ~Impl() {
    try {
      if (optim) optim->finish_step();
    } catch (...) {
    }
  }

  // optimizer.update_overlap: the host update of step s runs on a worker thread while step s + 1's
  // forward starts; the decoder's parameter fence waits for each layer's parameters before the layer
  // runs (AdamW::step_async / wait_parameter), so the result is the same as updating first. "auto"
  // turns it on where it applies; "on" where it does not is an error saying why.
  void setup_update_overlap(const OptimizerPlacement& placement) {
    const std::string mode = cfg["optimizer"]["update_overlap"];
    KESTREL_CHECK(mode == "auto" || mode == "on" || mode == "off", "train",
                  "optimizer.update_overlap must be \"auto\", \"on\" or \"off\", got '", mode, "'");
    if (mode == "off") return;
    models::Decoder* dec = task->decoder();
    std::string why_not;
    if (placement.offload != OptimizerOffload::Host || !grad_stream)
      why_not = "it overlaps the host update of optimizer.offload=\"host\" with optimizer.gradients=\"host\" "
                "(gradients kept on the device would stay allocated through the next forward)";
    else if (comm)
      why_not = "not implemented with data parallelism (distributed.*)";
    else if (!dec || dec->parameters().size() != task->parameters().size())
      why_not = "the " + task->name() + " task has parameters outside a decoder, whose forward does not wait for them";
    if (!why_not.empty()) {
      KESTREL_CHECK(mode != "on", "train", "optimizer.update_overlap=\"on\": ", why_not,
                    "; set it to \"auto\" or \"off\"");
      return;
    }
    overlap_update = true;
    AdamW* o = optim.get();
    dec->set_parameter_fence([o](const std::vector<const Tensor*>& params) {
      for (const Tensor* p : params) o->wait_parameter(p);
    });
    log("optimizer.update_overlap: the host update of each step runs while the next forward starts (each layer "
        "waits for its own parameters)");
  }

  // The pending overlapped update, finished: before anything else reads the parameters or the state
  // (backward, evaluation, checkpoints, the end of the run). After a forward (`after_forward`), every
  // parameter the update changed must have been waited for by the model's fence.
  void finish_update(bool after_forward = false) {
    if (!optim || !optim->step_pending()) return;
    const std::vector<std::string> missed = after_forward ? optim->unwaited_parameters() : std::vector<std::string>{};
    optim->finish_step();
    KESTREL_CHECK(missed.empty(), "train", "optimizer.update_overlap: ", missed.size(), " parameters (the first '",
                  missed.empty() ? "" : missed[0], "') were updated while the forward could read them without "
                  "waiting; this is a bug in the model's parameter fence: set optimizer.update_overlap=\"off\"");
  }

  // One optimizer step; returns {sum of the micro-batch losses, grad norm} as f32 scalars on the
  // device and the token count. Nothing inside the step waits for the device: the caller reads the
  // scalars after the step's synchronisation.
  std::tuple<Tensor, Tensor, int64_t> train_step() {
    Device dev = device;
    Tensor loss_sum;
    int64_t tokens = 0;
    step_attention_flops = 0;
    if (!memory_profiling) {
      memory_trace(dev).clear_events();
      log_start = memory_trace(dev).snapshot();
    }
    for (int64_t m = 0; m < accum; ++m) {
      Tensor loss;
      // The backward's seed. With train.loss_gradient "forward" the loss head is told it up front and
      // computes its gradients in the forward (CrossEntropyOptions::known_grad: one pass, no recompute).
      Tensor seed;
      {
        TagScope tag(MemoryTag::Gradient);
        seed = Tensor::full({}, 1.0 / static_cast<double>(accum), DType::F32, dev);
      }
      {
        PhaseScope ph(dev, "forward");
        BatchPrefetcher::Batch b;
        {
          TagScope tag(MemoryTag::Activation);
          MemoryLabelScope label("data");
          b = prefetcher->get(data_position);
        }
        TagScope tag(MemoryTag::Activation);
        loss = task->loss(*b.host, b.arrays, policy, loss_gradient_forward ? seed : Tensor());
        tokens += b.host->tokens;
        if (const models::Decoder* d = task->decoder())
          step_attention_flops += d->config().attention_training_flops(b.host->document_lengths);
      }
      // optimizer.update_overlap: the previous step's update ran alongside this forward; the
      // backward refills the host gradient buffers it read.
      finish_update(/*after_forward=*/true);
      ++data_position;
      {
        PhaseScope ph(dev, "backward");
        TagScope tag(MemoryTag::Gradient);
        MemoryLabelScope label("backward");
        KESTREL_CHECK(loss.shape() == seed.shape() && loss.dtype() == seed.dtype(), "train", "the task's loss ",
                      loss.str(), " is not an f32 scalar");
        // optimizer.step_in_backward: the parameters are updated (and their gradients dropped) by
        // grad-ready hooks inside this backward (accum is 1 then).
        if (step_in_backward) optim->begin_step(schedule.at(step + 1));
        if (grad_reduce && m == accum - 1) grad_reduce->arm();  // the last micro-batch averages the gradients
        autograd::backward({loss}, {seed});
        if (step_in_backward) optim->end_step();
      }
      if (loss_sum.defined())
        add_into(loss_sum, loss.detach());
      else
        loss_sum = loss.detach().to(DType::F32).clone();
    }
    if (grad_reduce) {
      grad_reduce->finish();
      comm->all_reduce(loss_sum, ReduceOp::Avg);  // the logged loss is the global batch's
      comm->wait();
    }
    Tensor gnorm, clip_factor;
    {
      PhaseScope ph(dev, "optimizer");
      TagScope tag(MemoryTag::OptimizerState);
      MemoryLabelScope label("optimizer");
      if (step_in_backward) {
        // Already applied; the norm of the gradients it used, for the log (no clipping).
        gnorm = optim->grad_norm();
        if (!gnorm.defined()) gnorm = Tensor::zeros({}, DType::F32, dev);
        if (fp8) fp8->roll();
        ++step;
        return {loss_sum, gnorm, tokens};
      }
      if (grad_stream) {
        // The gradients are (or are landing) on the host: norm and clip there, then hand the host
        // copies to the offloaded update as the parameters' gradients.
        gnorm = Tensor::full({}, grad_stream->finish(grad_clip), DType::F32, Device::cpu());
        size_t i = 0;
        for (auto& [name, p] : task->parameters().items()) {
          const Tensor& h = grad_stream->gradients()[i++];
          if (h.defined()) p->set_grad(h);
        }
      } else if (zero == 2) {
        // Each rank holds its own parameters' gradients: the norm from the ranks' partials.
        std::vector<Tensor> grads;
        for (auto& [name, p] : owned.items())
          if (p->grad().defined()) grads.push_back(p->grad());
        gnorm = clip_sharded_grad_norm(grads, grad_clip, *comm, dev);
      } else {
        std::vector<Tensor> grads;
        for (auto& [name, p] : task->parameters().items())
          if (p->grad().defined()) grads.push_back(p->grad());
        if (grad_clip > 0 && !overlap_update && optim->applies_grad_scale()) {
          // The update applies the clip factor as it reads each gradient: the same bits as scaling
          // the gradients in place first, without that pass over them.
          GradClip c = grad_clip_factor_device(grads, grad_clip);
          gnorm = c.norm;
          clip_factor = c.factor;
        } else {
          gnorm = clip_grad_norm_device(grads, grad_clip);
        }
      }
      // train.nonfinite "skip": read loss and norm now (a host sync) so a bad step changes nothing.
      last_step_skipped = nonfinite_skip && !(std::isfinite(loss_sum.item()) && std::isfinite(gnorm.item()));
      if (!last_step_skipped) {
        if (overlap_update)
          optim->step_async(schedule.at(step + 1));
        else
          optim->step(schedule.at(step + 1), clip_factor);
      }
      // ZeRO: each parameter from the rank that updated it (every rank agrees on a skip: the loss
      // and the norm are global).
      if (zero > 0 && !last_step_skipped) gather_parameters(task->parameters(), owners, *comm);
      task->parameters().zero_grad();
      if (grad_stream) grad_stream->clear();
    }
    if (grad_reduce) comm->synchronize();  // a dead peer: an error within the timeout, not a hang
    // FP8: this step's amax joins the histories and the scales follow (device kernels, no sync); a
    // skipped step's amax is dropped, as its update is (every rank agrees on a skip). With data
    // parallelism the amax is first the max over the ranks (one all-reduce of 3L floats, as
    // Transformer Engine does), so every rank rolls the same values and holds the same state: rank
    // 0's checkpoint of it is every rank's.
    if (fp8) {
      if (last_step_skipped) {
        fp8->discard();
      } else {
        if (comm) {
          Tensor amax = fp8->amax();
          comm->all_reduce(amax, ReduceOp::Max);
          comm->wait();
        }
        fp8->roll();
      }
    }
    ++step;
    return {loss_sum, gnorm, tokens};
  }

  std::string memory_line() const {
    MemorySnapshot s = memory_trace(device).snapshot();
    std::vector<std::pair<int64_t, std::string>> tags;
    for (int t = 0; t < kNumMemoryTags; ++t)
      if (s.tags[t].peak > 0) tags.emplace_back(s.tags[t].peak, std::string(tag_name(static_cast<MemoryTag>(t))));
    std::sort(tags.rbegin(), tags.rend());
    std::string line = "peak " + format_bytes(device.is_cuda() ? s.peak_footprint : s.peak_in_use) + " (";
    for (size_t i = 0; i < tags.size() && i < 3; ++i) line += (i ? ", " : "") + tags[i].second + " " + format_bytes(tags[i].first);
    line += ")";
    if (optim->placement().offload == OptimizerOffload::Host) {
      HostMemory h = host_memory();
      line += " | host: state " + format_bytes(optim->host_state_bytes()) + ", pinned " + format_bytes(h.pinned) +
              ", RSS " + format_bytes(h.rss) + " (peak " + format_bytes(h.rss_peak) + ")";
    }
    return line;
  }

  // Host side of the footprint: resident set (now and peak, from /proc/self/status) and pinned bytes.
  struct HostMemory {
    int64_t rss = 0, rss_peak = 0, pinned = 0, pinned_peak = 0;
  };
  HostMemory host_memory() const {
    HostMemory h;
    std::ifstream f("/proc/self/status");
    std::string key;
    while (f >> key) {
      int64_t kib = 0;
      if (key == "VmRSS:" && f >> kib) h.rss = kib * 1024;
      else if (key == "VmHWM:" && f >> kib) h.rss_peak = kib * 1024;
      std::string rest;
      std::getline(f, rest);
    }
#if KESTREL_WITH_CUDA
    if (device.is_cuda()) {
      cuda::PinnedStats p = cuda::pinned_stats();
      h.pinned = p.held;
      h.pinned_peak = p.peak_held;
    }
#endif
    return h;
  }

  // The run's fields of memory_report.json (written at the end, and by run_with_memory_report with
  // the failing step's profile after an OutOfBudget).
  nlohmann::json report_fields() const {
    return {{"parameters", num_params()}, {"optimizer_state_bytes", optim->state_bytes()},
            {"optimizer_offload", optimizer_offload_name(optim->placement().offload)}, {"host", host_json()}};
  }

  nlohmann::json host_json() const {
    HostMemory h = host_memory();
    return json{{"optimizer_state_bytes", optim->host_state_bytes()}, {"rss_bytes", h.rss}, {"rss_peak_bytes", h.rss_peak},
                {"pinned_bytes", h.pinned}, {"pinned_peak_bytes", h.pinned_peak}};
  }

  // profile_step's table in the log (ops by device time, the rest of the step's wall time last) and
  // out_dir/op_profile.json.
  void report_op_profile(const OpProfile& p, double wall_ms) {
    const double in_ops = p.total_ms();
    log("op profile of step " + std::to_string(step) + ": " + std::to_string(static_cast<int64_t>(wall_ms)) +
        " ms wall, " + std::to_string(static_cast<int64_t>(in_ops)) + " ms in ops' kernels on the device");
    json rows = json::array();
    char line[256];
    for (const OpTime& t : p.ops()) {
      std::snprintf(line, sizeof line, "  %-40s %6lld calls %10.2f ms %6.1f%%", t.op.c_str(),
                    static_cast<long long>(t.calls), t.ms, wall_ms > 0 ? 100.0 * t.ms / wall_ms : 0.0);
      log(line);
      rows.push_back({{"op", t.op}, {"calls", t.calls}, {"ms", t.ms}});
    }
    std::snprintf(line, sizeof line, "  %-40s %6s       %10.2f ms %6.1f%%", "(outside ops: gaps, waits, copies)", "",
                  wall_ms - in_ops, wall_ms > 0 ? 100.0 * (wall_ms - in_ops) / wall_ms : 0.0);
    log(line);
    if (!writer()) return;
    std::filesystem::create_directories(out_dir);
    std::ofstream f(out_dir + "/op_profile.json");
    f << json{{"step", step}, {"wall_ms", wall_ms}, {"ops_ms", in_ops}, {"device", device.str()}, {"ops", rows}}.dump(1)
      << "\n";
    KESTREL_CHECK(f.good(), "train", "could not write ", out_dir, "/op_profile.json");
  }

  EvalResult evaluate() {
    finish_update();
    Fp8ObserveOff off(fp8);  // evaluation's amax stays out of training's FP8 scales
    EvalResult e = task->evaluate();
    if (e.tokens > 0) {  // held-out tokens (decoders): logged here, a line of out_dir/eval.jsonl (record_eval)
      char buf[256];
      std::snprintf(buf, sizeof buf, "eval @ %lld: held-out loss %.4f (perplexity %.3f) over %lld tokens",
                    static_cast<long long>(step), e.loss, std::exp(e.loss), static_cast<long long>(e.tokens));
      log(buf);
    }
    return e;
  }
  void record_eval(const EvalResult& e) const;  // below MetricsFile
};

Trainer::Trainer(const json& config) : impl_(std::make_unique<Impl>(config, nullptr)) {}
Trainer::Trainer(const json& config, std::shared_ptr<Communicator> comm)
    : impl_(std::make_unique<Impl>(config, std::move(comm))) {}
Trainer::~Trainer() = default;
void Trainer::set_log_callback(std::function<void(const std::string&)> cb) { impl_->log = std::move(cb); }
void Trainer::set_memory_profiling(bool on) { impl_->memory_profiling = on; }
Device Trainer::device() const { return impl_->device; }
void Trainer::set_overwrite_out_dir(bool on) { impl_->overwrite_out_dir = on; }

namespace {
// metrics.jsonl is only ever a regular file (or absent): a FIFO there blocked open() forever (for
// reading until a writer came, for writing until a reader did), and a folder made every row vanish
// silently. Both are errors naming the path; the opens themselves never block (O_NONBLOCK, then fstat).
void require_regular_metrics(const std::string& path) {
  std::error_code ec;
  if (fs::exists(path, ec)) models::require_regular_file(path, "train");
}

// Appends one JSON line per step, flushed (written through) per line.
class MetricsFile {
 public:
  MetricsFile(const std::string& path, bool append) : path_(path) {
    require_regular_metrics(path);
    fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC | O_NOCTTY | O_NONBLOCK | (append ? O_APPEND : O_TRUNC),
                 0644);
    KESTREL_CHECK(fd_ >= 0, "train", "cannot open the metrics file '", path, "': ", std::strerror(errno));
    struct stat st {};
    if (::fstat(fd_, &st) != 0 || !S_ISREG(st.st_mode)) {
      ::close(fd_);
      throw make_error("train", "'", path, "' is not a regular file; the metrics are written only to one");
    }
  }
  ~MetricsFile() { ::close(fd_); }
  MetricsFile(const MetricsFile&) = delete;
  MetricsFile& operator=(const MetricsFile&) = delete;

  void write_line(const std::string& text) {
    std::string line = text + "\n";
    for (size_t done = 0; done < line.size();) {
      ssize_t n = ::write(fd_, line.data() + done, line.size() - done);
      if (n < 0 && errno == EINTR) continue;
      KESTREL_CHECK(n > 0, "train", "cannot write the metrics file '", path_, "': ", std::strerror(errno));
      done += static_cast<size_t>(n);
    }
  }

 private:
  std::string path_;
  int fd_ = -1;
};

// A held-out evaluation's line of out_dir/eval.jsonl ({"step", "eval_loss", "eval_tokens"}; decoders).
// Keeps the metrics lines of steps up to `step` (what the checkpoint saw); drops the lines of steps
// a killed run took after it (the resumed run writes them again) and a torn last line.
void trim_metrics(const std::string& path, int64_t step) {
  std::error_code ec;
  if (!fs::exists(path, ec)) return;
  auto file = models::MappedFile::open(path, "train");  // regular files only, never a blocking open
  std::string_view text(reinterpret_cast<const char*>(file->data()), file->size());
  std::string kept;
  while (!text.empty()) {
    const size_t end = text.find('\n');
    const std::string_view line = text.substr(0, end);
    text = end == std::string_view::npos ? std::string_view() : text.substr(end + 1);
    json row = json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (row.is_discarded() || !row.is_object()) continue;
    if (!row.contains("step") || !row["step"].is_number() || row["step"].get<int64_t>() <= step)
      kept.append(line).push_back('\n');
  }
  models::write_file_atomic(path, std::as_bytes(std::span(kept.data(), kept.size())), "train");
}
}  // namespace

// A held-out evaluation's line of out_dir/eval.jsonl ({"step", "eval_loss", "eval_tokens"}; decoders).
void Trainer::Impl::record_eval(const EvalResult& e) const {
  if (e.tokens <= 0 || !writer()) return;
  fs::create_directories(out_dir);
  MetricsFile(out_dir + "/eval.jsonl", /*append=*/true)
      .write_line(json{{"step", step}, {"eval_loss", e.loss}, {"eval_tokens", e.tokens}}.dump());
}

EvalResult Trainer::evaluate() {
  EvalResult e = impl_->evaluate();
  impl_->record_eval(e);
  return e;
}

void Trainer::resume(const std::string& checkpoint, const ResumeOptions& options) {
  if (checkpoint.empty()) return;
  Impl& I = *impl_;
  // Data parallelism: rank 0 alone changes out_dir, the others read it between barriers.
  if (I.writer()) for (const std::string& s : clean_checkpoint_leftovers(I.out_dir)) I.log("checkpoints: " + s);
  if (I.grad_reduce) I.comm->barrier();
  std::string dir = checkpoint;
  std::vector<SkippedCheckpoint> skipped;
  if (checkpoint == "latest") {
    dir = latest_checkpoint(I.out_dir, &skipped);
    std::string why;
    for (const SkippedCheckpoint& s : skipped) {
      I.log("checkpoint " + s.dir + " skipped: " + s.problem + (dir.empty() ? "" : "; falling back to " + dir));
      why += "\n  " + s.dir + ": " + s.problem;
    }
    KESTREL_CHECK(!dir.empty(), "train", "--resume latest: no intact checkpoint under ", I.out_dir, "/checkpoints",
                  why);
  } else {
    const std::string problem = verify_checkpoint(dir);
    KESTREL_CHECK(problem.empty(), "train", "cannot resume from ", dir, ": ", problem);
  }
  CheckpointState st = read_checkpoint_state(dir);
  std::vector<std::string> diffs = run_config_differences(st.config, I.cfg);
  if (!diffs.empty()) {
    std::string list;
    for (const std::string& d : diffs) list += "\n  " + d;
    KESTREL_CHECK(options.allow_config_change, "train", "cannot resume from ", dir,
                  ": it was made with a different config (settings that change the run's maths or data):", list,
                  "\nResume anyway with --allow-config-change, or start a new run in another out_dir");
    I.log("resuming from " + dir + " with a changed config (--allow-config-change):" + list);
  }
  load_checkpoint(dir, st, I.task->parameters(), *I.optim);
  // FP8: the scaling state (amax histories, scales, roll count) as it was at the checkpoint's step;
  // one that does not fit this model's linears is refused by load_fp8_state.
  if (I.fp8 && !load_fp8_state(dir, *I.fp8))
    I.log("warning: the checkpoint has no FP8 scaling state (written without fp8.enabled, or by an older "
          "version): the FP8 scales restart from the next step's amax; this resume is not bit-exact with the "
          "uninterrupted run");
  I.step = st.step;
  I.data_position = static_cast<uint64_t>(st.data_position);
  I.resumed = true;
  I.last_checkpoint = dir;
  if (I.grad_reduce) I.comm->barrier();  // every rank has read the checkpoint
  if (!I.writer()) skipped.clear();
  if (I.writer()) trim_metrics(I.out_dir + "/metrics.jsonl", st.step);
  if (I.writer()) trim_metrics(I.out_dir + "/eval.jsonl", st.step);
  // Damaged checkpoints newer than the one resumed from are set aside (kept for inspection): the
  // run writes those steps again, and pruning and `latest` must not count them.
  for (const SkippedCheckpoint& s : skipped) {
    fs::rename(s.dir, s.dir + ".damaged");
    I.log("checkpoint " + s.dir + " set aside as " + s.dir + ".damaged");
  }
  I.log("resumed from " + dir + " at step " + std::to_string(st.step) + ", data position " +
        std::to_string(I.data_position));
  if (st.optimizer_state == OptimizerStateForm::Bf16)
    I.log("the checkpoint holds the optimizer state in bf16 (checkpoint_optimizer_state \"bf16\"): this resume is "
          "not bit-exact with the uninterrupted run");
  if (st.optimizer_state == OptimizerStateForm::None)
    I.log("warning: the checkpoint has no optimizer state (checkpoint_optimizer_state \"none\"): AdamW restarts "
          "from zero moments and step 0 at the current learning rate");
}

TrainSummary Trainer::run() {
  Impl& I = *impl_;
  fs::create_directories(I.out_dir);
  // Data parallelism: rank 0 alone owns out_dir (checkpoints, metrics, the memory report).
  if (I.writer()) for (const std::string& s : clean_checkpoint_leftovers(I.out_dir)) I.log("checkpoints: " + s);
  if (!I.resumed && I.writer()) {
    // A fresh run: checkpoints already here belong to another run, which this one would prune and
    // a later --resume latest would mix up with its own.
    std::vector<std::string> theirs = checkpoint_folders(I.out_dir);
    if (!theirs.empty() && I.overwrite_out_dir) {
      discard_checkpoints(I.out_dir);
      I.log("--overwrite-out-dir: deleted " + std::to_string(theirs.size()) + " checkpoint(s) of an earlier run in " +
            I.out_dir);
    }
    KESTREL_CHECK(theirs.empty() || I.overwrite_out_dir, "train", "out_dir ", I.out_dir, " already holds ",
                  theirs.size(), " checkpoint(s) (newest ", theirs.back(), "). Continue that run with --resume latest, ",
                  "delete them with --overwrite-out-dir, or choose another out_dir");
  }
  std::optional<MetricsFile> metrics;
  if (I.writer()) metrics.emplace(I.out_dir + "/metrics.jsonl", /*append=*/I.step > 0);
  if (I.writer() && I.step == 0 && fs::exists(I.out_dir + "/eval.jsonl"))  // a new run: the evals start over
    MetricsFile(I.out_dir + "/eval.jsonl", /*append=*/false);
  const int64_t log_every = std::max<int64_t>(1, I.cfg["log_every"].get<int64_t>());
  const int64_t eval_every = I.cfg["eval_every"], ckpt_every = I.cfg["checkpoint_every"];
  const int64_t keep = I.cfg["keep_checkpoints"];
  char buf[512];
  std::snprintf(buf, sizeof buf, "kestrel-train: %s with %.2fM parameters on %s (%s), batch %lld x %lld, %lld steps, recompute %s",
                I.task->name().c_str(), I.num_params() / 1e6, I.device.str().c_str(), std::string(dtype_name(I.dtype)).c_str(),
                static_cast<long long>(I.batch_size), static_cast<long long>(I.accum),
                static_cast<long long>(I.total_steps), I.recompute_name.c_str());
  if (I.optim->placement().offload == OptimizerOffload::Host)
    std::snprintf(buf + std::strlen(buf), sizeof buf - std::strlen(buf), ", AdamW state on the host (%s)",
                  format_bytes(I.optim->host_state_bytes()).c_str());
  {
    const OptimizerPlacement& pl = I.optim->placement();
    if (pl.master_weights == MasterWeights::None || pl.state_dtype != DType::F32 || pl.step_in_backward)
      std::snprintf(buf + std::strlen(buf), sizeof buf - std::strlen(buf),
                    ", AdamW master_weights %s, moments %s%s", master_weights_name(pl.master_weights),
                    optimizer_state_dtype_name(pl.state_dtype), pl.step_in_backward ? ", step in backward" : "");
  }
  I.log(buf);
  for (const std::string& o : I.device_overrides)
    I.log("not applied (apply_device_overrides does that; kestrel-train calls it): " + o);
  const int64_t sample_every = I.cfg["sample_every"], sample_count = I.cfg["sample_count"];
  const int64_t profile_step = I.cfg["profile_step"];
  TrainSummary sum;
  auto t_run = std::chrono::steady_clock::now();
  memory_trace(I.device).reset_peaks();
  if (!I.memory_profiling) memory_trace(I.device).set_event_logging(true, 1u << 21);
  // MFU: (6 x parameters x tokens + the attention products' FLOPs of a decoder task, recompute not
  // counted) / step time / the device's dense bf16 peak (device_info.h; 0 on the CPU and on
  // architectures without a table entry, which report MFU as n/a). The FP8 mode is measured against
  // the same bf16 peak.
  const double peak_flops = device_info(I.device).peak_bf16_flops;
  while (I.step < I.total_steps) {
    auto t0 = std::chrono::steady_clock::now();
    Tensor loss_t, gnorm_t;
    int64_t tokens;
    // profile_step: this step's device time per op (op_profile.h), from the step's start to its end on
    // the device.
    std::unique_ptr<OpProfile> op_profile;
    if (profile_step == I.step + 1) {
      synchronize(I.device);
      t0 = std::chrono::steady_clock::now();
      op_profile = std::make_unique<OpProfile>();
      op_profile->start();
    }
    try {
      // After an OutOfBudget the report goes next to the run; earlier checkpoints stay as they are.
      run_with_memory_report([&] { std::tie(loss_t, gnorm_t, tokens) = I.train_step(); }, I.out_dir, I.device,
                             I.log_start, [&] { return I.report_fields(); },
                             {{"source", "kestrel-train OutOfBudget"}, {"step", I.step + 1}});
    } catch (const OutOfBudget& e) {
      I.log("out of the memory budget at step " + std::to_string(I.step + 1) + "; memory report: " + I.out_dir +
            "/memory_report.json, profile: " + I.out_dir + "/memory.html");
      if (!I.memory_profiling) memory_trace(I.device).set_event_logging(false);
      if (I.grad_reduce) I.comm->abort(e.what());
      throw;
    } catch (const std::exception& e) {
      if (I.grad_reduce) I.comm->abort(e.what());  // the other ranks fail with this message, not a timeout
      throw;
    }
    synchronize(I.device);
    double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    if (op_profile) {
      op_profile->stop();
      I.report_op_profile(*op_profile, ms);
    }
    const double loss = loss_t.item() / static_cast<double>(I.accum), gnorm = gnorm_t.item();
    const bool finite = std::isfinite(loss) && std::isfinite(gnorm);
    if (sum.steps == 0) sum.first_loss = loss;
    sum.last_loss = loss;
    sum.steps++;
    double tps = tokens / (ms / 1e3);
    const double model_flops = 6.0 * static_cast<double>(I.num_params()) * static_cast<double>(tokens) +
                               I.step_attention_flops;
    double mfu = peak_flops > 0 ? model_flops / (ms / 1e3) / peak_flops : 0.0;
    double lr = I.schedule.at(I.step);
    const MemorySnapshot snap = memory_trace(I.device).snapshot();
    json row{{"step", I.step},          {"loss", loss},       {"grad_norm", gnorm},
             {"lr", lr},                {"ms", ms},           {"tokens_per_s", tps},
             {"mfu", mfu},              {"peak_bytes", snap.peak_in_use},
             {"peak_footprint_bytes", snap.peak_footprint}};
    const bool offloaded = I.optim->placement().offload == OptimizerOffload::Host;
    if (offloaded) {
      const OptimizerStepStats& os = I.optim->last_step_stats();
      row["optimizer_ms"] = os.host_ms;
      row["optimizer_update_ms"] = os.update_ms;
      row["optimizer_copy_wait_ms"] = os.copy_wait_ms;
      row["gpu_idle_ms"] = I.optim->last_step_gpu_idle_ms();
      if (I.overlap_update) row["forward_wait_ms"] = os.fence_wait_ms;
      row["host"] = I.host_json();
    }
    if (metrics) metrics->write_line(row.dump());
    if (I.step % log_every == 0 || I.step == 1 || I.step == I.total_steps) {
      // Progress: time left at the average pace of this run so far.
      double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_run).count();
      double eta = elapsed / static_cast<double>(sum.steps) * static_cast<double>(I.total_steps - I.step);
      std::snprintf(buf, sizeof buf,
                    "step %5lld/%lld | loss %.4f | gnorm %.3f | lr %.2e | %7.1f ms | %8.0f tok/s | MFU %s | eta %dm%02ds | %s",
                    static_cast<long long>(I.step), static_cast<long long>(I.total_steps), loss, gnorm, lr, ms, tps,
                    peak_flops > 0 ? (std::to_string(mfu * 100).substr(0, 4) + "%").c_str() : "n/a",
                    static_cast<int>(eta) / 60, static_cast<int>(eta) % 60, I.memory_line().c_str());
      std::string line = buf;
      if (offloaded) {
        const OptimizerStepStats& os = I.optim->last_step_stats();
        if (I.overlap_update)  // the last finished update: the previous step's, overlapped with this forward
          std::snprintf(buf, sizeof buf, " | optimizer on host %.0f ms (update %.0f), overlapped; the forward waited "
                        "%.0f ms for it", os.host_ms, os.update_ms, os.fence_wait_ms);
        else
          std::snprintf(buf, sizeof buf, " | optimizer on host %.0f ms (update %.0f, copy wait %.0f), GPU idle %.0f ms",
                        os.host_ms, os.update_ms, os.copy_wait_ms, I.optim->last_step_gpu_idle_ms());
        line += buf;
      }
      I.log(line);
    }
    if (!finite && I.nonfinite_skip) {
      I.log("step " + std::to_string(I.step) + ": non-finite loss " + std::to_string(loss) + " / grad norm " +
            std::to_string(gnorm) + "; its update was skipped (train.nonfinite \"skip\")");
    } else if (!finite) {
      // The update is already applied: no checkpoint is written from here, so the last one stays good.
      throw make_error("train", "non-finite ", std::isfinite(loss) ? "grad norm " : "loss ",
                       std::isfinite(loss) ? gnorm : loss, " at step ", I.step, " (micro-batches at data position",
                       I.accum > 1 ? "s " + std::to_string(I.data_position - static_cast<uint64_t>(I.accum)) + ".."
                                   : std::string(" "),
                       I.data_position - 1, "); stopped (train.nonfinite \"stop\"). ",
                       I.last_checkpoint.empty() ? std::string("No checkpoint was written by this run")
                                                 : "The last good checkpoint is " + I.last_checkpoint,
                       ". Lower train.lr or raise train.warmup_steps, check the data, or set train.nonfinite=skip "
                       "to skip such steps");
    }
    if (eval_every > 0 && I.step % eval_every == 0 && I.step < I.total_steps) {
      EvalResult e = I.evaluate();
      I.record_eval(e);
      if (e.samples > 0) std::snprintf(buf, sizeof buf, "eval @ %lld: caption accuracy %.1f%% (colour %.1f%%, shape %.1f%%, position %.1f%%)",
                    static_cast<long long>(I.step), 100 * e.caption_accuracy, 100 * e.colour_accuracy,
                    100 * e.shape_accuracy, 100 * e.position_accuracy);
      if (e.samples > 0) I.log(buf);
    }
    if (sample_every > 0 && I.step % sample_every == 0 && I.step < I.total_steps) {
      I.finish_update();
      Fp8ObserveOff off(I.fp8);  // sampling's amax stays out of training's FP8 scales
      for (auto& [want, got] : I.task->samples(sample_count)) {
        I.log("sample @ " + std::to_string(I.step) + ": " + (got == want ? "[ok]  " : "[bad] ") + "expected \"" + want +
              "\" | generated \"" + got + "\"");
      }
    }
    if (ckpt_every > 0 && (I.step % ckpt_every == 0 || I.step == I.total_steps)) {
      I.finish_update();
      if (I.zero > 0) {  // every rank writes its optimizer shard (a failing rank aborts the group)
        std::string dir = save_checkpoint(I.out_dir, I.step, I.data_position, I.task->parameters(), *I.optim, I.cfg,
                                          keep, I.checkpoint_form, I.comm.get(), I.fp8);
        I.last_checkpoint = dir;
        I.log("checkpoint " + dir);
      } else if (I.writer()) {
        std::string dir = save_checkpoint(I.out_dir, I.step, I.data_position, I.task->parameters(), *I.optim, I.cfg,
                                          keep, I.checkpoint_form, nullptr, I.fp8);
        I.last_checkpoint = dir;
        I.log("checkpoint " + dir);
      }
      if (I.grad_reduce) I.comm->barrier();  // no rank runs ahead of a checkpoint being written
    }
  }
  I.finish_update();
  synchronize(I.device);
  sum.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_run).count();
  {
    BatchPrefetcher::Stats ps = I.prefetcher->stats();
    std::snprintf(buf, sizeof buf, "data: %lld batches prepared ahead (prefetch %lld); the step waited for data %lld times, %.1f ms in all",
                  static_cast<long long>(ps.prepared), static_cast<long long>(I.cfg["prefetch"].get<int64_t>()),
                  static_cast<long long>(ps.waited), ps.wait_ms);
    if (ps.prepared > 0) I.log(buf);
  }
  if (!I.memory_profiling) {
    memory_trace(I.device).set_event_logging(false);
    memory_trace(I.device).clear_events();
  }
  if (I.writer()) sum.memory_report_path = write_memory_report(I.out_dir, I.device, "", I.log_start, I.report_fields());
  return sum;
}

}  // namespace kestrel::train
