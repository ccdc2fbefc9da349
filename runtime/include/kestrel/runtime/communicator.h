// Collective communication between the ranks of a data-parallel group, over Tensors.
//
// One interface, two backends:
// - in-process (make_inprocess_group): N threads of one process are the ranks; they meet at one
//   shared rendezvous object. Reductions add the ranks' values in rank order (0, 1, ..., N-1) in
//   f32 (f64 for f64 tensors), then round once to the tensor's dtype, so a result is bit-identical
//   run to run and equals the serial reference. It is what CPU tests of everything above use.
// - NCCL (make_nccl_communicator, only where the library was built with NCCL): collectives run on
//   a dedicated communication stream that first waits (by event) for the work already queued on
//   the caller's compute stream; `wait()` makes the compute stream wait for the collectives issued
//   so far, and synchronize() bounds a host wait for them by the timeout. The NCCL communicator's device memory is measured and charged to the device's External
//   bytes, so it counts against the memory budget.
// Every rank must call the same collectives in the same order with tensors of the same dtype and
// element count; the in-process backend checks that and names the difference. Errors are
// kestrel::Error "[comm] <collective>: ...". A peer that does not arrive within the timeout, or a
// group aborted by a failing rank (abort()), ends the collective with an error on every waiting
// rank instead of a hang.
// No NCCL or CUDA type appears here.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kestrel/runtime/tensor.h"

namespace kestrel {

// Max: the largest value over the ranks (every rank receives the same value; on the in-process
// backend a NaN on any rank gives NaN). Data parallelism reduces the FP8 amax with it.
enum class ReduceOp : uint8_t { Sum, Avg, Max };

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  virtual std::string backend() const = 0;  // "inprocess", "nccl"

  // In place: every rank's `t` becomes the sum (mean, max) over the ranks. Contiguous tensors.
  virtual void all_reduce(Tensor& t, ReduceOp op) = 0;
  // `input` (world_size * n elements) is reduced over the ranks; rank r receives elements
  // [r*n, (r+1)*n) of the result in `output` (n elements).
  virtual void reduce_scatter(const Tensor& input, Tensor& output, ReduceOp op) = 0;
  // `output` (world_size * n elements) receives every rank's `input` (n elements), rank r's at r*n.
  virtual void all_gather(const Tensor& input, Tensor& output) = 0;
  // Every rank's `t` becomes root's.
  virtual void broadcast(Tensor& t, int root) = 0;
  // In place on `root`: its `t` becomes the sum (or mean) over the ranks; the other ranks' `t` is
  // unspecified afterwards (NCCL leaves it, the in-process backend and this default all-reduce).
  // ZeRO-2 reduces each gradient bucket to the rank that owns its parameters.
  virtual void reduce(Tensor& t, int root, ReduceOp op) {
    (void)root;
    all_reduce(t, op);
  }
  virtual void barrier() = 0;
  // Orders the caller's compute stream after every collective issued so far (a no-op where the
  // collectives are synchronous, as in the in-process backend).
  virtual void wait() {}
  // The host waits for the collectives issued so far, at most the timeout; past it the
  // communicator is aborted and "[comm] ... timed out" thrown (a dead peer, not a hang). A no-op
  // where collectives are synchronous.
  virtual void synchronize() {}
  // Marks the group failed with `reason`: collectives waiting on other ranks (and later ones) throw
  // "[comm] ... aborted: rank R: reason" instead of waiting for the timeout.
  virtual void abort(const std::string& reason) = 0;
};

struct CommOptions {
  // How long a collective waits for the slowest rank before it fails naming the missing ranks.
  std::chrono::milliseconds timeout{std::chrono::seconds(300)};
};

// N communicators (rank i at index i) sharing one rendezvous; hand one to each thread.
std::vector<std::unique_ptr<Communicator>> make_inprocess_group(int world_size, const CommOptions& options = {});

// A group of one: every collective is the identity (world_size 1 without any backend).
std::unique_ptr<Communicator> make_single_rank_communicator();

// ---- NCCL ----
// True when this library was built with NCCL (KESTREL_WITH_NCCL); otherwise make_nccl_communicator
// throws "[comm] NCCL backend not built".
bool nccl_available();
// NCCL's unique id (ncclGetUniqueId) as bytes, to be sent to the other ranks (rendezvous.h).
std::vector<uint8_t> nccl_unique_id();
// Joins the NCCL group `unique_id` names as `rank` of `world_size` on CUDA device `device`; blocks
// until every rank has joined (or the timeout passes: the communicator is aborted, an error thrown).
std::unique_ptr<Communicator> make_nccl_communicator(const std::vector<uint8_t>& unique_id, int rank, int world_size,
                                                     int device, const CommOptions& options = {});

}  // namespace kestrel
