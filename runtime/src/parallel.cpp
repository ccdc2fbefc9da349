#include "kestrel/runtime/parallel.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace kestrel {
namespace {

thread_local bool t_in_parallel = false;

class Pool {
 public:
  explicit Pool(int n) { resize(n); }
  ~Pool() { stop(); }

  int size() const { return static_cast<int>(workers_.size()) + 1; }

  void resize(int n) {
    stop();
    stopping_ = false;
    for (int i = 0; i < n - 1; ++i) workers_.emplace_back([this] { worker(); });
  }

  void run(int64_t nchunks, const std::function<void(int64_t)>& chunk) {
    std::unique_lock<std::mutex> lock(mu_);
    job_ = &chunk;
    next_ = 0;
    total_ = nchunks;
    pending_ = nchunks;
    error_ = nullptr;
    ++generation_;
    cv_.notify_all();
    lock.unlock();
    drain();
    lock.lock();
    done_cv_.wait(lock, [&] { return pending_ == 0; });
    job_ = nullptr;
    if (error_) std::rethrow_exception(error_);
  }

 private:
  void drain() {
    t_in_parallel = true;
    for (;;) {
      int64_t i = next_.fetch_add(1);
      if (i >= total_) break;
      try {
        (*job_)(i);
      } catch (...) {
        std::lock_guard<std::mutex> g(mu_);
        if (!error_) error_ = std::current_exception();
      }
      if (pending_.fetch_sub(1) == 1) {
        std::lock_guard<std::mutex> g(mu_);
        done_cv_.notify_all();
      }
    }
    t_in_parallel = false;
  }

  void worker() {
    uint64_t seen = 0;
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stopping_ || (generation_ != seen && job_ != nullptr); });
        if (stopping_) return;
        seen = generation_;
      }
      drain();
    }
  }

  void stop() {
    {
      std::lock_guard<std::mutex> g(mu_);
      stopping_ = true;
      cv_.notify_all();
    }
    for (auto& t : workers_) t.join();
    workers_.clear();
  }

  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable cv_, done_cv_;
  const std::function<void(int64_t)>* job_ = nullptr;
  std::atomic<int64_t> next_{0}, pending_{0};
  int64_t total_ = 0;
  uint64_t generation_ = 0;
  bool stopping_ = false;
  std::exception_ptr error_;
};

int default_threads() {
  if (const char* e = std::getenv("KESTREL_NUM_THREADS")) {
    int n = std::atoi(e);
    if (n > 0) return n;
  }
  return std::max(1u, std::thread::hardware_concurrency());
}

std::mutex g_pool_mu;
Pool& pool() {
  static Pool p(default_threads());
  return p;
}

}  // namespace

int num_cpu_threads() { return pool().size(); }

void set_num_cpu_threads(int n) {
  std::lock_guard<std::mutex> g(g_pool_mu);
  pool().resize(n > 0 ? n : default_threads());
}

void parallel_for(int64_t begin, int64_t end, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
  if (end <= begin) return;
  int64_t n = end - begin;
  grain = std::max<int64_t>(grain, 1);
  int threads = num_cpu_threads();
  if (t_in_parallel || threads == 1 || n <= grain) {
    fn(begin, end);
    return;
  }
  int64_t nchunks = std::min<int64_t>((n + grain - 1) / grain, threads * 4);
  int64_t step = (n + nchunks - 1) / nchunks;
  nchunks = (n + step - 1) / step;
  std::function<void(int64_t)> chunk = [&](int64_t i) {
    int64_t b = begin + i * step;
    fn(b, std::min(end, b + step));
  };
  std::lock_guard<std::mutex> g(g_pool_mu);
  pool().run(nchunks, chunk);
}

}  // namespace kestrel
