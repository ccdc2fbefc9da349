// Private: the copy pipeline behind AdamW's host offload. A step hands over a list of chunks (a
// contiguous piece of one parameter and of its gradient on the device); the staging runs
// update(k, host_grad, host_out) once per chunk, in order, with the chunk's gradient readable at
// host_grad and the updated parameter to be written to host_out, and makes the new parameters
// visible to the device's compute stream before run() returns.
//
// CUDA (train/cuda/host_staging_cuda.cpp): a ring of `slots` pinned buffer pairs. The D2H and H2D
// streams first wait (on the device) for the compute stream to finish backward; up to `slots`
// gradient chunks are in flight on the D2H stream ahead of the CPU; each updated chunk goes back on
// the H2D stream at once; the compute stream finally waits for the last H2D copy by an event. The
// host blocks only on the chunk it is about to update (and on a slot whose previous H2D copy has not
// finished). CPU devices: the pointers are the tensors' own memory, no copies.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "kestrel/runtime/device.h"
#include "kestrel/train/optimizer.h"

namespace kestrel::train {

class AdamW::Staging {
 public:
  struct Chunk {
    const void* grad;  // on the device, or already in host memory (then read in place, no copy)
    int64_t grad_bytes;
    void* param;       // on the device
    int64_t param_bytes;
  };
  using Update = std::function<void(size_t chunk, const void* host_grad, void* host_out)>;
  using AfterChunk = std::function<void(size_t chunk)>;

  virtual ~Staging() = default;
  // after_chunk == nullptr (synchronous use): run() records where the compute stream stands, starts
  // the copies after that point and makes the compute stream wait for the last one. Otherwise
  // (AdamW::step_async: run() on a worker thread) mark_compute_ready() was called first on the
  // compute stream's thread, run() touches no compute stream, and after_chunk(k) is called once
  // chunk k's parameter copy is enqueued; it may call record_marker(id), which marks the copies
  // enqueued so far. compute_wait_marker(id) (on the compute thread, after the marker was recorded)
  // orders the compute stream after them; compute_wait_all() after every copy of the run.
  virtual void run(const std::vector<Chunk>& chunks, const Update& update, OptimizerStepStats& stats,
                   const AfterChunk* after_chunk = nullptr) = 0;
  virtual void mark_compute_ready(size_t markers) {}
  virtual void record_marker(size_t id) {}
  virtual void compute_wait_marker(size_t id) {}
  virtual void compute_wait_all() {}
  virtual double last_gpu_idle_ms() const { return -1; }
  // Largest chunk (bytes per direction) run() accepts.
  virtual int64_t slot_bytes() const = 0;

  static std::unique_ptr<Staging> create(Device device, const OptimizerPlacement& placement);
};

#if KESTREL_WITH_CUDA
std::unique_ptr<AdamW::Staging> make_cuda_staging(int device, const OptimizerPlacement& placement);
#endif

}  // namespace kestrel::train
