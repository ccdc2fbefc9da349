// Private: loading overlapped with compute. A background thread prepares the next micro-batches
// (rendering / decoding images, tokenizing, packing: Task::prepare) while the current step runs;
// on CUDA it also stages each batch in pinned host memory (the runtime's pinned pool), and the
// main thread copies it to the device on the H2D stream, ordered against the compute stream with
// events, one batch ahead, so the copy of batch i+1 runs under the compute of batch i.
//
// Policy: the prefetcher is a cache of a pure function (batch = f(index)); it never decides what
// is trained. The trainer asks for indices in order and keeps the data position itself (the index
// of the next batch the model consumes), which is what checkpoints store; a jump to another index
// (resume, a change of plan) drops what was prepared and restarts there. Up to `depth` batches are
// ready or in preparation at once, on `threads` threads (each prepares whole batches; indices are
// handed out in order and consumed in order). depth = 0 prepares inline on the caller's thread.
#pragma once

#include <condition_variable>
#include <map>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "kestrel/train/host_batch.h"

namespace kestrel::train {

class BatchPrefetcher {
 public:
  using Prepare = std::function<HostBatch(uint64_t index)>;
  BatchPrefetcher(Prepare prepare, Device device, int depth, int threads = 1);
  ~BatchPrefetcher();
  BatchPrefetcher(const BatchPrefetcher&) = delete;
  BatchPrefetcher& operator=(const BatchPrefetcher&) = delete;

  struct Batch {
    std::shared_ptr<const HostBatch> host;  // the metadata (and, on the CPU, the bytes the arrays view)
    std::vector<Tensor> arrays;             // on the device, ready for the current stream
  };
  // Micro-batch `index`, then (CUDA) starts the copy of index + 1 when it is already prepared.
  Batch get(uint64_t index);

  struct Stats {
    int64_t prepared = 0, waited = 0;  // batches prepared; gets that had to wait for the thread
    double wait_ms = 0;                // time gets spent waiting
  };
  Stats stats() const;

 private:
  struct Staged;    // a prepared batch (+ pinned staging on CUDA)
  struct Upload;    // device copies in flight on the H2D stream
  std::shared_ptr<Staged> take(uint64_t index, bool wait);  // nullptr when !wait and not ready
  std::shared_ptr<Staged> stage(HostBatch b) const;
  Batch to_device(const std::shared_ptr<Staged>& s);
  void worker();
  void restart_locked(uint64_t index);

  Prepare prepare_;
  Device device_;
  int depth_, num_threads_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::map<uint64_t, std::shared_ptr<Staged>> done_;  // prepared, by index
  std::map<uint64_t, std::exception_ptr> errors_;     // failed, by index
  uint64_t base_ = 0;        // the index the consumer takes next
  uint64_t claim_ = 0;       // the index the next free thread prepares
  uint64_t generation_ = 0;  // bumped by a restart; stale work is dropped
  bool stop_ = false;
  Stats stats_;
  std::unique_ptr<Upload> pending_;  // the upload started for the next index
  std::vector<std::thread> threads_;
};

}  // namespace kestrel::train
