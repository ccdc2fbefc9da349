// Gradient averaging over the data-parallel ranks in buckets (data_parallel.h states the policy).
#include "data_parallel.h"

#include "kestrel/autograd/tape.h"
#include "kestrel/runtime/memory.h"
#include "kestrel/runtime/rendezvous.h"

namespace kestrel::train {

GradientAllReduce::GradientAllReduce(models::ParameterList& params, Communicator& comm, int64_t bucket_bytes,
                                     std::vector<int> owners)
    : comm_(comm), bucket_bytes_(bucket_bytes) {
  KESTREL_CHECK(bucket_bytes > 0, "data_parallel", "the bucket size must be positive, got ", bucket_bytes);
  KESTREL_CHECK(owners.empty() || owners.size() == params.size(), "data_parallel", "owners for ", owners.size(),
                " parameters, the list has ", params.size());
  size_t i = 0;
  for (auto& [name, p] : params.items()) {
    Tensor* param = p;
    if (!owners.empty()) owner_of_[param] = owners[i++];
    if (!param->requires_grad()) continue;
    autograd::add_grad_ready_hook(*param, [this, param](Tensor&, Tensor& grad) { on_ready(param, grad); });
  }
}

void GradientAllReduce::on_ready(Tensor* param, const Tensor& grad) {
  if (!armed_ || !grad.defined()) return;
  const int owner = owner_of_.empty() ? -1 : owner_of_.at(param);
  if (!open_.params.empty() && (open_.params.front()->grad().dtype() != grad.dtype() || open_.owner != owner)) launch();
  open_.owner = owner;
  open_.params.push_back(param);
  open_.bytes += static_cast<int64_t>(grad.nbytes());
  if (open_.bytes >= bucket_bytes_) launch();
}

void GradientAllReduce::launch() {
  if (open_.params.empty()) return;
  const Tensor first = open_.params.front()->grad();
  int64_t n = 0;
  for (Tensor* p : open_.params) n += p->grad().numel();
  TagScope tag(MemoryTag::Gradient);
  open_.flat = Tensor::empty({n}, first.dtype(), first.device());
  int64_t at = 0;
  for (Tensor* p : open_.params) {
    Tensor g = p->grad();
    open_.flat.narrow_view(0, at, g.numel()).view(g.shape()).copy_(g);
    at += g.numel();
  }
  ++launched_;
  if (open_.owner < 0) {
    comm_.all_reduce(open_.flat, ReduceOp::Avg);
  } else {
    comm_.reduce(open_.flat, open_.owner, ReduceOp::Avg);
    if (open_.owner != comm_.rank()) {
      // ZeRO-2: not ours; the gradients and the flat copy go now (on NCCL the comm stream holds the
      // flat block by record_stream until the reduce has read it).
      for (Tensor* p : open_.params) p->zero_grad();
      open_ = Bucket{};
      return;
    }
  }
  in_flight_.push_back(std::move(open_));
  open_ = Bucket{};
}

void GradientAllReduce::finish() {
  if (!armed_) return;
  launch();
  comm_.wait();  // the compute stream (and so the copies below) after the collectives
  for (Bucket& b : in_flight_) {
    int64_t at = 0;
    for (Tensor* p : b.params) {
      Tensor g = p->grad();
      g.copy_(b.flat.narrow_view(0, at, g.numel()).view(g.shape()));
      at += g.numel();
    }
  }
  in_flight_.clear();
  armed_ = false;
}

}  // namespace kestrel::train

namespace kestrel::train {

namespace {
CommOptions comm_options(const nlohmann::json& cfg) {
  const double secs = cfg["distributed"]["timeout_s"].get<double>();
  KESTREL_CHECK(secs > 0, "train", "distributed.timeout_s must be positive, got ", secs);
  return CommOptions{std::chrono::milliseconds(static_cast<int64_t>(secs * 1000))};
}
}  // namespace

void broadcast_parameters(models::ParameterList& params, Communicator& comm) {
  for (auto& [name, p] : params.items()) comm.broadcast(*p, 0);
  comm.wait();
}

std::shared_ptr<Communicator> connect_data_parallel(const nlohmann::json& cfg, Device device) {
  const std::string backend = cfg["distributed"]["backend"];
  KESTREL_CHECK(backend == "auto" || backend == "none" || backend == "nccl", "train",
                "distributed.backend must be \"auto\", \"none\" or \"nccl\", got '", backend,
                "' (the in-process backend is for tests: Trainer(config, communicator))");
  const LaunchEnv env = launch_env_from_process();
  if (env.world_size == 1 && backend != "nccl") return nullptr;
  KESTREL_CHECK(backend != "none", "train", "launched as rank ", env.rank, " of ", env.world_size, " (", env.source,
                ") but distributed.backend is \"none\"");
  KESTREL_CHECK(device.is_cuda(), "train", "data parallelism across processes runs over NCCL on CUDA devices; the "
                "device is ", device.str(), " (launched as rank ", env.rank, " of ", env.world_size, ")");
  KESTREL_CHECK(nccl_available(), "train", "distributed.backend needs NCCL, and this library was built without it");
  KESTREL_CHECK(env.world_size == 1 || device.index == env.local_rank, "train", "rank ", env.rank, " has local rank ",
                env.local_rank, " but the device is ", device.str(), ": set device=cuda:", env.local_rank,
                " (one GPU per process)");
  const CommOptions opt = comm_options(cfg);
  std::vector<uint8_t> id = env.rank == 0 ? nccl_unique_id() : std::vector<uint8_t>{};
  id = tcp_rendezvous_broadcast(env.master_addr, env.master_port, env.rank, env.world_size, id, opt.timeout);
  return make_nccl_communicator(id, env.rank, env.world_size, device.index, opt);
}

DataShard check_data_parallel(const nlohmann::json& cfg, const Communicator* comm, int64_t batch_size,
                              bool step_in_backward, bool gradients_on_host) {
  const nlohmann::json& d = cfg["distributed"];
  const int64_t zero = d["zero"].get<int64_t>();
  KESTREL_CHECK(zero >= 0 && zero <= 2, "train", "distributed.zero must be 0 (every rank keeps the whole optimizer "
                "state), 1 (optimizer state sharded) or 2 (optimizer state and gradients sharded), got ", d["zero"].dump(),
                " (ZeRO-3, sharded parameters, is not built)");
  KESTREL_CHECK(d["bucket_mib"].get<double>() > 0, "train", "distributed.bucket_mib must be positive");
  comm_options(cfg);
  DataShard s;
  if (!comm) return s;
  s.rank = comm->rank();
  s.world = comm->world_size();
  KESTREL_CHECK(batch_size % s.world == 0, "train", "train.batch_size ", batch_size, " (the global micro-batch) "
                "does not split evenly over ", s.world, " ranks");
  KESTREL_CHECK(!step_in_backward, "train", "optimizer.step_in_backward with data parallelism is not built (the "
                "update would run before the gradients are averaged)");
  KESTREL_CHECK(!gradients_on_host, "train", "optimizer.gradients=\"host\" with data parallelism is not built");
  return s;
}

}  // namespace kestrel::train
