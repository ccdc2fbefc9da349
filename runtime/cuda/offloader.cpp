// Moving device tensors to the pinned host pool and back:
// - the recompute offloader (kestrel/runtime/offload.h, installed for each device): right after a
//   region's forward its saved input is copied to pinned memory on the D2H stream, ordered after
//   the compute stream by an event; the device block is handed back to the allocator at once with
//   record_stream(D2H), so it returns to the cache when the copy has completed and the compute stream
//   never waits. prefetch() copies it back on the H2D stream; get() makes the compute stream wait
//   on that copy's event only.
//   Back-pressure: at most memory.offload_inflight (KESTREL_OFFLOAD_INFLIGHT_MB, default 256 MiB) of offload copies, or two
//   copies whatever their size, may be in flight per device. Past that the host waits for the
//   oldest copy, so the device blocks return to the cache before new activations are allocated:
//   when compute outruns the copy engine the peak stays bounded (the step slows instead of the
//   footprint growing).
// - spillable tensors: the budget ladder's spill step copies them out synchronously and frees them.
#include <cuda_runtime.h>

#include <atomic>
#include <cstdlib>
#include <deque>
#include <list>
#include <mutex>

#include "context.h"
#include "kestrel/cuda/check.h"
#include "kestrel/cuda/context.h"
#include "kestrel/cuda/memory.h"
#include "kestrel/runtime/memory_trace.h"
#include "kestrel/runtime/offload.h"

namespace kestrel::cuda {
namespace {

struct Counters {
  std::atomic<int64_t> offloaded{0}, restored{0}, count{0};
};
Counters g_counters[64];

// Offload copies in flight on one device, oldest first.
struct InFlight {
  std::mutex mu;
  std::deque<std::pair<std::shared_ptr<Event>, int64_t>> copies;
  int64_t bytes = 0;
};
InFlight* const g_inflight = new InFlight[64];  // never destroyed: its events outlive static destructors

// The device's bound (MemoryConfig::offload_inflight, pushed into its context by configure_memory).
int64_t inflight_limit(int device) { return Context::get(device).offload_inflight(); }

// Records a new copy and waits (host side) for the oldest ones while too many bytes are in flight.
void throttle(int device, std::shared_ptr<Event> done, int64_t bytes) {
  InFlight& f = g_inflight[device];
  std::lock_guard<std::mutex> lock(f.mu);
  f.copies.emplace_back(std::move(done), bytes);
  f.bytes += bytes;
  while (!f.copies.empty()) {
    auto& [ev, b] = f.copies.front();
    cudaError_t q = cudaEventQuery(ev->get());
    if (q == cudaErrorNotReady) {
      // Two copies may always be in flight, so a region input larger than the limit does not stall
      // the host (and with it the compute stream) on its own copy.
      if (f.bytes <= inflight_limit(device) || f.copies.size() <= 2) break;
      KESTREL_CUDA_CHECK(cudaEventSynchronize(ev->get()));
    } else {
      KESTREL_CUDA_CHECK(q);
    }
    f.bytes -= b;
    f.copies.pop_front();
  }
}

class CudaOffloadHandle final : public OffloadHandle {
 public:
  explicit CudaOffloadHandle(const Tensor& t) : device_(t.device().index), shape_(t.shape()), dtype_(t.dtype()) {
    DeviceGuard g(device_);
    Context& c = Context::get(device_);
    Tensor src = t.contiguous();
    bytes_ = src.nbytes();
    host_ = pinned_alloc(bytes_);
    cudaStream_t compute = current_stream(device_);
    stream_wait(c.d2h(), compute);  // the producer of t has run
    KESTREL_CUDA_CHECK(cudaMemcpyAsync(host_.data(), src.data_ptr(), bytes_, cudaMemcpyDeviceToHost, c.d2h()));
    KESTREL_CUDA_CHECK(cudaEventRecord(d2h_done_->get(), c.d2h()));
    // The block may return to the cache only after the copy has read it.
    allocator_for(t.device()).record_stream(src.storage()->allocation(), c.d2h());
    src = Tensor();
    throttle(device_, d2h_done_, static_cast<int64_t>(bytes_));
    memory_trace(t.device()).on_spill(static_cast<int64_t>(bytes_), false);
    g_counters[device_].offloaded += static_cast<int64_t>(bytes_);
    g_counters[device_].count += 1;
  }

  void prefetch() override {
    if (restored_.defined()) return;
    DeviceGuard g(device_);
    Context& c = Context::get(device_);
    cudaStream_t compute = current_stream(device_);
    {
      TagScope tag(MemoryTag::Checkpoint);
      restored_ = Tensor::empty(shape_, dtype_, Device::cuda(device_));  // a block of the compute stream
    }
    stream_wait(c.h2d(), compute);  // its previous users on the compute stream are done
    KESTREL_CUDA_CHECK(cudaStreamWaitEvent(c.h2d(), d2h_done_->get(), 0));
    KESTREL_CUDA_CHECK(cudaMemcpyAsync(restored_.data_ptr(), host_.data(), bytes_, cudaMemcpyHostToDevice, c.h2d()));
    KESTREL_CUDA_CHECK(cudaEventRecord(h2d_done_.get(), c.h2d()));
    host_.record(c.h2d());  // the pinned buffer is reusable once this copy is done
    memory_trace(Device::cuda(device_)).on_prefetch(static_cast<int64_t>(bytes_));
    g_counters[device_].restored += static_cast<int64_t>(bytes_);
  }

  Tensor get() override {
    prefetch();
    KESTREL_CUDA_CHECK(cudaStreamWaitEvent(current_stream(device_), h2d_done_.get(), 0));
    host_ = PinnedBuffer();
    Tensor out = restored_;
    restored_ = Tensor();
    return out;
  }

 private:
  int device_;
  Shape shape_;
  DType dtype_;
  size_t bytes_ = 0;
  PinnedBuffer host_;
  std::shared_ptr<Event> d2h_done_ = std::make_shared<Event>();
  Event h2d_done_;
  Tensor restored_;
};

// ---- spillable tensors ----
class SpillableImpl final : public SpillableTensor {
 public:
  explicit SpillableImpl(Tensor t) : t_(std::move(t)), device_(t_.device().index), shape_(t_.shape()), dtype_(t_.dtype()) {}
  Tensor get() override {
    std::lock_guard<std::mutex> lock(mu_);
    if (!spilled_) return t_;
    Tensor out = Tensor::empty(shape_, dtype_, Device::cuda(device_));
    cudaStream_t s = current_stream(device_);
    KESTREL_CUDA_CHECK(cudaMemcpyAsync(out.data_ptr(), host_.data(), out.nbytes(), cudaMemcpyHostToDevice, s));
    host_.record(s);
    host_ = PinnedBuffer();
    memory_trace(Device::cuda(device_)).on_spill(static_cast<int64_t>(out.nbytes()), true);
    t_ = out;
    spilled_ = false;
    return t_;
  }
  bool spilled() const override { return spilled_; }
  // Moves the tensor to pinned memory if nothing else holds its storage; bytes freed.
  int64_t try_spill() {
    std::unique_lock<std::mutex> lock(mu_, std::try_to_lock);
    if (!lock.owns_lock() || spilled_ || t_.impl_ptr().use_count() != 1 || t_.storage().use_count() != 1) return 0;
    Context& c = Context::get(device_);
    DeviceGuard g(device_);
    size_t bytes = t_.nbytes();
    host_ = pinned_alloc(bytes);
    stream_wait(c.d2h(), current_stream(device_));
    KESTREL_CUDA_CHECK(cudaMemcpyAsync(host_.data(), t_.data_ptr(), bytes, cudaMemcpyDeviceToHost, c.d2h()));
    KESTREL_CUDA_CHECK(cudaStreamSynchronize(c.d2h()));
    memory_trace(Device::cuda(device_)).on_spill(static_cast<int64_t>(bytes), false);
    int64_t freed = static_cast<int64_t>(t_.storage()->bytes());
    t_ = Tensor();
    spilled_ = true;
    return freed;
  }
  int device() const { return device_; }

 private:
  std::mutex mu_;
  Tensor t_;
  int device_;
  Shape shape_;
  DType dtype_;
  PinnedBuffer host_;
  bool spilled_ = false;
};

std::mutex g_spill_mu;
std::list<std::weak_ptr<SpillableImpl>> g_spillables;  // oldest first

}  // namespace

std::shared_ptr<SpillableTensor> make_spillable(Tensor t) {
  KESTREL_CHECK(t.defined() && t.device().is_cuda() && t.is_contiguous(), "spill",
                "make_spillable needs a contiguous CUDA tensor, got ", t.defined() ? t.str() : "undefined");
  auto s = std::make_shared<SpillableImpl>(std::move(t));
  std::lock_guard<std::mutex> lock(g_spill_mu);
  g_spillables.push_back(s);
  return s;
}

int64_t spill_for(int device, int64_t bytes_needed) {
  std::lock_guard<std::mutex> lock(g_spill_mu);
  int64_t freed = 0;
  for (auto it = g_spillables.begin(); it != g_spillables.end() && freed < bytes_needed;) {
    auto s = it->lock();
    if (!s) {
      it = g_spillables.erase(it);
      continue;
    }
    if (s->device() == device) freed += s->try_spill();
    ++it;
  }
  return freed;
}

void install_offloader(int device) {
  set_offloader(Device::cuda(device), [](const Tensor& t) -> std::unique_ptr<OffloadHandle> {
    return std::make_unique<CudaOffloadHandle>(t);
  });
}

OffloadStats offload_stats(int device) {
  return {g_counters[device].offloaded.load(), g_counters[device].restored.load(), g_counters[device].count.load()};
}

}  // namespace kestrel::cuda
