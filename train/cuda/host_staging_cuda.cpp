// The CUDA side of AdamW's host offload: pinned staging ring, copy streams and events (the policy is
// described in train/src/host_staging.h).
#include <cuda_runtime.h>

#include <chrono>
#include <vector>

#include "kestrel/cuda/check.h"
#include "kestrel/cuda/context.h"
#include "kestrel/cuda/memory.h"
#include "kestrel/runtime/error.h"
#include "src/host_staging.h"

namespace kestrel::train {
namespace {

using Clock = std::chrono::steady_clock;
double ms_since(Clock::time_point t0) { return std::chrono::duration<double, std::milli>(Clock::now() - t0).count(); }

struct TimingEvent {
  cudaEvent_t e = nullptr;
  TimingEvent() { KESTREL_CUDA_CHECK(cudaEventCreate(&e)); }
  ~TimingEvent() {
    if (e) cudaEventDestroy(e);
  }
  TimingEvent(const TimingEvent&) = delete;
  TimingEvent& operator=(const TimingEvent&) = delete;
};

class CudaStaging final : public AdamW::Staging {
 public:
  CudaStaging(int device, const OptimizerPlacement& p) : device_(device), slot_bytes_(p.staging_slot_bytes) {
    KESTREL_CHECK(p.staging_slots >= 2, "adamw-offload", "staging_slots must be at least 2, got ", p.staging_slots);
    KESTREL_CHECK(p.staging_slot_bytes >= (1 << 20), "adamw-offload", "staging slots must hold at least 1 MiB, got ",
                  p.staging_slot_bytes, " bytes");
    cuda::DeviceGuard g(device);
    for (int s = 0; s < p.staging_slots; ++s) {
      in_.push_back(cuda::pinned_alloc(static_cast<size_t>(slot_bytes_)));
      out_.push_back(cuda::pinned_alloc(static_cast<size_t>(slot_bytes_)));
      in_ev_.push_back(std::make_unique<cuda::Event>());
      out_ev_.push_back(std::make_unique<cuda::Event>());
    }
    out_busy_.assign(in_.size(), false);
  }

  int64_t slot_bytes() const override { return slot_bytes_; }

  void mark_compute_ready(size_t markers) override {
    cuda::DeviceGuard g(device_);
    KESTREL_CUDA_CHECK(cudaEventRecord(ready_.get(), cuda::current_stream(device_)));
    while (markers_.size() < markers) markers_.push_back(std::make_unique<cuda::Event>());
    measured_ = false;  // the compute stream does not stand idle for an asynchronous run
  }
  void record_marker(size_t id) override {
    KESTREL_CHECK(id < markers_.size(), "adamw-offload", "marker ", id, " was not reserved by mark_compute_ready");
    KESTREL_CUDA_CHECK(cudaEventRecord(markers_[id]->get(), cuda::h2d_stream(device_)));
  }
  void compute_wait_marker(size_t id) override {
    cuda::DeviceGuard g(device_);
    KESTREL_CUDA_CHECK(cudaStreamWaitEvent(cuda::current_stream(device_), markers_.at(id)->get(), 0));
  }
  void compute_wait_all() override {
    cuda::DeviceGuard g(device_);
    KESTREL_CUDA_CHECK(cudaStreamWaitEvent(cuda::current_stream(device_), done_.get(), 0));
  }

  void run(const std::vector<Chunk>& chunks, const Update& update, OptimizerStepStats& st,
           const AfterChunk* after_chunk) override {
    const auto t_run = Clock::now();
    cuda::DeviceGuard g(device_);
    cudaStream_t d2h = cuda::d2h_stream(device_), h2d = cuda::h2d_stream(device_);
    const size_t slots = in_.size(), n = chunks.size();
    // Gradients are final and the step's kernels no longer read the parameters once the compute
    // stream gets here; both copy streams start after it (asynchronous runs: mark_compute_ready).
    if (!after_chunk) {
      cudaStream_t comp = cuda::current_stream(device_);
      KESTREL_CUDA_CHECK(cudaEventRecord(ready_.get(), comp));
      KESTREL_CUDA_CHECK(cudaEventRecord(idle_begin_.e, comp));
    }
    KESTREL_CUDA_CHECK(cudaStreamWaitEvent(d2h, ready_.get(), 0));
    KESTREL_CUDA_CHECK(cudaStreamWaitEvent(h2d, ready_.get(), 0));
    // Gradients already in host memory (optimizer.gradients "host": GradientStream) are read where
    // they are: no D2H copy, no slot.
    std::vector<char> on_host(n, 0);
    for (size_t k = 0; k < n; ++k) {
      cudaPointerAttributes a{};
      KESTREL_CUDA_CHECK(cudaPointerGetAttributes(&a, chunks[k].grad));
      on_host[k] = a.type == cudaMemoryTypeHost || a.type == cudaMemoryTypeUnregistered;
    }
    auto fetch = [&](size_t k) {
      const size_t s = k % slots;
      KESTREL_CHECK(chunks[k].grad_bytes <= slot_bytes_ && chunks[k].param_bytes <= slot_bytes_, "adamw-offload",
                    "chunk of ", chunks[k].grad_bytes, " bytes exceeds the staging slot (", slot_bytes_, ")");
      if (on_host[k]) return;
      KESTREL_CUDA_CHECK(cudaMemcpyAsync(in_[s].data(), chunks[k].grad, static_cast<size_t>(chunks[k].grad_bytes),
                                         cudaMemcpyDeviceToHost, d2h));
      KESTREL_CUDA_CHECK(cudaEventRecord(in_ev_[s]->get(), d2h));
      st.d2h_bytes += chunks[k].grad_bytes;
    };
    for (size_t k = 0; k < n && k < slots; ++k) fetch(k);
    // out_busy_ persists across calls: with optimizer.step_in_backward run() comes once per parameter,
    // right after the last one, whose H2D copies may still be reading the slots.
    for (size_t k = 0; k < n; ++k) {
      const size_t s = k % slots;
      auto t_wait = Clock::now();
      if (!on_host[k]) KESTREL_CUDA_CHECK(cudaEventSynchronize(in_ev_[s]->get()));
      if (out_busy_[s]) KESTREL_CUDA_CHECK(cudaEventSynchronize(out_ev_[s]->get()));
      st.copy_wait_ms += ms_since(t_wait);
      auto t_update = Clock::now();
      update(k, on_host[k] ? chunks[k].grad : in_[s].data(), out_[s].data());
      st.update_ms += ms_since(t_update);
      KESTREL_CUDA_CHECK(cudaMemcpyAsync(chunks[k].param, out_[s].data(), static_cast<size_t>(chunks[k].param_bytes),
                                         cudaMemcpyHostToDevice, h2d));
      KESTREL_CUDA_CHECK(cudaEventRecord(out_ev_[s]->get(), h2d));
      st.h2d_bytes += chunks[k].param_bytes;
      out_busy_[s] = true;
      if (after_chunk) (*after_chunk)(k);
      if (k + slots < n) fetch(k + slots);  // the slot's gradient buffer was just consumed
    }
    KESTREL_CUDA_CHECK(cudaEventRecord(done_.get(), h2d));
    if (!after_chunk) {
      cudaStream_t comp = cuda::current_stream(device_);
      KESTREL_CUDA_CHECK(cudaStreamWaitEvent(comp, done_.get(), 0));
      KESTREL_CUDA_CHECK(cudaEventRecord(idle_end_.e, comp));
      measured_ = true;
    }
    st.host_ms += ms_since(t_run);
  }

  double last_gpu_idle_ms() const override {
    if (!measured_) return -1;
    float ms = -1;
    if (cudaEventElapsedTime(&ms, idle_begin_.e, idle_end_.e) != cudaSuccess) {
      (void)cudaGetLastError();  // not complete yet: no figure
      return -1;
    }
    return ms;
  }

 private:
  int device_;
  int64_t slot_bytes_;
  std::vector<cuda::PinnedBuffer> in_, out_;
  std::vector<std::unique_ptr<cuda::Event>> in_ev_, out_ev_;
  std::vector<bool> out_busy_;  // slot s has an H2D copy from out_[s] enqueued (wait on out_ev_[s])
  std::vector<std::unique_ptr<cuda::Event>> markers_;  // asynchronous runs: one per parameter
  cuda::Event ready_, done_;
  TimingEvent idle_begin_, idle_end_;
  bool measured_ = false;
};

}  // namespace

std::unique_ptr<AdamW::Staging> make_cuda_staging(int device, const OptimizerPlacement& placement) {
  return std::make_unique<CudaStaging>(device, placement);
}

}  // namespace kestrel::train
