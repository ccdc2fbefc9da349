// The CPU fork-join pool under stress: many back-to-back jobs of different sizes from several
// threads, so workers still leaving one job overlap the next one's hand-off (the race that made a
// quickstart crash and a stress program stall). Every element must be written exactly once per job.
#include <gtest/gtest.h>

#include <atomic>
#include <stdexcept>
#include <thread>
#include <vector>

#include "kestrel/runtime/parallel.h"

namespace kestrel {
namespace {

TEST(ParallelFor, BackToBackJobsOfChangingSizeCoverEveryIndexOnce) {
  set_num_cpu_threads(3);
  std::vector<int> hits(5000);
  for (int job = 0; job < 3000; ++job) {
    const int64_t n = 1 + (job * 7919) % 4999;  // sizes jump up and down between consecutive jobs
    std::fill(hits.begin(), hits.begin() + n, 0);
    parallel_for(0, n, 1 + job % 5, [&](int64_t b, int64_t e) {
      ASSERT_LE(0, b);
      ASSERT_LE(e, n);
      for (int64_t i = b; i < e; ++i) ++hits[i];
    });
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[i], 1) << "job " << job << " index " << i;
  }
  set_num_cpu_threads(0);
}

// Many workers and many tiny jobs (one to a few dozen chunks of one element): the hand-off from
// job to job happens tens of thousands of times while workers are still leaving the previous job.
// Every chunk runs exactly once and never outside its job's range. tools/sanitize.sh runs this
// file under ThreadSanitizer too.
TEST(ParallelFor, ManyThreadsManyTinyJobsRunEveryChunkExactlyOnce) {
  set_num_cpu_threads(8);
  std::vector<std::atomic<int>> hits(64);
  std::atomic<int64_t> out_of_range{0};
  for (int job = 0; job < 20000; ++job) {
    const int64_t n = 2 + (job * 37) % 63;
    for (int64_t i = 0; i < n; ++i) hits[i].store(0, std::memory_order_relaxed);
    parallel_for(0, n, 1, [&](int64_t b, int64_t e) {
      if (b < 0 || e > n || b >= e) ++out_of_range;
      for (int64_t i = b; i < e && i < 64; ++i) hits[i].fetch_add(1, std::memory_order_relaxed);
    });
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[i].load(), 1) << "job " << job << " index " << i;
  }
  EXPECT_EQ(out_of_range.load(), 0);
  set_num_cpu_threads(0);
}

TEST(ParallelFor, CallersOnSeveralThreadsEachGetTheirOwnResult) {
  set_num_cpu_threads(3);
  std::atomic<int> bad{0};
  std::vector<std::thread> callers;
  for (int t = 0; t < 3; ++t) {
    callers.emplace_back([&, t] {
      for (int job = 0; job < 400; ++job) {
        const int64_t n = 100 + (job * 31 + t * 17) % 900;
        std::vector<int64_t> out(n, -1);
        parallel_for(0, n, 7, [&](int64_t b, int64_t e) {
          for (int64_t i = b; i < e; ++i) out[i] = i * (t + 1);
        });
        for (int64_t i = 0; i < n; ++i)
          if (out[i] != i * (t + 1)) ++bad;
      }
    });
  }
  for (auto& c : callers) c.join();
  EXPECT_EQ(bad.load(), 0);
  set_num_cpu_threads(0);
}

TEST(ParallelFor, AnExceptionInOneChunkReachesTheCallerAndThePoolStaysUsable) {
  set_num_cpu_threads(3);
  for (int rep = 0; rep < 50; ++rep) {
    EXPECT_THROW(parallel_for(0, 1000, 10,
                              [&](int64_t b, int64_t) {
                                if (b >= 500) throw std::runtime_error("chunk failed");
                              }),
                 std::runtime_error);
    std::atomic<int64_t> sum{0};
    parallel_for(0, 1000, 10, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) sum += i;
    });
    ASSERT_EQ(sum.load(), 999 * 1000 / 2);
  }
  set_num_cpu_threads(0);
}

}  // namespace
}  // namespace kestrel
