// PinnedHostPool: cached page-locked host memory (cudaHostAlloc) with its own limit, used for
// spills, the recompute offload and staging. Sizes round up to 64 KiB; a cached buffer is reused
// when it is at most 1.25x the request. A buffer returned while copies recorded on it are still in
// flight waits (event) before it can be handed out again. Over the limit, cached buffers are freed
// first; a request that still does not fit throws.
#include <cuda_runtime.h>

#include <map>
#include <mutex>
#include <vector>

#include "kestrel/cuda/check.h"
#include "kestrel/cuda/memory.h"
#include "kestrel/runtime/memory_budget.h"
#include "kestrel/runtime/memory_config.h"

namespace kestrel::cuda {
namespace {

struct Pool {
  std::mutex mu;
  std::multimap<size_t, void*> free;  // size -> buffer
  struct Pending {
    void* ptr;
    size_t size;
    cudaEvent_t event;
  };
  std::vector<Pending> pending;
  PinnedStats st;
  Pool() { st.limit = default_memory_config().pinned_limit; }  // a configured device sets its own
  void reap(bool wait) {
    std::vector<Pending> still;
    for (Pending& p : pending) {
      if (wait) KESTREL_CUDA_CHECK_NOTHROW(cudaEventSynchronize(p.event));
      if (!wait && cudaEventQuery(p.event) == cudaErrorNotReady) {
        still.push_back(p);
        continue;
      }
      cudaGetLastError();
      KESTREL_CUDA_CHECK_NOTHROW(cudaEventDestroy(p.event));
      free.emplace(p.size, p.ptr);
    }
    pending = std::move(still);
  }
  int64_t drop_cached() {
    int64_t n = 0;
    for (auto& [size, ptr] : free) {
      KESTREL_CUDA_CHECK_NOTHROW(cudaFreeHost(ptr));
      n += static_cast<int64_t>(size);
    }
    free.clear();
    st.held -= n;
    return n;
  }
};
Pool& pool() {
  static Pool* p = new Pool;  // never destroyed: buffers may be returned during static destruction
  return *p;
}

}  // namespace

PinnedBuffer pinned_alloc(size_t bytes) {
  Pool& p = pool();
  size_t size = (std::max<size_t>(bytes, 1) + 65535) / 65536 * 65536;
  std::lock_guard<std::mutex> lock(p.mu);
  p.reap(false);
  PinnedBuffer out;
  auto it = p.free.lower_bound(size);
  if (it != p.free.end() && it->first <= size + size / 4) {
    out.ptr_ = it->second;
    out.size_ = it->first;
    p.free.erase(it);
    p.st.num_hits += 1;
  } else {
    if (p.st.held + static_cast<int64_t>(size) > p.st.limit) {
      p.reap(true);
      p.drop_cached();
    }
    KESTREL_CHECK(p.st.held + static_cast<int64_t>(size) <= p.st.limit, "pinned-pool", "request of ",
                  format_bytes(static_cast<int64_t>(size)), " would exceed the pinned host pool limit ",
                  format_bytes(p.st.limit), " (", format_bytes(p.st.in_use),
                  " in use); raise it with memory.pinned_limit, KESTREL_PINNED_LIMIT or set_pinned_pool_limit");
    void* ptr = nullptr;
    KESTREL_CUDA_CHECK(cudaHostAlloc(&ptr, size, cudaHostAllocPortable));
    out.ptr_ = ptr;
    out.size_ = size;
    p.st.held += static_cast<int64_t>(size);
    p.st.peak_held = std::max(p.st.peak_held, p.st.held);
    p.st.num_host_allocs += 1;
  }
  p.st.in_use += static_cast<int64_t>(out.size_);
  return out;
}

PinnedBuffer::~PinnedBuffer() {
  if (!ptr_) return;
  Pool& p = pool();
  std::lock_guard<std::mutex> lock(p.mu);
  p.st.in_use -= static_cast<int64_t>(size_);
  if (event_)
    p.pending.push_back({ptr_, size_, static_cast<cudaEvent_t>(event_)});
  else
    p.free.emplace(size_, ptr_);
}

PinnedBuffer::PinnedBuffer(PinnedBuffer&& o) noexcept : ptr_(o.ptr_), size_(o.size_), event_(o.event_) {
  o.ptr_ = nullptr;
  o.event_ = nullptr;
}
PinnedBuffer& PinnedBuffer::operator=(PinnedBuffer&& o) noexcept {
  if (this != &o) {
    this->~PinnedBuffer();
    ptr_ = o.ptr_;
    size_ = o.size_;
    event_ = o.event_;
    o.ptr_ = nullptr;
    o.event_ = nullptr;
  }
  return *this;
}

void PinnedBuffer::record(StreamHandle stream) {
  if (!event_) {
    cudaEvent_t e;
    KESTREL_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    event_ = e;
  }
  KESTREL_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(event_), static_cast<cudaStream_t>(stream)));
}

void set_pinned_pool_limit(int64_t bytes) {
  std::lock_guard<std::mutex> lock(pool().mu);
  pool().st.limit = bytes;
}
PinnedStats pinned_stats() {
  std::lock_guard<std::mutex> lock(pool().mu);
  return pool().st;
}
int64_t pinned_release_cached() {
  std::lock_guard<std::mutex> lock(pool().mu);
  pool().reap(true);
  return pool().drop_cached();
}

}  // namespace kestrel::cuda
