#include "kestrel/train/optimizer.h"

#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <fstream>
#include <sstream>

#include "host_adamw.h"
#include "host_staging.h"
#include "kestrel/autograd/grad_mode.h"
#include "kestrel/autograd/tape.h"
#include "kestrel/ops/adamw_q8.h"
#include "kestrel/ops/elementwise.h"
#include "kestrel/runtime/accumulate.h"
#include "kestrel/runtime/error.h"
#include "kestrel/runtime/memory.h"
#include "kestrel/runtime/memory_budget.h"
#include "kestrel/runtime/parallel.h"

namespace kestrel::train {
namespace {

constexpr int64_t kUpdateGrain = int64_t{1} << 16;  // elements per CPU task of the host update

// MemAvailable from /proc/meminfo in bytes; -1 where it cannot be read.
int64_t host_memory_available() {
  std::ifstream f("/proc/meminfo");
  std::string key;
  int64_t kib;
  std::string unit;
  while (f >> key >> kib) {
    std::getline(f, unit);
    if (key == "MemAvailable:") return kib * 1024;
  }
  return -1;
}

// Large host state: ask for transparent huge pages (fewer faults and TLB misses on a 100 GiB sweep)
// and touch it on every thread once, so the first step does not pay the page faults.
void prepare_host_block(const Tensor& t) {
  const uintptr_t huge = uintptr_t{2} << 20;
  auto* p = static_cast<char*>(t.data_ptr());
  const uintptr_t b = (reinterpret_cast<uintptr_t>(p) + huge - 1) / huge * huge;
  const uintptr_t e = (reinterpret_cast<uintptr_t>(p) + t.nbytes()) / huge * huge;
  if (e > b) (void)madvise(reinterpret_cast<void*>(b), e - b, MADV_HUGEPAGE);
}

Tensor host_zeros(const Shape& shape, DType dtype) {
  Tensor t = Tensor::empty(shape, dtype, Device::cpu());
  prepare_host_block(t);
  auto* d = static_cast<char*>(t.data_ptr());
  const int64_t es = static_cast<int64_t>(dtype_size(dtype));
  parallel_for(0, t.numel(), kUpdateGrain, [&](int64_t b, int64_t e) { std::fill(d + b * es, d + e * es, char{0}); });
  return t;
}

}  // namespace

OptimizerOffload parse_optimizer_offload(const std::string& s) {
  if (s == "none") return OptimizerOffload::None;
  if (s == "host") return OptimizerOffload::Host;
  throw make_error("optimizer", "optimizer.offload must be \"none\" (state on the device) or \"host\" (f32 master and "
                   "moments in host memory, updated on the CPU), got \"", s, "\"");
}

const char* optimizer_offload_name(OptimizerOffload o) { return o == OptimizerOffload::Host ? "host" : "none"; }

DType parse_optimizer_state_dtype(const std::string& s) {
  if (s == "f32") return DType::F32;
  if (s == "bf16") return DType::BF16;
  if (s == "q8") return DType::U8;
  throw make_error("optimizer", "optimizer.state_dtype must be \"f32\" (exact AdamW moments), \"bf16\" (moments "
                   "stored in bf16 on the host, with optimizer.offload=host) or \"q8\" (8-bit block-wise moments, "
                   "on the device or the host), got \"", s, "\"");
}

const char* optimizer_state_dtype_name(DType d) {
  return d == DType::U8 ? "q8" : d == DType::BF16 ? "bf16" : "f32";
}

MasterWeights parse_master_weights(const std::string& s) {
  if (s == "f32") return MasterWeights::F32;
  if (s == "none") return MasterWeights::None;
  throw make_error("optimizer", "optimizer.master_weights must be \"f32\" (an f32 master copy of 16-bit parameters) "
                   "or \"none\" (16-bit parameters updated in place with stochastic rounding), got \"", s, "\"");
}

const char* master_weights_name(MasterWeights w) { return w == MasterWeights::None ? "none" : "f32"; }

OptimizerPlacement optimizer_placement_from_config(const nlohmann::json& cfg, Device device) {
  const nlohmann::json& oc = cfg["optimizer"];
  const nlohmann::json& tr = cfg["train"];
  OptimizerPlacement pl;
  pl.offload = parse_optimizer_offload(oc["offload"]);
  pl.state_dtype = parse_optimizer_state_dtype(oc["state_dtype"]);
  // Configs written before these keys existed (older checkpoints) read as the exact defaults.
  pl.master_weights = parse_master_weights(oc.value("master_weights", std::string("f32")));
  pl.step_in_backward = oc.value("step_in_backward", false);
  pl.seed = tr["seed"].get<uint64_t>() ^ 0x6b657374726cull;
  const int64_t slot_mib = oc["staging_slot_mib"], slots = oc["staging_slots"];
  KESTREL_CHECK(slot_mib >= 1 && slot_mib <= 4096, "train", "optimizer.staging_slot_mib must lie in [1, 4096], got ", slot_mib);
  KESTREL_CHECK(slots >= 2 && slots <= 64, "train", "optimizer.staging_slots must lie in [2, 64], got ", slots);
  pl.staging_slot_bytes = slot_mib << 20;
  pl.staging_slots = static_cast<int>(slots);
  KESTREL_CHECK(pl.state_dtype != DType::BF16 || pl.offload == OptimizerOffload::Host, "train",
                "optimizer.state_dtype \"bf16\" needs optimizer.offload=\"host\"; on the device use \"q8\" or \"f32\"");
  KESTREL_CHECK(pl.master_weights == MasterWeights::F32 || pl.offload == OptimizerOffload::None || !device.is_cuda(),
                "train", "optimizer.master_weights=\"none\" with optimizer.offload=\"host\" is not implemented: the "
                "host keeps an f32 master in host memory, which costs no device memory; use master_weights \"f32\" "
                "with the host offload, or offload \"none\" to drop the master on the device");
  if (pl.step_in_backward) {
    const int64_t accum = tr["grad_accum"];
    const double clip = tr["grad_clip"];
    KESTREL_CHECK(accum == 1, "train", "optimizer.step_in_backward=true updates each parameter and frees its gradient "
                  "during backward, so gradients cannot accumulate across micro-batches: set train.grad_accum=1 (got ",
                  accum, ") and raise train.batch_size instead, or set optimizer.step_in_backward=false");
    KESTREL_CHECK(clip <= 0, "train", "optimizer.step_in_backward=true updates each parameter before the other "
                  "gradients exist, so global-norm clipping (train.grad_clip=", clip, ") cannot be applied: set "
                  "train.grad_clip=0, or optimizer.step_in_backward=false");
    KESTREL_CHECK(tr["nonfinite"] != "skip", "train", "optimizer.step_in_backward=true applies the update during "
                  "backward, before the step's gradient norm is known, so train.nonfinite=\"skip\" cannot hold a bad "
                  "step back: use train.nonfinite=\"stop\", or optimizer.step_in_backward=false");
  }
  return pl;
}

namespace {
// Bytes per parameter of the two moments in a storage (q8: two codes plus two f32 scales per block).
double moment_bytes(DType sd) {
  if (sd == DType::U8) return 2.0 + 8.0 / static_cast<double>(q8::kBlock);
  return 2.0 * static_cast<double>(dtype_size(sd));
}
}  // namespace

OptimizerStateBytes optimizer_state_bytes_per_param(const OptimizerPlacement& pl, DType param_dtype, bool on_cuda) {
  const bool sixteen = param_dtype != DType::F32 && param_dtype != DType::F64;
  OptimizerStateBytes b;
  if (pl.offload == OptimizerOffload::Host && on_cuda) {
    b.host = 4 + moment_bytes(pl.state_dtype);  // the host always keeps an f32 master
    return b;
  }
  const double master = sixteen && pl.master_weights == MasterWeights::F32 ? 4 : 0;
  const double state = master + moment_bytes(pl.state_dtype);
  if (pl.offload == OptimizerOffload::Host) b.host = 4 + moment_bytes(pl.state_dtype);  // CPU parameters
  else b.device = state;
  return b;
}

namespace {
int64_t trainable_numel(const models::ParameterList& params) {
  int64_t n = 0;
  for (auto& [name, p] : params.items()) n += p->requires_grad() ? p->numel() : 0;
  return n;
}
}  // namespace

int64_t AdamW::host_state_bytes_for(const models::ParameterList& params, DType state_dtype) {
  return static_cast<int64_t>(static_cast<double>(trainable_numel(params)) * (4 + moment_bytes(state_dtype)));
}

AdamW::AdamW(const models::ParameterList& params, AdamWOptions options, OptimizerPlacement placement,
             const ParameterGroupFn& groups)
    : options_(options), placement_(placement) {
  TagScope tag(MemoryTag::OptimizerState);
  const DType sd = placement_.state_dtype;
  const bool q8 = sd == DType::U8;
  KESTREL_CHECK(sd == DType::F32 || sd == DType::BF16 || q8, "optimizer",
                "the moments' storage must be f32, bf16 or q8 (u8), got ", dtype_name(sd));
  KESTREL_CHECK(sd != DType::BF16 || placement_.offload == OptimizerOffload::Host, "optimizer",
                "optimizer.state_dtype \"bf16\" is implemented for the host-offloaded state only: set "
                "optimizer.offload=\"host\", or use \"q8\" (8-bit moments, on the device too), or keep \"f32\"");
  Device dev;
  for (auto& [name, p] : params.items()) dev = p->device();
  KESTREL_CHECK(placement_.master_weights == MasterWeights::F32 || placement_.offload == OptimizerOffload::None ||
                    !dev.is_cuda(),
                "optimizer", "optimizer.master_weights \"none\" is implemented for the state on the device "
                "(optimizer.offload=\"none\"): the host offload keeps an f32 master in host memory, which costs no "
                "device memory; set optimizer.master_weights=\"f32\" with optimizer.offload=\"host\"");
  // Frozen parameters (requires_grad false: train.trainable) get no slot, so no state and no update.
  auto group_of = [&](const std::string& name, const Tensor& p) {
    return groups ? groups(name, p) : ParameterGroup{options_.weight_decay, 1.0};
  };
  if (placement_.offload == OptimizerOffload::None) {
    for (auto& [name, p] : params.items()) {
      if (!p->requires_grad()) continue;
      Slot s{name, p, Tensor(), Tensor(), Tensor(), {}, group_of(name, *p)};
      MemoryLabelScope label("adamw." + name, /*nested=*/false);
      const bool sixteen = p->dtype() == DType::BF16 || p->dtype() == DType::F16;
      if (p->dtype() != DType::F32 && !(sixteen && placement_.master_weights == MasterWeights::None))
        s.master = p->to(DType::F32).clone();
      if (q8) {
        s.q8 = Q8Moments::zeros(p->numel(), p->device());
      } else {
        s.m = Tensor::zeros(p->shape(), DType::F32, p->device());
        s.v = Tensor::zeros(p->shape(), DType::F32, p->device());
      }
      slots_.push_back(std::move(s));
    }
  } else {
    // Host offload: check that the host can hold the state before taking any of it.
    const int64_t need = host_state_bytes_for(params, sd), avail = host_memory_available();
    if (avail >= 0 && need > avail) {
      const int64_t master = trainable_numel(params) * 4, moments = need - master;
      std::ostringstream os;
      os << "optimizer.offload=host needs " << format_bytes(need) << " of host memory for the AdamW state of "
         << trainable_numel(params) << " parameters (f32 master " << format_bytes(master) << ", exp_avg + exp_avg_sq "
         << format_bytes(moments) << " in " << optimizer_state_dtype_name(sd) << ") but the host has "
         << format_bytes(avail) << " available (MemAvailable). Free host memory, use a machine with more, "
         << (sd != DType::U8 ? "store the moments in 8 bits (optimizer.state_dtype=q8: about 6 instead of 12 bytes per "
                               "parameter, not bit-exact), "
                             : "")
         << "train a smaller model, or keep the state on the device (optimizer.offload=none) if the device budget "
            "allows it.";
      throw make_error("optimizer", os.str());
    }
    for (auto& [name, p] : params.items()) {
      if (!p->requires_grad()) continue;
      Slot s{name, p, Tensor(), Tensor(), Tensor(), {}, group_of(name, *p)};
      MemoryLabelScope label("adamw." + name, /*nested=*/false);
      // f32 master: the parameter's values, converted on the host.
      Tensor host_param = p->to(Device::cpu());
      s.master = Tensor::empty(p->shape(), DType::F32, Device::cpu());
      prepare_host_block(s.master);
      {
        float* d = s.master.data<float>();
        const Tensor src = host_param.dtype() == DType::F32 ? host_param : host_param.to(DType::F32);
        const float* f = src.data<float>();
        parallel_for(0, src.numel(), kUpdateGrain, [&](int64_t b, int64_t e) { std::copy(f + b, f + e, d + b); });
      }
      if (q8) {
        const int64_t n = p->numel(), nb = q8::num_blocks(n);
        s.q8 = Q8Moments{host_zeros({n}, DType::U8), host_zeros({n}, DType::U8), host_zeros({nb}, DType::F32),
                         host_zeros({nb}, DType::F32)};
      } else {
        s.m = host_zeros(p->shape(), sd);
        s.v = host_zeros(p->shape(), sd);
      }
      slots_.push_back(std::move(s));
    }
    if (!slots_.empty()) staging_ = Staging::create(dev, placement_);
  }
  for (size_t k = 0; k < slots_.size(); ++k) slot_of_[slots_[k].param] = k;
  if (placement_.step_in_backward) {
    // One grad-ready hook per parameter: update it and drop its gradient at once.
    for (size_t k = 0; k < slots_.size(); ++k) {
      Tensor& p = *slots_[k].param;
      KESTREL_CHECK(p.requires_grad() && p.is_leaf(), "optimizer", "optimizer.step_in_backward: parameter '",
                    slots_[k].name, "' must be a leaf that requires grad");
      autograd::add_grad_ready_hook(p, [this, k, alive = std::weak_ptr<int>(alive_)](Tensor& param, Tensor& grad) {
        if (alive.expired()) return;  // the optimizer is gone; the gradient stays with the parameter
        KESTREL_CHECK(in_step_, "optimizer", "optimizer.step_in_backward: a backward reached parameter '",
                      slots_[k].name, "' outside begin_step() / end_step()");
        autograd::NoGradGuard no_grad;
        {
          TagScope tag(MemoryTag::Workspace);
          Tensor n = global_grad_norm_device({grad});
          Tensor sq = mul(n, n);
          if (grad_sq_sum_.defined()) add_into(grad_sq_sum_, sq);
          else grad_sq_sum_ = sq.clone();
        }
        AdamWOptions o = options_;
        o.lr = lr_;
        if (placement_.offload == OptimizerOffload::Host) update_slots_offloaded({k}, o);
        else update_slot(k, grad, o);
        param.zero_grad();  // the gradient goes now (the hook's caller holds the last reference)
      });
    }
  }
}

uint64_t AdamW::stream_seed(size_t slot, uint64_t salt) const {
  // SplitMix64 of (seed, step, slot, salt): a fresh, well-mixed key per parameter and step.
  uint64_t z = placement_.seed ^ (static_cast<uint64_t>(step_) * 0x9e3779b97f4a7c15ull) ^
               ((static_cast<uint64_t>(slot) + 1) * 0xbf58476d1ce4e5b9ull) ^ (salt * 0x94d049bb133111ebull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return z ? z : 1;  // 0 would mean round to nearest
}

Tensor AdamW::sqrt_of(const Tensor& t) { return sqrt(t); }



AdamWOptions AdamW::slot_options(size_t k, const AdamWOptions& step) const {
  AdamWOptions o = step;
  o.lr = step.lr * slots_[k].group.lr_scale;
  o.weight_decay = slots_[k].group.weight_decay;
  return o;
}

void AdamW::update_slot(size_t k, const Tensor& g, const AdamWOptions& step_options, const Tensor& grad_scale) {
  Slot& s = slots_[k];
  const AdamWOptions o = slot_options(k, step_options);
  const bool q8 = placement_.state_dtype == DType::U8;
  // Without a master a 16-bit parameter is rounded stochastically; with one, its copy to nearest.
  const uint64_t sr = s.master.defined() ? 0 : stream_seed(k, 1);
  Tensor& target = s.master.defined() ? s.master : *s.param;
  const Tensor copy = s.master.defined() ? *s.param : Tensor();
  if (q8)
    adamw_step_q8(target, g, s.q8, step_, o, copy, sr, stream_seed(k, 2));
  else
    adamw_step(target, g, s.m, s.v, step_, o, copy, sr, grad_scale);
}

bool AdamW::applies_grad_scale() const {
  return placement_.offload == OptimizerOffload::None && placement_.state_dtype != DType::U8 &&
         !placement_.step_in_backward;
}

void AdamW::step(double lr, const Tensor& grad_scale) {
  KESTREL_CHECK(!placement_.step_in_backward, "optimizer", "optimizer.step_in_backward: the parameters are updated "
                "during backward; call begin_step(lr) before it and end_step() after it instead of step()");
  KESTREL_CHECK(!grad_scale.defined() || applies_grad_scale(), "optimizer", "a gradient scale (the clip factor) is "
                "applied inside the update only with on-device f32 moments; clip the gradients in place instead");
  finish_step();
  autograd::NoGradGuard no_grad;
  if (placement_.offload == OptimizerOffload::Host) {
    step_offloaded(lr);
    return;
  }
  ++step_;
  AdamWOptions o = options_;
  o.lr = lr;
  for (size_t k = 0; k < slots_.size(); ++k) {
    Tensor g = slots_[k].param->grad();
    if (g.defined()) update_slot(k, g, o, grad_scale);
  }
}

void AdamW::begin_step(double lr) {
  KESTREL_CHECK(placement_.step_in_backward, "optimizer", "begin_step/end_step need optimizer.step_in_backward; "
                "call step(lr) after the backward instead");
  KESTREL_CHECK(!in_step_, "optimizer", "begin_step: the previous step was not closed with end_step()");
  finish_step();
  ++step_;
  lr_ = lr;
  in_step_ = true;
  grad_sq_sum_ = Tensor();
  stats_ = OptimizerStepStats{};
}

void AdamW::end_step() {
  KESTREL_CHECK(in_step_, "optimizer", "end_step without begin_step");
  in_step_ = false;
}

void AdamW::step_offloaded(double lr) {
  ++step_;
  AdamWOptions o = options_;
  o.lr = lr;
  std::vector<size_t> all;
  for (size_t k = 0; k < slots_.size(); ++k) all.push_back(k);
  stats_ = OptimizerStepStats{};
  update_slots_offloaded(all, o);
}

// Chunks in slot order (HF module order: embedding, layer 0, ..., the order a forward reads them),
// each within one slot, with that slot's constants (its group's lr and decay); q8 chunks hold whole
// quantisation blocks.
struct AdamW::OffloadWork {
  struct Piece {
    size_t slot;
    int64_t offset, n;
    DType gt, pt;
    HostAdamWConstants c;
    uint64_t moment_seed;  // q8
  };
  std::vector<Piece> pieces;
  std::vector<Staging::Chunk> chunks;
  std::vector<Tensor> grads;  // held until the work is dropped: the chunks point into them
};

std::unique_ptr<AdamW::OffloadWork> AdamW::plan_offloaded(const std::vector<size_t>& slots,
                                                          const AdamWOptions& o) const {
  const bool q8 = placement_.state_dtype == DType::U8;
  auto w = std::make_unique<OffloadWork>();
  for (size_t k : slots) {
    const Slot& s = slots_[k];
    Tensor g = s.param->grad();
    if (!g.defined()) continue;
    KESTREL_CHECK(g.is_contiguous() && s.param->is_contiguous() && g.numel() == s.param->numel(), "adamw-offload",
                  "gradient of '", s.name, "' must be contiguous and match its parameter");
    const HostAdamWConstants c = HostAdamWConstants::make(slot_options(k, o), step_);
    const uint64_t mseed = q8 ? stream_seed(k, 2) : 0;
    const int64_t gsz = static_cast<int64_t>(dtype_size(g.dtype())), psz = static_cast<int64_t>(dtype_size(s.param->dtype()));
    int64_t per = std::max<int64_t>(1, staging_->slot_bytes() / std::max(gsz, psz));
    if (q8) {
      KESTREL_CHECK(per >= q8::kBlock, "adamw-offload", "optimizer.staging_slot_mib is too small for q8 blocks");
      per = per / q8::kBlock * q8::kBlock;
    }
    for (int64_t off = 0; off < g.numel(); off += per) {
      const int64_t n = std::min(per, g.numel() - off);
      if (off == 0) w->grads.push_back(g);
      w->pieces.push_back({k, off, n, g.dtype(), s.param->dtype(), c, mseed});
      w->chunks.push_back({static_cast<const char*>(g.data_ptr()) + off * gsz, n * gsz,
                           static_cast<char*>(s.param->data_ptr()) + off * psz, n * psz});
    }
  }
  return w;
}

void AdamW::run_offloaded(const OffloadWork& w, const std::function<void(size_t)>& after_slot,
                          OptimizerStepStats& st) {
  const DType sd = placement_.state_dtype;
  const bool q8 = sd == DType::U8;
  const Staging::Update update = [&](size_t i, const void* hg, void* hout) {
    const OffloadWork::Piece& pc = w.pieces[i];
    Slot& s = slots_[pc.slot];
    const HostAdamWConstants& c = pc.c;
    const int64_t gsz = static_cast<int64_t>(dtype_size(pc.gt)), psz = static_cast<int64_t>(dtype_size(pc.pt));
    float* master = s.master.data<float>() + pc.offset;
    if (q8) {
      const int64_t nb = q8::num_blocks(pc.n), first_block = pc.offset / q8::kBlock;
      parallel_for(0, nb, kUpdateGrain / q8::kBlock, [&](int64_t b, int64_t e) {
        const int64_t lo = b * q8::kBlock, hi = std::min(pc.n, e * q8::kBlock);
        HostQ8State q{s.q8.m_codes.data<uint8_t>() + pc.offset + lo, s.q8.v_codes.data<uint8_t>() + pc.offset + lo,
                      s.q8.m_scale.data<float>() + first_block + b, s.q8.v_scale.data<float>() + first_block + b,
                      static_cast<uint64_t>(pc.offset + lo), pc.moment_seed};
        host_adamw_q8_update(master + lo, q, static_cast<const char*>(hg) + lo * gsz, pc.gt,
                             static_cast<char*>(hout) + lo * psz, pc.pt, hi - lo, c);
      });
      return;
    }
    const int64_t ssz = static_cast<int64_t>(dtype_size(sd));
    char* m = static_cast<char*>(s.m.data_ptr()) + pc.offset * ssz;
    char* v = static_cast<char*>(s.v.data_ptr()) + pc.offset * ssz;
    parallel_for(0, pc.n, kUpdateGrain, [&](int64_t b, int64_t e) {
      host_adamw_update(master + b, m + b * ssz, v + b * ssz, sd, static_cast<const char*>(hg) + b * gsz, pc.gt,
                        static_cast<char*>(hout) + b * psz, pc.pt, e - b, c);
    });
  };
  if (!after_slot) {
    staging_->run(w.chunks, update, st);
    return;
  }
  const Staging::AfterChunk after = [&](size_t i) {
    if (i + 1 == w.pieces.size() || w.pieces[i + 1].slot != w.pieces[i].slot) after_slot(w.pieces[i].slot);
  };
  staging_->run(w.chunks, update, st, &after);
}

void AdamW::update_slots_offloaded(const std::vector<size_t>& slots, const AdamWOptions& o) {
  const std::unique_ptr<OffloadWork> w = plan_offloaded(slots, o);
  OptimizerStepStats st;
  run_offloaded(*w, {}, st);
  stats_.host_ms += st.host_ms;
  stats_.update_ms += st.update_ms;
  stats_.copy_wait_ms += st.copy_wait_ms;
  stats_.d2h_bytes += st.d2h_bytes;
  stats_.h2d_bytes += st.h2d_bytes;
}

struct AdamW::AsyncStep {
  std::thread worker;
  std::mutex mu;
  std::condition_variable cv;
  std::vector<char> pending;  // per slot: updated by this step
  std::vector<char> ready;    // per slot: its copies are enqueued and marked (guarded by mu)
  std::vector<char> waited;   // per slot: the compute stream was ordered after them (caller's thread)
  bool finished = false;      // guarded by mu
  std::exception_ptr error;   // guarded by mu
  OptimizerStepStats stats;   // the worker's
  double fence_wait_ms = 0;   // the caller's
  std::unique_ptr<OffloadWork> work;  // dropped on the caller's thread (it may hold device gradients)
};

AdamW::~AdamW() {
  if (async_ && async_->worker.joinable()) async_->worker.join();  // its error is dropped with the optimizer
}

void AdamW::step_async(double lr) {
  KESTREL_CHECK(!placement_.step_in_backward, "optimizer", "step_async: with optimizer.step_in_backward the "
                "parameters are updated during backward (begin_step / end_step)");
  finish_step();
  if (placement_.offload != OptimizerOffload::Host) {
    step(lr);
    return;
  }
  autograd::NoGradGuard no_grad;
  ++step_;
  AdamWOptions o = options_;
  o.lr = lr;
  std::vector<size_t> all;
  for (size_t k = 0; k < slots_.size(); ++k) all.push_back(k);
  auto a = std::make_unique<AsyncStep>();
  a->work = plan_offloaded(all, o);  // takes the gradients here, on the caller's thread
  const OffloadWork* w = a->work.get();  // stats_ keeps the last finished step's figures until this one ends
  a->pending.assign(slots_.size(), 0);
  a->ready.assign(slots_.size(), 0);
  a->waited.assign(slots_.size(), 0);
  for (const auto& pc : w->pieces) a->pending[pc.slot] = 1;
  staging_->mark_compute_ready(slots_.size());
  AsyncStep* ap = a.get();
  a->worker = std::thread([this, ap, w] {
    try {
      run_offloaded(*w, [&](size_t k) {
        staging_->record_marker(k);
        {
          std::lock_guard<std::mutex> g(ap->mu);
          ap->ready[k] = 1;
        }
        ap->cv.notify_all();
      }, ap->stats);
    } catch (...) {
      std::lock_guard<std::mutex> g(ap->mu);
      ap->error = std::current_exception();
    }
    {
      std::lock_guard<std::mutex> g(ap->mu);
      ap->finished = true;
    }
    ap->cv.notify_all();
  });
  async_ = std::move(a);
}

void AdamW::wait_parameter(const Tensor* param) {
  AsyncStep* a = async_.get();
  if (!a) return;
  auto it = slot_of_.find(param);
  if (it == slot_of_.end()) return;
  const size_t k = it->second;
  if (!a->pending[k] || a->waited[k]) return;
  const auto t0 = std::chrono::steady_clock::now();
  bool ready;
  {
    std::unique_lock<std::mutex> lock(a->mu);
    a->cv.wait(lock, [&] { return a->ready[k] || a->finished; });
    ready = a->ready[k];
  }
  a->fence_wait_ms += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  if (!ready) {
    finish_step();  // rethrows the worker's error
    throw make_error("adamw-offload", "the asynchronous update ended without updating '", slots_[k].name, "'");
  }
  staging_->compute_wait_marker(k);
  a->waited[k] = 1;
}

void AdamW::finish_step() {
  if (!async_) return;
  std::unique_ptr<AsyncStep> a = std::move(async_);
  a->worker.join();
  stats_ = a->stats;
  stats_.fence_wait_ms = a->fence_wait_ms;
  if (a->error) std::rethrow_exception(a->error);
  staging_->compute_wait_all();
}

std::vector<std::string> AdamW::unwaited_parameters() const {
  std::vector<std::string> out;
  if (!async_) return out;
  for (size_t k = 0; k < slots_.size(); ++k)
    if (async_->pending[k] && !async_->waited[k]) out.push_back(slots_[k].name);
  return out;
}

double AdamW::last_step_gpu_idle_ms() const { return staging_ ? staging_->last_gpu_idle_ms() : -1; }

int64_t AdamW::state_bytes() const {
  int64_t n = 0;
  for (const Slot& s : slots_)
    n += static_cast<int64_t>((s.m.defined() ? s.m.nbytes() + s.v.nbytes() : 0) + s.q8.nbytes() +
                              (s.master.defined() ? s.master.nbytes() : 0));
  return n;
}

int64_t AdamW::device_state_bytes() const { return placement_.offload == OptimizerOffload::Host ? 0 : state_bytes(); }
int64_t AdamW::host_state_bytes() const { return placement_.offload == OptimizerOffload::Host ? state_bytes() : 0; }

std::vector<std::pair<std::string, Tensor>> AdamW::state() const {
  KESTREL_CHECK(!async_, "optimizer", "state() while an asynchronous step is updating it: call finish_step() first");
  std::vector<std::pair<std::string, Tensor>> out;
  for (const Slot& s : slots_) {
    if (s.q8.numel() > 0 || !s.m.defined()) {  // q8: the codes and block scales as they are
      out.emplace_back("exp_avg_q8." + s.name, s.q8.m_codes);
      out.emplace_back("exp_avg_scale." + s.name, s.q8.m_scale);
      out.emplace_back("exp_avg_sq_q8." + s.name, s.q8.v_codes);
      out.emplace_back("exp_avg_sq_scale." + s.name, s.q8.v_scale);
    } else {
      out.emplace_back("exp_avg." + s.name, s.m);
      out.emplace_back("exp_avg_sq." + s.name, s.v);
    }
    // An f32 parameter's offloaded master equals the parameter: checkpoints stay the same either way.
    if (s.master.defined() && s.param->dtype() != DType::F32) out.emplace_back("master." + s.name, s.master);
  }
  return out;
}

void AdamW::load_state(const std::map<std::string, Tensor>& tensors, int64_t step) {
  finish_step();
  auto take = [&](const std::string& key, Tensor& dst) {
    auto it = tensors.find(key);
    KESTREL_CHECK(it != tensors.end(), "optimizer", "checkpoint has no optimizer state '", key, "'");
    KESTREL_CHECK(it->second.shape() == dst.shape(), "optimizer", "state '", key, "' has shape ",
                  shape_str(it->second.shape()), ", expected ", shape_str(dst.shape()));
    dst.copy_(it->second);
  };
  for (Slot& s : slots_) {
    if (s.m.defined()) {
      take("exp_avg." + s.name, s.m);
      take("exp_avg_sq." + s.name, s.v);
    } else {
      take("exp_avg_q8." + s.name, s.q8.m_codes);
      take("exp_avg_scale." + s.name, s.q8.m_scale);
      take("exp_avg_sq_q8." + s.name, s.q8.v_codes);
      take("exp_avg_sq_scale." + s.name, s.q8.v_scale);
    }
    if (!s.master.defined()) continue;
    if (s.param->dtype() != DType::F32)
      take("master." + s.name, s.master);
    else
      s.master.copy_(*s.param);  // offloaded master of an f32 parameter: the parameter itself
  }
  step_ = step;
}

std::unique_ptr<AdamW::Staging> AdamW::Staging::create(Device device, const OptimizerPlacement& placement) {
  if (device.is_cpu()) {
    // Parameters in host memory: the update reads the gradient and writes the parameter in place.
    class HostStaging final : public Staging {
     public:
      int64_t slot_bytes() const override { return int64_t{1} << 40; }
      // Asynchronous runs need no markers: the caller's host-side wait is the ordering.
      void run(const std::vector<Chunk>& chunks, const Update& update, OptimizerStepStats& st,
               const AfterChunk* after_chunk) override {
        for (size_t k = 0; k < chunks.size(); ++k) {
          update(k, chunks[k].grad, chunks[k].param);
          if (after_chunk) (*after_chunk)(k);
        }
      }
    };
    return std::make_unique<HostStaging>();
  }
#if KESTREL_WITH_CUDA
  if (device.is_cuda()) return make_cuda_staging(device.index, placement);
#endif
  throw make_error("adamw-offload", "no host offload for parameters on ", device.str());
}

}  // namespace kestrel::train
