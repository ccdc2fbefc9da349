// Private: data parallelism for the trainer. Every rank holds the whole model and trains on its own
// slice of each global micro-batch; GradientAllReduce averages the gradients over the ranks as
// backward produces them. Policy:
// - one grad-ready hook per parameter (autograd/tape.h) appends the finished gradient to the open
//   bucket; a bucket is launched when it holds `bucket_bytes` (or the dtype changes): its gradients
//   are copied into one flat buffer and averaged with one all_reduce, which on NCCL runs on the
//   communication stream while backward continues on the compute stream. Hooks fire in the tape's
//   order, the same on every rank, so the ranks' buckets match;
// - only the backward of a step's last micro-batch reduces (arm() before it): earlier micro-batches
//   only accumulate locally, so accumulation costs no communication;
// - finish() launches the last partial bucket, orders the compute stream after the collectives
//   (Communicator::wait) and copies the averages back into the gradients. The flat buffers are
//   tag Gradient and live from their launch to finish(): at most one extra copy of the gradients;
// - a parameter without a gradient on this backward is skipped; every rank must agree on that
//   (the same model on the same shapes does), else the collectives' checks fail naming the sizes;
// - ZeRO-2 (`owners` given, zero.h): a bucket also closes where the owner changes, is reduced to
//   its owner only, and on the other ranks its gradients (and its flat buffer) are dropped as soon
//   as it is issued; finish() copies back only the owned buckets.
#pragma once

#include <map>
#include <memory>
#include <vector>

#include "kestrel/models/parameters.h"
#include <nlohmann/json.hpp>

#include "kestrel/runtime/communicator.h"

namespace kestrel::train {

// The rank's share of a global micro-batch: rows [rank * local, (rank + 1) * local) of global
// micro-batch `position`, i.e. the task's micro-batch index position * world + rank at batch size
// global / world (tasks number rows index * batch + row). A pure function of (position, rank, world).
struct DataShard {
  int rank = 0, world = 1;
  uint64_t index(uint64_t position) const { return position * static_cast<uint64_t>(world) + static_cast<uint64_t>(rank); }
};

class GradientAllReduce {
 public:
  // `owners` (one rank per parameter, list order; empty: all-reduce every bucket) selects ZeRO-2.
  GradientAllReduce(models::ParameterList& params, Communicator& comm, int64_t bucket_bytes,
                    std::vector<int> owners = {});
  GradientAllReduce(const GradientAllReduce&) = delete;
  GradientAllReduce& operator=(const GradientAllReduce&) = delete;

  void arm() { armed_ = true; }  // the next backward's hooks reduce
  void finish();                 // after that backward: every gradient holds the ranks' mean
  int64_t buckets_launched() const { return launched_; }

 private:
  struct Bucket {
    std::vector<Tensor*> params;
    Tensor flat;  // the bucket's gradients, reduced in place
    int64_t bytes = 0;
    int owner = -1;  // ZeRO-2: the rank the bucket is reduced to
  };
  void on_ready(Tensor* param, const Tensor& grad);
  void launch();

  Communicator& comm_;
  int64_t bucket_bytes_;
  std::map<const Tensor*, int> owner_of_;  // ZeRO-2 only
  bool armed_ = false;
  Bucket open_;
  std::vector<Bucket> in_flight_;
  int64_t launched_ = 0;
};

}  // namespace kestrel::train

namespace kestrel::train {

// Every rank starts from rank 0's parameters (one broadcast per parameter, ordered with the compute
// stream), so an initialisation that differs between ranks cannot split the replicas.
void broadcast_parameters(models::ParameterList& params, Communicator& comm);

// The communicator a run's config and launcher ask for, read once at start-up: the launcher's
// variables (rendezvous.h) give the rank and world size; distributed.backend "auto" is none for one
// process and NCCL (unique id sent by a TCP rendezvous at MASTER_ADDR:MASTER_PORT) for more,
// "nccl" forces NCCL even for one process (the same code path at world size 1), "none" refuses a
// multi-process launch. Null for a single process without NCCL. Errors name the setting.
std::shared_ptr<Communicator> connect_data_parallel(const nlohmann::json& cfg, Device device);

// Checks distributed.* against the run (refusals name what is not built: distributed.zero outside
// 0..2, step_in_backward, gradients on the host, a batch that does not split evenly) and returns
// the rank's data shard (world 1 without a communicator).
DataShard check_data_parallel(const nlohmann::json& cfg, const Communicator* comm, int64_t batch_size,
                              bool step_in_backward, bool gradients_on_host);

}  // namespace kestrel::train
