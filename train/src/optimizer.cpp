#include "kestrel/train/optimizer.h"

#include <sys/mman.h>

#include <algorithm>
#include <fstream>
#include <sstream>

#include "host_adamw.h"
#include "host_staging.h"
#include "kestrel/autograd/grad_mode.h"
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
  throw make_error("optimizer", "optimizer.state_dtype must be \"f32\" (exact AdamW moments) or \"bf16\" (moments "
                   "stored in bf16 on the host, with optimizer.offload=host), got \"", s, "\"");
}

int64_t AdamW::host_state_bytes_for(const models::ParameterList& params, DType state_dtype) {
  return params.numel() * (4 + 2 * static_cast<int64_t>(dtype_size(state_dtype)));
}

AdamW::AdamW(const models::ParameterList& params, AdamWOptions options, OptimizerPlacement placement)
    : options_(options), placement_(placement) {
  TagScope tag(MemoryTag::OptimizerState);
  KESTREL_CHECK(placement_.state_dtype == DType::F32 || placement_.state_dtype == DType::BF16, "optimizer",
                "the moments' dtype must be f32 or bf16, got ", dtype_name(placement_.state_dtype));
  KESTREL_CHECK(placement_.state_dtype == DType::F32 || placement_.offload == OptimizerOffload::Host, "optimizer",
                "optimizer.state_dtype \"bf16\" is implemented for the host-offloaded state only: set "
                "optimizer.offload=\"host\" or keep state_dtype \"f32\"");
  if (placement_.offload == OptimizerOffload::None) {
    for (auto& [name, p] : params.items()) {
      Slot s{name, p, Tensor(), Tensor(), Tensor()};
      MemoryLabelScope label("adamw." + name, /*nested=*/false);
      if (p->dtype() != DType::F32) s.master = p->to(DType::F32).clone();
      s.m = Tensor::zeros(p->shape(), DType::F32, p->device());
      s.v = Tensor::zeros(p->shape(), DType::F32, p->device());
      slots_.push_back(std::move(s));
    }
    return;
  }
  // Host offload: check that the host can hold the state before taking any of it.
  const DType sd = placement_.state_dtype;
  const int64_t need = host_state_bytes_for(params, sd), avail = host_memory_available();
  if (avail >= 0 && need > avail) {
    const int64_t master = params.numel() * 4, moment = params.numel() * static_cast<int64_t>(dtype_size(sd));
    std::ostringstream os;
    os << "optimizer.offload=host needs " << format_bytes(need) << " of host memory for the AdamW state of "
       << params.numel() << " parameters (f32 master " << format_bytes(master) << ", exp_avg " << format_bytes(moment)
       << ", exp_avg_sq " << format_bytes(moment) << " in " << dtype_name(sd) << ") but the host has "
       << format_bytes(avail) << " available (MemAvailable). Free host memory, use a machine with more, "
       << (sd == DType::F32 ? "store the moments in bf16 (optimizer.state_dtype=bf16: 8 instead of 12 bytes per "
                              "parameter, not bit-exact), "
                            : "")
       << "train a smaller model, or keep the state on the device (optimizer.offload=none) if the device budget "
          "allows it.";
    throw make_error("optimizer", os.str());
  }
  Device dev;
  for (auto& [name, p] : params.items()) {
    dev = p->device();
    Slot s{name, p, Tensor(), Tensor(), Tensor()};
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
    s.m = host_zeros(p->shape(), sd);
    s.v = host_zeros(p->shape(), sd);
    slots_.push_back(std::move(s));
  }
  if (!slots_.empty()) staging_ = Staging::create(dev, placement_);
}

AdamW::~AdamW() = default;

void AdamW::step(double lr) {
  autograd::NoGradGuard no_grad;
  if (placement_.offload == OptimizerOffload::Host) {
    step_offloaded(lr);
    return;
  }
  ++step_;
  AdamWOptions o = options_;
  o.lr = lr;
  for (Slot& s : slots_) {
    Tensor g = s.param->grad();
    if (!g.defined()) continue;
    if (s.master.defined())
      adamw_step(s.master, g, s.m, s.v, step_, o, *s.param);
    else
      adamw_step(*s.param, g, s.m, s.v, step_, o);
  }
}

void AdamW::step_offloaded(double lr) {
  ++step_;
  AdamWOptions o = options_;
  o.lr = lr;
  const HostAdamWConstants c = HostAdamWConstants::make(o, step_);
  // Chunks in parameter order (HF module order: embedding, layer 0, ...), each within one slot.
  struct Piece {
    Slot* slot;
    int64_t offset, n;
    DType gt, pt;
  };
  std::vector<Piece> pieces;
  std::vector<Staging::Chunk> chunks;
  for (Slot& s : slots_) {
    Tensor g = s.param->grad();
    if (!g.defined()) continue;
    KESTREL_CHECK(g.is_contiguous() && s.param->is_contiguous() && g.numel() == s.param->numel(), "adamw-offload",
                  "gradient of '", s.name, "' must be contiguous and match its parameter");
    const int64_t gsz = static_cast<int64_t>(dtype_size(g.dtype())), psz = static_cast<int64_t>(dtype_size(s.param->dtype()));
    const int64_t per = std::max<int64_t>(1, staging_->slot_bytes() / std::max(gsz, psz));
    for (int64_t off = 0; off < g.numel(); off += per) {
      const int64_t n = std::min(per, g.numel() - off);
      pieces.push_back({&s, off, n, g.dtype(), s.param->dtype()});
      chunks.push_back({static_cast<const char*>(g.data_ptr()) + off * gsz, n * gsz,
                        static_cast<char*>(s.param->data_ptr()) + off * psz, n * psz});
    }
  }
  stats_ = OptimizerStepStats{};
  staging_->run(chunks, [&](size_t k, const void* hg, void* hout) {
    const Piece& pc = pieces[k];
    const int64_t gsz = static_cast<int64_t>(dtype_size(pc.gt)), psz = static_cast<int64_t>(dtype_size(pc.pt));
    const DType sd = placement_.state_dtype;
    const int64_t ssz = static_cast<int64_t>(dtype_size(sd));
    float* master = pc.slot->master.data<float>() + pc.offset;
    char* m = static_cast<char*>(pc.slot->m.data_ptr()) + pc.offset * ssz;
    char* v = static_cast<char*>(pc.slot->v.data_ptr()) + pc.offset * ssz;
    parallel_for(0, pc.n, kUpdateGrain, [&](int64_t b, int64_t e) {
      host_adamw_update(master + b, m + b * ssz, v + b * ssz, sd, static_cast<const char*>(hg) + b * gsz, pc.gt,
                        static_cast<char*>(hout) + b * psz, pc.pt, e - b, c);
    });
  }, stats_);
}

double AdamW::last_step_gpu_idle_ms() const { return staging_ ? staging_->last_gpu_idle_ms() : -1; }

int64_t AdamW::state_bytes() const {
  int64_t n = 0;
  for (const Slot& s : slots_) n += static_cast<int64_t>(s.m.nbytes() + s.v.nbytes() + (s.master.defined() ? s.master.nbytes() : 0));
  return n;
}

int64_t AdamW::device_state_bytes() const { return placement_.offload == OptimizerOffload::Host ? 0 : state_bytes(); }
int64_t AdamW::host_state_bytes() const { return placement_.offload == OptimizerOffload::Host ? state_bytes() : 0; }

std::vector<std::pair<std::string, Tensor>> AdamW::state() const {
  std::vector<std::pair<std::string, Tensor>> out;
  for (const Slot& s : slots_) {
    out.emplace_back("exp_avg." + s.name, s.m);
    out.emplace_back("exp_avg_sq." + s.name, s.v);
    // An f32 parameter's offloaded master equals the parameter: checkpoints stay the same either way.
    if (s.master.defined() && s.param->dtype() != DType::F32) out.emplace_back("master." + s.name, s.master);
  }
  return out;
}

void AdamW::load_state(const std::map<std::string, Tensor>& tensors, int64_t step) {
  auto take = [&](const std::string& key, Tensor& dst) {
    auto it = tensors.find(key);
    KESTREL_CHECK(it != tensors.end(), "optimizer", "checkpoint has no optimizer state '", key, "'");
    KESTREL_CHECK(it->second.shape() == dst.shape(), "optimizer", "state '", key, "' has shape ",
                  shape_str(it->second.shape()), ", expected ", shape_str(dst.shape()));
    dst.copy_(it->second);
  };
  for (Slot& s : slots_) {
    take("exp_avg." + s.name, s.m);
    take("exp_avg_sq." + s.name, s.v);
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
      void run(const std::vector<Chunk>& chunks, const Update& update, OptimizerStepStats& st) override {
        for (size_t k = 0; k < chunks.size(); ++k) update(k, chunks[k].grad, chunks[k].param);
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
