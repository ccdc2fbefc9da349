// The background preparation thread and the H2D staging of batch_prefetcher.h.
#include "batch_prefetcher.h"

#include <algorithm>
#include <chrono>
#include <cstring>

#include "kestrel/runtime/error.h"
#include "kestrel/runtime/memory_trace.h"
#if KESTREL_WITH_CUDA
#include "kestrel/cuda/check.h"
#include "kestrel/cuda/context.h"
#include "kestrel/cuda/memory.h"
#endif

namespace kestrel::train {

namespace {
size_t align_up(size_t n) { return (n + 255) / 256 * 256; }

}  // namespace

struct BatchPrefetcher::Staged {
  std::shared_ptr<HostBatch> host;
#if KESTREL_WITH_CUDA
  cuda::PinnedBuffer pinned;   // every array, 256-byte aligned, at offsets[i]
  std::vector<size_t> offsets;
#endif
};

struct BatchPrefetcher::Upload {
  uint64_t index = 0;
  std::shared_ptr<Staged> staged;
  std::vector<Tensor> arrays;  // device tensors (blocks of the compute stream), being filled on H2D
#if KESTREL_WITH_CUDA
  cuda::Event compute_ready, copied;
#endif
};

BatchPrefetcher::BatchPrefetcher(Prepare prepare, Device device, int depth, int threads)
    : prepare_(std::move(prepare)), device_(device), depth_(depth), num_threads_(std::max(1, std::min(threads, depth))) {
  KESTREL_CHECK(depth_ >= 0, "prefetch", "prefetch depth must be >= 0, got ", depth_);
  KESTREL_CHECK(threads >= 1, "prefetch", "prefetch threads must be >= 1, got ", threads);
}

BatchPrefetcher::~BatchPrefetcher() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (std::thread& t : threads_) t.join();
}

std::shared_ptr<BatchPrefetcher::Staged> BatchPrefetcher::stage(HostBatch b) const {
  auto s = std::make_shared<Staged>();
  s->host = std::make_shared<HostBatch>(std::move(b));
#if KESTREL_WITH_CUDA
  if (device_.is_cuda()) {
    size_t total = 0;
    for (const HostArray& a : s->host->arrays) {
      s->offsets.push_back(total);
      total += align_up(a.bytes.size());
    }
    s->pinned = cuda::pinned_alloc(std::max<size_t>(total, 256));
    for (size_t i = 0; i < s->host->arrays.size(); ++i) {
      const HostArray& a = s->host->arrays[i];
      if (!a.bytes.empty()) std::memcpy(static_cast<char*>(s->pinned.data()) + s->offsets[i], a.bytes.data(), a.bytes.size());
    }
    // The pinned copy is what travels; drop the pageable bytes.
    for (HostArray& a : s->host->arrays) std::vector<std::byte>().swap(a.bytes);
  }
#endif
  return s;
}

void BatchPrefetcher::worker() {
#if KESTREL_WITH_CUDA
  std::unique_ptr<cuda::DeviceGuard> guard;
  if (device_.is_cuda()) guard = std::make_unique<cuda::DeviceGuard>(device_.index);
#endif
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    // Claim the next index while fewer than `depth` batches are ready or in preparation.
    cv_.wait(lock, [&] { return stop_ || claim_ < base_ + static_cast<uint64_t>(depth_); });
    if (stop_) return;
    const uint64_t index = claim_++, gen = generation_;
    lock.unlock();
    std::shared_ptr<Staged> s;
    std::exception_ptr err;
    try {
      HostBatch b = prepare_(index);
      b.index = index;
      s = stage(std::move(b));
    } catch (...) {
      err = std::current_exception();
    }
    lock.lock();
    if (gen != generation_) continue;  // restarted meanwhile: the work is for an index nobody wants
    if (err) {
      errors_[index] = err;
    } else {
      done_[index] = std::move(s);
      ++stats_.prepared;
    }
    cv_.notify_all();
  }
}

void BatchPrefetcher::restart_locked(uint64_t index) {
  done_.clear();
  errors_.clear();
  base_ = claim_ = index;
  ++generation_;
  cv_.notify_all();
}

std::shared_ptr<BatchPrefetcher::Staged> BatchPrefetcher::take(uint64_t index, bool wait) {
  if (depth_ == 0) {
    if (!wait) return nullptr;
    HostBatch b = prepare_(index);
    b.index = index;
    return stage(std::move(b));
  }
  std::unique_lock<std::mutex> lock(mu_);
  if (threads_.empty()) {
    base_ = claim_ = index;
    for (int i = 0; i < num_threads_; ++i) threads_.emplace_back([this] { worker(); });
  }
  if (index != base_) {  // a jump: drop everything and restart at `index`
    if (!wait) return nullptr;
    restart_locked(index);
  }
  auto ready = [&] { return done_.count(index) > 0 || errors_.count(index) > 0; };
  if (!ready()) {
    if (!wait) return nullptr;
    auto t0 = std::chrono::steady_clock::now();
    cv_.wait(lock, ready);
    ++stats_.waited;
    stats_.wait_ms += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  }
  if (auto e = errors_.find(index); e != errors_.end()) {
    // Rethrow here; the next get(index) prepares it again.
    std::exception_ptr err = e->second;
    restart_locked(index);
    std::rethrow_exception(err);
  }
  auto it = done_.find(index);
  std::shared_ptr<Staged> s = std::move(it->second);
  done_.erase(it);
  base_ = index + 1;
  cv_.notify_all();
  return s;
}

BatchPrefetcher::Batch BatchPrefetcher::to_device(const std::shared_ptr<Staged>& s) {
  Batch out;
  out.host = s->host;
  if (device_.is_cpu()) {
    // The arrays view the host bytes; the tensors keep the host batch alive.
    std::shared_ptr<void> keep = s->host;
    for (const HostArray& a : s->host->arrays)
      out.arrays.push_back(Tensor::from_blob(const_cast<std::byte*>(a.bytes.data()), a.shape, a.dtype, device_, keep));
    return out;
  }
#if KESTREL_WITH_CUDA
  auto up = std::make_unique<Upload>();
  up->index = s->host->index;
  up->staged = s;
  {
    TagScope tag(MemoryTag::Activation);
    MemoryLabelScope label("data");
    for (const HostArray& a : s->host->arrays) up->arrays.push_back(Tensor::empty(a.shape, a.dtype, device_));
  }
  cuda::DeviceGuard g(device_.index);
  cudaStream_t compute = cuda::current_stream(device_.index), h2d = cuda::h2d_stream(device_.index);
  // The blocks may have been freed by compute-stream work still in flight: copy after it.
  KESTREL_CUDA_CHECK(cudaEventRecord(up->compute_ready.get(), compute));
  KESTREL_CUDA_CHECK(cudaStreamWaitEvent(h2d, up->compute_ready.get(), 0));
  for (size_t i = 0; i < up->arrays.size(); ++i) {
    const size_t n = up->arrays[i].nbytes();
    if (n > 0)
      KESTREL_CUDA_CHECK(cudaMemcpyAsync(up->arrays[i].data_ptr(), static_cast<char*>(s->pinned.data()) + s->offsets[i], n,
                                         cudaMemcpyHostToDevice, h2d));
  }
  KESTREL_CUDA_CHECK(cudaEventRecord(up->copied.get(), h2d));
  s->pinned.record(h2d);  // back to the pool once the copies are done
  pending_ = std::move(up);
  return out;  // arrays are handed over by get() once the compute stream waits for the copy
#else
  KESTREL_CHECK(false, "prefetch", "device ", device_.str(), " needs a CUDA build");
  return out;
#endif
}

BatchPrefetcher::Batch BatchPrefetcher::get(uint64_t index) {
  Batch out;
  if (pending_ && pending_->index == index) {
    out.host = pending_->staged->host;
  } else {
    pending_.reset();
    out = to_device(take(index, /*wait=*/true));
    if (device_.is_cpu()) return out;
  }
#if KESTREL_WITH_CUDA
  // The compute stream waits for the copy; then the next batch's copy starts under this step's compute.
  KESTREL_CUDA_CHECK(cudaStreamWaitEvent(cuda::current_stream(device_.index), pending_->copied.get(), 0));
  out.arrays = std::move(pending_->arrays);
  pending_.reset();
  if (depth_ > 0)
    if (std::shared_ptr<Staged> next = take(index + 1, /*wait=*/false)) to_device(next);
#endif
  return out;
}

BatchPrefetcher::Stats BatchPrefetcher::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

}  // namespace kestrel::train
