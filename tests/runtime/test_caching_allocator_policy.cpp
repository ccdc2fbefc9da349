// The caching allocator's policy on a simulated device (CPU only): a 10^5-operation random
// alloc/free/record_stream stress over four streams with a budget, an External charge and a spill
// hook, checking after every operation that live blocks never overlap, every byte is accounted
// once (trace == policy == blocks), the budget is never crossed, split/merge stays consistent and
// cross-stream reuse is always ordered; plus directed tests of split/merge, OutOfBudget reports,
// the spill step, and parse_bytes.
#include <gtest/gtest.h>

#include <map>
#include <random>
#include <set>

#include "runtime/src/caching_allocator_policy.h"
#include "kestrel/runtime/memory_budget.h"
#include "sim_device_backend.h"

namespace kestrel {
namespace {

using testing::SimDeviceBackend;
constexpr int64_t MiB = 1 << 20;

StreamHandle stream_id(int i) { return reinterpret_cast<StreamHandle>(static_cast<uintptr_t>(i)); }

struct Fixture {
  SimDeviceBackend dev;
  MemoryTrace trace{Device::cuda(9)};
  CachingAllocatorPolicy policy{&dev, &trace, Device::cuda(9)};
  explicit Fixture(int64_t capacity) : dev(capacity) {}
};

// Last uses of freed byte ranges: start -> {end, [(stream, seq)]}. Cut on reuse.
struct DirtyRanges {
  struct Range {
    uintptr_t end;
    std::vector<std::pair<StreamHandle, int64_t>> uses;
  };
  std::map<uintptr_t, Range> m;
  void add(uintptr_t b, uintptr_t e, std::vector<std::pair<StreamHandle, int64_t>> uses) { m[b] = {e, std::move(uses)}; }
  // Calls check(use) for every use overlapping [b, e) and removes the overlap.
  template <typename F>
  void take(uintptr_t b, uintptr_t e, F&& check) {
    auto it = m.upper_bound(b);
    if (it != m.begin()) --it;
    std::vector<std::pair<uintptr_t, Range>> keep;
    while (it != m.end() && it->first < e) {
      if (it->second.end <= b) {
        ++it;
        continue;
      }
      for (auto& u : it->second.uses) check(u);
      if (it->first < b) keep.push_back({it->first, {b, it->second.uses}});
      if (it->second.end > e) keep.push_back({e, {it->second.end, it->second.uses}});
      it = m.erase(it);
    }
    for (auto& [k, r] : keep) m[k] = r;
  }
};

TEST(CachingAllocatorPolicy, RandomStressKeepsInvariants) {
  const int64_t budget = 320 * MiB, external = 40 * MiB;
  Fixture f(1024 * MiB);
  f.policy.set_budget(budget);
  f.trace.set_external(external);

  struct Live {
    Allocation a;
    size_t block = 0;  // rounded size the policy accounts
    bool spillable = false;
  };
  std::map<uintptr_t, Live> live;  // by address
  DirtyRanges dirty;
  std::mt19937_64 rng(1234);
  int64_t live_bytes = 0, spilled = 0, ooms = 0, cross_reuses = 0;

  std::map<uintptr_t, std::vector<StreamHandle>> recorded;  // extra streams per live block
  // Frees a live block; its last uses (allocation stream and recorded streams) become dirty notes.
  auto release = [&](std::map<uintptr_t, Live>::iterator it) {
    Allocation& a = it->second.a;
    uintptr_t p = it->first;
    std::vector<std::pair<StreamHandle, int64_t>> uses;
    uses.push_back({a.stream, f.dev.use(a.stream)});
    for (StreamHandle s : recorded[p]) uses.push_back({s, f.dev.use(s)});
    recorded.erase(p);
    dirty.add(p, p + it->second.block, std::move(uses));
    live_bytes -= static_cast<int64_t>(it->second.block);
    f.policy.deallocate(a);
    live.erase(it);
  };

  // Unmapping waits for the streams that used the segment (not the whole device): every use of
  // its bytes must have finished by then.
  int64_t unmaps = 0;
  f.dev.on_unmap = [&](uintptr_t base, size_t bytes) {
    ++unmaps;
    dirty.take(base, base + bytes, [&](const std::pair<StreamHandle, int64_t>& u) {
      EXPECT_TRUE(f.dev.finished(u.first, u.second)) << "segment unmapped while stream " << u.first << " use "
                                                     << u.second << " may still run";
    });
  };
  f.policy.set_spill_hook([&](int64_t need) {
    int64_t freed = 0;
    for (auto it = live.begin(); it != live.end() && freed < need;) {
      if (!it->second.spillable) {
        ++it;
        continue;
      }
      freed += static_cast<int64_t>(it->second.block);
      ++spilled;
      auto next = std::next(it);
      release(it);
      it = next;
    }
    return freed;
  });

  auto log_size = [&](double lo, double hi) {
    return static_cast<size_t>(std::exp(std::uniform_real_distribution<double>(std::log(lo), std::log(hi))(rng)));
  };

  const int kOps = 100000;
  for (int op = 0; op < kOps; ++op) {
    double r = std::uniform_real_distribution<double>(0, 1)(rng);
    double p_free = live.empty() ? 0.0 : std::min(0.9, 0.3 + 0.4 * live_bytes / static_cast<double>(budget));
    if (r < p_free) {
      auto it = live.begin();
      std::advance(it, std::uniform_int_distribution<size_t>(0, live.size() - 1)(rng));
      release(it);
    } else if (r < p_free + 0.05 && !live.empty()) {
      auto it = live.begin();
      std::advance(it, std::uniform_int_distribution<size_t>(0, live.size() - 1)(rng));
      StreamHandle s = stream_id(1 + static_cast<int>(rng() % 4));
      f.policy.record_stream(it->second.a, s);
      if (s != it->second.a.stream) recorded[it->first].push_back(s);
    } else {
      bool small = rng() % 10 < 6;
      size_t bytes = small ? log_size(1, 1 * MiB) : log_size(1 * MiB, 96 * MiB);
      StreamHandle s = stream_id(1 + static_cast<int>(rng() % 4));
      MemoryTag tag = static_cast<MemoryTag>(rng() % 8);
      Allocation a;
      try {
        a = f.policy.allocate(bytes, tag, s);
      } catch (const OutOfBudget& e) {
        ++ooms;
        const OutOfBudgetReport& rep = e.report();
        ASSERT_GE(rep.request, static_cast<int64_t>(bytes));
        ASSERT_EQ(rep.budget, budget);
        ASSERT_EQ(rep.external, external);
        ASSERT_LE(rep.footprint, budget);
        f.policy.check_invariants();
        continue;
      }
      uintptr_t p = reinterpret_cast<uintptr_t>(a.ptr);
      size_t blk = 0;
      for (auto& bi : f.policy.blocks())
        if (bi.ptr == p) blk = bi.size;
      ASSERT_GE(blk, bytes);
      // No overlap with live neighbours.
      auto nb = live.lower_bound(p);
      if (nb != live.end()) ASSERT_LE(p + blk, nb->first);
      if (nb != live.begin()) {
        auto pv = std::prev(nb);
        ASSERT_LE(pv->first + pv->second.block, p);
      }
      // Cross-stream reuse was ordered after the previous uses.
      dirty.take(p, p + blk, [&](const std::pair<StreamHandle, int64_t>& u) {
        if (u.first != s) ++cross_reuses;
        ASSERT_TRUE(f.dev.ordered(s, u.first, u.second)) << "reuse on stream " << s << " not ordered after "
                                                         << u.first << " seq " << u.second;
      });
      live[p] = {a, blk, rng() % 5 == 0};
      live_bytes += static_cast<int64_t>(blk);
    }
    // Accounting after every operation.
    MemorySnapshot snap = f.trace.snapshot();
    int64_t tag_sum = 0;
    for (int t = 0; t < kNumMemoryTags; ++t)
      if (t != static_cast<int>(MemoryTag::External)) tag_sum += snap.tags[t].current;
    ASSERT_EQ(snap.in_use, live_bytes);
    ASSERT_EQ(tag_sum, live_bytes);
    ASSERT_EQ(snap.reserved, f.dev.mapped());
    ASSERT_LE(snap.reserved + external, budget) << "budget crossed at op " << op;
    if (op % 997 == 0) f.policy.check_invariants();
  }
  f.policy.check_invariants();
  AllocatorPolicyStats st = f.policy.stats();
  EXPECT_EQ(st.in_use, live_bytes);
  EXPECT_LE(f.dev.peak_mapped() + external, budget);
  EXPECT_GT(ooms, 0) << "the stress should hit the budget";
  EXPECT_GT(spilled, 0);
  EXPECT_GT(cross_reuses, 0);
  EXPECT_GT(unmaps, 0) << "the budget ladder should release cached segments";
  EXPECT_GT(st.num_cache_hits, kOps / 10);
  // Drain: everything freed merges back into whole segments, which release entirely.
  while (!live.empty()) {
    release(live.begin());
  }
  f.policy.release_cached();
  f.dev.on_unmap = nullptr;  // it refers to locals of this test
  f.policy.check_invariants();
  EXPECT_EQ(f.policy.stats().reserved, 0);
  EXPECT_EQ(f.dev.mapped(), 0);
  EXPECT_EQ(f.dev.events_created(), f.dev.events_destroyed());
  std::printf("stress: %d ops, %lld OutOfBudget, %lld spilled, %lld cross-stream reuses, %lld maps, %lld hits\n",
              kOps, static_cast<long long>(ooms), static_cast<long long>(spilled),
              static_cast<long long>(cross_reuses), static_cast<long long>(st.num_maps),
              static_cast<long long>(st.num_cache_hits));
}

TEST(CachingAllocatorPolicy, SplitAndMerge) {
  Fixture f(256 * MiB);
  StreamHandle s = stream_id(1);
  Allocation a = f.policy.allocate(1000, MemoryTag::Activation, s);
  Allocation b = f.policy.allocate(3000, MemoryTag::Activation, s);
  Allocation c = f.policy.allocate(512, MemoryTag::Activation, s);
  // One small segment, blocks carved in order, rounded to 512 B.
  EXPECT_EQ(f.policy.stats().num_segments, 1);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(b.ptr), reinterpret_cast<uintptr_t>(a.ptr) + 1024);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(c.ptr), reinterpret_cast<uintptr_t>(b.ptr) + 3072);
  f.policy.deallocate(b);
  f.policy.check_invariants();
  Allocation d = f.policy.allocate(2048, MemoryTag::Temporary, s);  // best fit: b's hole
  EXPECT_EQ(d.ptr, b.ptr);
  f.policy.deallocate(a);
  f.policy.deallocate(c);
  f.policy.deallocate(d);
  f.policy.check_invariants();
  auto blocks = f.policy.blocks();
  ASSERT_EQ(blocks.size(), 1u);
  EXPECT_EQ(blocks[0].size, CachingAllocatorPolicy::kSmallSegment);
  // Large: a 5 MiB request maps a 6 MiB segment; the 1 MiB remainder is not split off.
  Allocation big = f.policy.allocate(5 * MiB, MemoryTag::Parameter, s);
  EXPECT_EQ(f.dev.mapped(), 2 * MiB + 6 * MiB);
  EXPECT_EQ(f.trace.snapshot().tags[static_cast<int>(MemoryTag::Parameter)].current, 6 * MiB);
  f.policy.deallocate(big);
  EXPECT_EQ(f.policy.release_cached(), 8 * MiB);
  EXPECT_EQ(f.dev.mapped(), 0);
}

TEST(CachingAllocatorPolicy, CrossStreamReuseWaitsOnEvent) {
  Fixture f(256 * MiB);
  Allocation a = f.policy.allocate(8 * MiB, MemoryTag::Activation, stream_id(1));
  f.policy.deallocate(a);
  int64_t waits = f.dev.num_waits();
  Allocation same = f.policy.allocate(8 * MiB, MemoryTag::Activation, stream_id(1));
  EXPECT_EQ(f.dev.num_waits(), waits);  // same stream: no wait
  f.policy.deallocate(same);
  Allocation other = f.policy.allocate(8 * MiB, MemoryTag::Activation, stream_id(2));
  EXPECT_EQ(other.ptr, a.ptr);
  EXPECT_EQ(f.dev.num_waits(), waits + 1);
  // record_stream: the free is pending until the copy stream's event completes.
  f.policy.record_stream(other, stream_id(3));
  f.policy.deallocate(other);
  EXPECT_EQ(f.policy.stats().num_pending, 1);
  f.policy.release_cached();  // waits for the event, then unmaps
  EXPECT_EQ(f.policy.stats().num_pending, 0);
  EXPECT_EQ(f.dev.mapped(), 0);
}

TEST(CachingAllocatorPolicy, OutOfBudgetReportAndRecovery) {
  Fixture f(1024 * MiB);
  f.policy.set_budget(100 * MiB);
  f.trace.set_external(10 * MiB);
  Allocation a = f.policy.allocate(50 * MiB, MemoryTag::Activation, stream_id(1));
  Allocation keep = f.policy.allocate(4 * MiB, MemoryTag::Parameter, stream_id(1));
  try {
    f.policy.allocate(40 * MiB, MemoryTag::Activation, stream_id(1));
    FAIL() << "expected OutOfBudget";
  } catch (const OutOfBudget& e) {
    const OutOfBudgetReport& r = e.report();
    EXPECT_EQ(r.request, 40 * MiB);
    EXPECT_EQ(r.budget, 100 * MiB);
    EXPECT_EQ(r.reserved, 54 * MiB);
    EXPECT_EQ(r.in_use, 54 * MiB);
    EXPECT_EQ(r.external, 10 * MiB);
    EXPECT_EQ(r.tag_bytes[static_cast<int>(MemoryTag::Activation)], 50 * MiB);
    EXPECT_EQ(r.tag_bytes[static_cast<int>(MemoryTag::Parameter)], 4 * MiB);
    EXPECT_FALSE(r.device_full);
    std::string w = e.what();
    EXPECT_NE(w.find("out of budget"), std::string::npos) << w;
    EXPECT_NE(w.find("activation=50.00 MiB"), std::string::npos) << w;
    EXPECT_NE(w.find("suggestion: raise the budget by at least 4.00 MiB"), std::string::npos) << w;
    EXPECT_NE(w.find("largest free block"), std::string::npos) << w;
  }
  // Nothing in use was touched; the allocator is consistent and the next workload runs.
  f.policy.check_invariants();
  EXPECT_EQ(f.trace.snapshot().in_use, 54 * MiB);
  EXPECT_EQ(f.trace.snapshot().num_ooms, 1);
  f.policy.deallocate(a);
  Allocation b = f.policy.allocate(40 * MiB, MemoryTag::Activation, stream_id(1));
  EXPECT_NE(b.ptr, nullptr);
  f.policy.deallocate(b);
  f.policy.deallocate(keep);
  // Device full without a budget reports so.
  f.policy.set_budget(0);
  try {
    f.policy.allocate(2000 * MiB, MemoryTag::Activation, stream_id(1));
    FAIL();
  } catch (const OutOfBudget& e) {
    EXPECT_TRUE(e.report().device_full);
    EXPECT_NE(std::string(e.what()).find("out of device memory"), std::string::npos);
  }
  f.policy.check_invariants();
}

TEST(CachingAllocatorPolicy, SpillHookFreesBeforeFailing) {
  Fixture f(1024 * MiB);
  f.policy.set_budget(64 * MiB);
  Allocation spillable = f.policy.allocate(40 * MiB, MemoryTag::Checkpoint, stream_id(1));
  bool called = false;
  f.policy.set_spill_hook([&](int64_t need) {
    called = true;
    EXPECT_GE(need, 16 * MiB);
    f.policy.deallocate(spillable);  // re-entrant: the hook runs without the lock
    return int64_t{40 * MiB};
  });
  Allocation b = f.policy.allocate(40 * MiB, MemoryTag::Activation, stream_id(1));
  EXPECT_TRUE(called);
  EXPECT_EQ(b.ptr, spillable.ptr);  // the spilled block was reused
  f.policy.deallocate(b);
  f.policy.check_invariants();
}

// Repeated steps: parameters, then per layer activations (kept) and temporaries (freed), then
// backward frees activations in reverse with gradient temporaries. Returns peak reserved / in use.
double training_trace_ratio(int64_t act_extra_per_layer) {
  Fixture f(64LL * 1024 * MiB);
  StreamHandle s = stream_id(1);
  std::vector<Allocation> params;
  for (int i = 0; i < 16; ++i) params.push_back(f.policy.allocate((i % 3 + 1) * 24 * MiB, MemoryTag::Parameter, s));
  for (int step = 0; step < 4; ++step) {
    std::vector<Allocation> acts;
    for (int l = 0; l < 16; ++l) {
      Allocation t1 = f.policy.allocate(48 * MiB, MemoryTag::Temporary, s);
      acts.push_back(f.policy.allocate(16 * MiB + act_extra_per_layer * l, MemoryTag::Activation, s));
      Allocation t2 = f.policy.allocate(300 * 1024, MemoryTag::Temporary, s);
      f.policy.deallocate(t1);
      f.policy.deallocate(t2);
    }
    for (int l = 15; l >= 0; --l) {
      Allocation g = f.policy.allocate(16 * MiB + act_extra_per_layer * l, MemoryTag::Gradient, s);
      Allocation t = f.policy.allocate(64 * MiB, MemoryTag::Temporary, s);
      f.policy.deallocate(t);
      f.policy.deallocate(acts[l]);
      f.policy.deallocate(g);
    }
  }
  AllocatorPolicyStats st = f.policy.stats();
  for (auto& p : params) f.policy.deallocate(p);
  f.policy.check_invariants();
  double ratio = static_cast<double>(st.peak_reserved) / st.peak_in_use;
  std::printf("training trace (activation sizes +%lld B per layer): peak reserved %.1f MiB, peak in use %.1f MiB, "
              "ratio %.3f\n", static_cast<long long>(act_extra_per_layer), st.peak_reserved / double(MiB),
              st.peak_in_use / double(MiB), ratio);
  return ratio;
}

TEST(CachingAllocatorPolicy, TrainingTraceStaysCompact) {
  EXPECT_LE(training_trace_ratio(2 * MiB), 1.05);  // granule-multiple activations
  // Odd sizes: each large segment carries an unusable < 2 MiB tail (the known cost, see the header).
  EXPECT_LE(training_trace_ratio(1000), 1.08);
}

TEST(MemoryBudget, ParseAndFormatBytes) {
  EXPECT_EQ(parse_bytes("40GiB"), 40LL << 30);
  EXPECT_EQ(parse_bytes("1.5 GiB"), 3LL << 29);
  EXPECT_EQ(parse_bytes("512MiB"), 512LL << 20);
  EXPECT_EQ(parse_bytes("2G"), 2LL << 30);
  EXPECT_EQ(parse_bytes("3GB"), 3000000000LL);
  EXPECT_EQ(parse_bytes("4096"), 4096);
  EXPECT_EQ(parse_bytes("64kib"), 65536);
  EXPECT_THROW(parse_bytes("lots"), Error);
  EXPECT_THROW(parse_bytes("12 parsecs"), Error);
  EXPECT_EQ(format_bytes(1536), "1.50 KiB");
  EXPECT_EQ(format_bytes(100), "100 B");
}

}  // namespace
}  // namespace kestrel
