#include "kestrel/runtime/parallel.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "kestrel/runtime/memory_config.h"  // default_cpu_threads (KESTREL_NUM_THREADS)

namespace kestrel {
namespace {

thread_local bool t_in_parallel = false;

// A fork-join pool. Each parallel_for is one Job with its own chunk counter, total and pending
// count, handed to the workers under the pool mutex as a shared_ptr: a worker that is still leaving
// an earlier job only ever touches that job's counters (its next chunk index is past that job's
// total), so a new job can never see chunk numbers or pending counts of an old one. The caller
// returns once every chunk of its job has run; the job's function is only called for chunk indices
// below the total, which exist only while the caller waits.
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
    auto job = std::make_shared<Job>(chunk, nchunks);
    {
      std::lock_guard<std::mutex> lock(mu_);
      current_ = job;
      ++generation_;
    }
    cv_.notify_all();
    drain(*job);
    {
      std::unique_lock<std::mutex> lock(job->mu);
      job->done_cv.wait(lock, [&] { return job->pending.load() == 0; });
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (current_ == job) current_.reset();
    }
    if (job->error) std::rethrow_exception(job->error);
  }

 private:
  struct Job {
    Job(const std::function<void(int64_t)>& f, int64_t n) : fn(f), total(n), pending(n) {}
    const std::function<void(int64_t)>& fn;
    const int64_t total;
    std::atomic<int64_t> next{0}, pending;
    std::mutex mu;  // guards error and the done signal
    std::condition_variable done_cv;
    std::exception_ptr error;
  };

  static void drain(Job& job) {
    const bool was_in_parallel = t_in_parallel;
    t_in_parallel = true;
    for (;;) {
      const int64_t i = job.next.fetch_add(1);
      if (i >= job.total) break;
      try {
        job.fn(i);
      } catch (...) {
        std::lock_guard<std::mutex> g(job.mu);
        if (!job.error) job.error = std::current_exception();
      }
      if (job.pending.fetch_sub(1) == 1) {
        std::lock_guard<std::mutex> g(job.mu);
        job.done_cv.notify_all();
      }
    }
    t_in_parallel = was_in_parallel;
  }

  void worker() {
    uint64_t seen = 0;
    for (;;) {
      std::shared_ptr<Job> job;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stopping_ || (generation_ != seen && current_ != nullptr); });
        if (stopping_) return;
        seen = generation_;
        job = current_;
      }
      drain(*job);
    }
  }

  void stop() {
    {
      std::lock_guard<std::mutex> g(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
    workers_.clear();
  }

  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::shared_ptr<Job> current_;
  uint64_t generation_ = 0;
  bool stopping_ = false;
};

std::mutex g_pool_mu;
Pool& pool() {
  static Pool p(default_cpu_threads());
  return p;
}

}  // namespace

int num_cpu_threads() { return pool().size(); }

void set_num_cpu_threads(int n) {
  std::lock_guard<std::mutex> g(g_pool_mu);
  pool().resize(n > 0 ? n : default_cpu_threads());
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
