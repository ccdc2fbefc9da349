// GPU tests of the CUDA runtime: raw kernels against the CPU path, the caching allocator on the
// real backend, budget exactness against cudaMemGetInfo, OutOfBudget and recovery, spill/restore,
// and an offloaded recompute stack against a kept one (a test-local differentiable op).
#include <gtest/gtest.h>

#include <cstring>
#include <random>

#include "kestrel/autograd/recompute.h"
#include "kestrel/autograd/tape.h"
#include "kestrel/runtime/accumulate.h"
#include "kestrel/cuda/check.h"
#include "kestrel/cuda/context.h"
#include "kestrel/cuda/memory.h"
#include "kestrel/runtime/memory_budget.h"
#include "kestrel/runtime/memory_config.h"
#include "kestrel/runtime/memory_trace.h"
#include "kestrel/runtime/random.h"
#include "kestrel/runtime/tensor.h"
#include "support/gpu.h"

namespace kestrel {
namespace {

constexpr int64_t MiB = 1 << 20;
const Device kGpu = Device::cuda(0);

std::vector<uint8_t> bytes_of(const Tensor& t) {
  Tensor h = t.to(Device::cpu()).contiguous();
  std::vector<uint8_t> v(h.nbytes());
  std::memcpy(v.data(), h.data_ptr(), v.size());
  return v;
}

TEST(CudaKernels, StridedCopyFillAddMatchCpu) {
  KESTREL_REQUIRE_GPU();
  setvbuf(stdout, nullptr, _IONBF, 0);  // figures survive a crash
  Generator gen(42);
  const DType types[] = {DType::F32, DType::BF16, DType::F16, DType::I32, DType::I64, DType::U8, DType::Bool};
  Tensor base = uniform({3, 37, 5, 9}, -100.0, 100.0, DType::F32, Device::cpu(), gen);
  for (DType src_t : types)
    for (DType dst_t : types) {
      Tensor src_cpu = base.to(src_t);
      Tensor src_gpu = src_cpu.to(kGpu);
      // Permuted, narrowed destination: strided writes and strided reads.
      Shape pshape = {9, 37, 3, 4};
      Tensor dst_cpu = Tensor::full({3, 37, 5, 9}, 7.0, dst_t, Device::cpu()).permute_view({3, 1, 0, 2}).narrow_view(3, 1, 4);
      Tensor dst_gpu = Tensor::full({3, 37, 5, 9}, 7.0, dst_t, kGpu).permute_view({3, 1, 0, 2}).narrow_view(3, 1, 4);
      Tensor src_view_cpu = src_cpu.permute_view({3, 1, 0, 2}).narrow_view(3, 0, 4);
      Tensor src_view_gpu = src_gpu.permute_view({3, 1, 0, 2}).narrow_view(3, 0, 4);
      dst_cpu.copy_(src_view_cpu);
      dst_gpu.copy_(src_view_gpu);
      ASSERT_EQ(bytes_of(dst_gpu), bytes_of(dst_cpu)) << dtype_name(src_t) << " -> " << dtype_name(dst_t);
    }
  for (DType t : types) {
    Tensor c = Tensor::zeros({5, 7, 3}, t, Device::cpu()).permute_view({2, 0, 1});
    Tensor g = Tensor::zeros({5, 7, 3}, t, kGpu).permute_view({2, 0, 1});
    c.fill_(-3.7);
    g.fill_(-3.7);
    ASSERT_EQ(bytes_of(g), bytes_of(c)) << "fill " << dtype_name(t);
  }
  for (DType dt : {DType::F32, DType::BF16, DType::F16})
    for (DType st : {DType::F32, DType::BF16, DType::F16}) {
      Tensor a = uniform({33, 65}, -2, 2, dt, Device::cpu(), gen);
      Tensor b = uniform({65, 33}, -2, 2, st, Device::cpu(), gen).permute_view({1, 0});
      Tensor ag = a.to(kGpu), bg = b.to(kGpu);  // b.to keeps strides? it copies into contiguous [33,65]
      add_into(a, b);
      add_into(ag, bg);
      ASSERT_EQ(bytes_of(ag), bytes_of(a)) << "add_into " << dtype_name(dt) << " += " << dtype_name(st);
      // Contiguous operands take the vectorised path (8 per thread + a tail of 5), also from a
      // 16-byte aligned offset view and from a misaligned one (the generic path).
      for (int64_t start : {int64_t{0}, int64_t{8}, int64_t{3}}) {
        Tensor x = uniform({8 * 4099 + 5 + 8}, -3, 3, dt, Device::cpu(), gen).narrow_view(0, start, 8 * 4099 + 5);
        Tensor y = uniform({8 * 4099 + 5 + 8}, -3, 3, st, Device::cpu(), gen).narrow_view(0, start, 8 * 4099 + 5);
        Tensor xg = x.to(kGpu), yg = Tensor::empty({8 * 4099 + 5 + 8}, st, kGpu).narrow_view(0, start, 8 * 4099 + 5);
        yg.copy_(y.to(kGpu));
        add_into(x, y);
        add_into(xg, yg);
        ASSERT_EQ(bytes_of(xg), bytes_of(x)) << "contiguous add_into " << dtype_name(dt) << " += " << dtype_name(st)
                                             << " at offset " << start;
      }
    }
  EXPECT_THROW(Tensor::zeros({4}, DType::F64, kGpu), Error);
}

TEST(CudaKernels, PhiloxMatchesCpuStream) {
  KESTREL_REQUIRE_GPU();
  for (DType t : {DType::F32, DType::BF16, DType::F16}) {
    Generator gc(7), gg(7);
    Tensor uc = uniform({1001, 3}, -1.5, 2.5, t, Device::cpu(), gc);
    Tensor ug = uniform({1001, 3}, -1.5, 2.5, t, kGpu, gg);
    ASSERT_EQ(bytes_of(ug), bytes_of(uc)) << "uniform " << dtype_name(t);  // bit-identical
    Tensor nc = normal({4099}, 0.5, 2.0, t, Device::cpu(), gc);
    Tensor ng = normal({4099}, 0.5, 2.0, t, kGpu, gg);
    std::vector<float> a = nc.to_float_vector(), b = ng.to_float_vector();
    double tol = t == DType::F32 ? 1e-5 : (t == DType::BF16 ? 2e-2 : 2e-3);
    for (size_t i = 0; i < a.size(); ++i) ASSERT_NEAR(a[i], b[i], tol * (1 + std::abs(a[i]))) << i;
    EXPECT_EQ(gc.offset(), gg.offset());
  }
}

TEST(CudaAllocator, RandomStressOnRealBackend) {
  KESTREL_REQUIRE_GPU();
  cuda::init(0);
  cudaStream_t side;
  KESTREL_CUDA_CHECK(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
  std::mt19937_64 rng(99);
  struct Live {
    Tensor t;
    uint8_t pattern;
    bool on_side;  // filled on `side`, which the legacy stream's reads do not wait for
  };
  std::vector<Live> live;
  int checked = 0;
  for (int op = 0; op < 20000; ++op) {
    if (!live.empty() && (rng() % 100 < 45 || live.size() > 300)) {
      size_t i = rng() % live.size();
      if (op % 25 == 0) {  // the block still holds its own pattern: nobody else wrote into it
        // The read below runs on the current stream; a fill on the non-blocking side stream is
        // ordered before it only by a wait (without one, the read raced the fill and saw the
        // previous owner's pattern).
        if (live[i].on_side) KESTREL_CUDA_CHECK(cudaStreamSynchronize(side));
        std::vector<uint8_t> v = bytes_of(live[i].t);
        ASSERT_EQ(v.front(), live[i].pattern);
        ASSERT_EQ(v.back(), live[i].pattern);
        ++checked;
      }
      live.erase(live.begin() + static_cast<long>(i));
    } else {
      bool on_side = rng() % 3 == 0;
      int64_t n = rng() % 10 < 7 ? 1 + static_cast<int64_t>(rng() % (1 << 18)) : (1 << 20) + static_cast<int64_t>(rng() % (24 << 20));
      uint8_t pattern = static_cast<uint8_t>(rng());
      auto make = [&] {
        Tensor t = Tensor::empty({n}, DType::U8, kGpu);
        t.fill_(pattern);
        return t;
      };
      if (on_side) {
        cuda::StreamGuard g(side);
        live.push_back({make(), pattern, true});
      } else {
        live.push_back({make(), pattern, false});
      }
    }
  }
  cuda::check_allocator_invariants(0);
  live.clear();
  synchronize(kGpu);
  cuda::check_allocator_invariants(0);
  AllocatorPolicyStats st = cuda::allocator_stats(0);
  EXPECT_GT(st.num_cache_hits, 5000);
  std::printf("real stress (%s): %d verified, %lld maps, %lld hits, reserved %.1f MiB\n",
              cuda::allocator_backend_name(0).c_str(), checked, static_cast<long long>(st.num_maps),
              static_cast<long long>(st.num_cache_hits), st.reserved / double(MiB));
  // `side` stays alive: cached free blocks remember the streams they were used on (see the policy).
}

// The runtime's footprint vs the drop in free memory since the process started (within a granule).
void expect_exact(const char* where) {
  int64_t drop = cuda::free_memory_at_start(0) - cuda::free_memory_now(0);
  int64_t fp = device_footprint(kGpu);
  std::printf("budget exactness at %-28s footprint %10.1f MiB, free-memory drop %10.1f MiB, diff %+.1f MiB\n", where,
              fp / double(MiB), drop / double(MiB), (fp - drop) / double(MiB));
  EXPECT_LE(std::llabs(fp - drop), 2 * MiB) << where;
}

TEST(CudaBudget, FootprintMatchesDriverAndOutOfBudgetRecovers) {
  KESTREL_REQUIRE_GPU();
  cuda::init(0);
  synchronize(kGpu);
  expect_exact("init");
  {
    Tensor big = Tensor::empty({1024 * MiB}, DType::U8, kGpu);
    big.fill_(1);
    synchronize(kGpu);
    expect_exact("after 1 GiB");
    std::vector<Tensor> small;
    for (int i = 0; i < 300; ++i) small.push_back(Tensor::empty({1000 + 37 * i}, DType::F32, kGpu));
    expect_exact("after 300 small");
  }
  cuda::release_cached(0);
  expect_exact("after free + release");

  // A budget smaller than the workload: OutOfBudget with the report, nothing in use freed.
  int64_t fp = device_footprint(kGpu);
  set_memory_budget(kGpu, fp + 256 * MiB);
  Tensor keep = Tensor::full({64 * MiB / 4}, 3.0, DType::F32, kGpu);
  int64_t in_use = memory_trace(kGpu).snapshot().in_use;
  bool thrown = false;
  try {
    TagScope tag(MemoryTag::Activation);
    Tensor too_big = Tensor::empty({400 * MiB}, DType::U8, kGpu);
  } catch (const OutOfBudget& e) {
    thrown = true;
    std::printf("%s\n", e.what());
    EXPECT_EQ(e.report().budget, fp + 256 * MiB);
    EXPECT_EQ(e.report().request, 400 * MiB);
    EXPECT_GE(e.report().tag_bytes[static_cast<int>(MemoryTag::Workspace)], 32 * MiB);
    EXPECT_NE(std::string(e.what()).find("suggestion"), std::string::npos);
  }
  EXPECT_TRUE(thrown);
  EXPECT_EQ(memory_trace(kGpu).snapshot().in_use, in_use);
  EXPECT_LE(device_footprint(kGpu), fp + 256 * MiB);
  Tensor smaller = Tensor::empty({150 * MiB}, DType::U8, kGpu);  // the next smaller workload runs
  smaller.fill_(2);
  EXPECT_EQ(keep.to_float_vector()[12345], 3.0f);
  cuda::check_allocator_invariants(0);
  // Lowering the budget under the footprint returns the cached segments at once.
  smaller = Tensor();
  set_memory_budget(kGpu, 0);
  {
    Tensor t = Tensor::empty({512 * MiB}, DType::U8, kGpu);
  }
  const int64_t cached_fp = device_footprint(kGpu);
  set_memory_budget(kGpu, cached_fp - 256 * MiB);
  EXPECT_LE(device_footprint(kGpu), cached_fp - 512 * MiB) << "the cached 512 MiB segment should be released";
  expect_exact("after lowering the budget");
  set_memory_budget(kGpu, 0);
}

TEST(CudaBudget, SpillAndRestoreAreByteIdentical) {
  KESTREL_REQUIRE_GPU();
  cuda::init(0);
  Generator gen(5);
  Tensor t = uniform({16 * MiB}, -1, 1, DType::F32, kGpu, gen);  // 64 MiB
  std::vector<uint8_t> before = bytes_of(t);
  auto sp = cuda::make_spillable(t);
  t = Tensor();
  cuda::release_cached(0);
  int64_t fp = device_footprint(kGpu);
  set_memory_budget(kGpu, fp + 32 * MiB);  // room for 32 MiB more, not for 80
  {
    Tensor other = Tensor::empty({80 * MiB}, DType::U8, kGpu);  // forces the spill
    EXPECT_TRUE(sp->spilled());
  }
  cuda::release_cached(0);
  set_memory_budget(kGpu, 0);
  EXPECT_EQ(bytes_of(sp->get()), before);
  EXPECT_FALSE(sp->spilled());
}

// ---- a test-local differentiable op on the GPU: y = tanh(w * x), elementwise ----
__global__ void scaled_tanh_fwd(const float* x, const float* w, float* y, int64_t n) {
  int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) y[i] = tanhf(w[i] * x[i]);
}
__global__ void scaled_tanh_bwd(const float* x, const float* w, const float* y, const float* dy, float* dx,
                                float* dw, int64_t n) {
  int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) {
    float d = dy[i] * (1.0f - y[i] * y[i]);
    dx[i] = d * w[i];
    dw[i] = d * x[i];
  }
}
unsigned blocks(int64_t n) { return static_cast<unsigned>((n + 255) / 256); }

Tensor scaled_tanh(const Tensor& x, const Tensor& w) {
  int64_t n = x.numel();
  Tensor y = Tensor::empty(x.shape(), DType::F32, x.device());
  scaled_tanh_fwd<<<blocks(n), 256, 0, cuda::current_stream()>>>(x.data<float>(), w.data<float>(), y.data<float>(), n);
  KESTREL_CUDA_CHECK_LAUNCH();
  if (autograd::should_record({x, w}))
    autograd::record("scaled_tanh", {x, w}, y, [x, w, y](const std::vector<Tensor>& g) {
      Tensor dx = Tensor::empty(x.shape(), DType::F32, x.device()), dw = Tensor::empty(x.shape(), DType::F32, x.device());
      Tensor dy = g[0].contiguous();
      scaled_tanh_bwd<<<blocks(x.numel()), 256, 0, cuda::current_stream()>>>(
          x.data<float>(), w.data<float>(), y.data<float>(), dy.data<float>(), dx.data<float>(), dw.data<float>(), x.numel());
      KESTREL_CUDA_CHECK_LAUNCH();
      return std::vector<Tensor>{dx, dw};
    });
  return y;
}

struct StackResult {
  std::vector<std::vector<uint8_t>> grads;
  int64_t peak_in_use;
  int64_t saved_peak;  // peak of Activation + Checkpoint: what the policy is about (weights' grads excluded)
};

StackResult run_stack(autograd::RecomputePolicy policy) {
  const int layers = 12;
  const int64_t n = 8 * MiB;  // 32 MiB per activation
  Generator gen(11);
  std::vector<Tensor> ws;
  for (int l = 0; l < layers; ++l) {
    TagScope tag(MemoryTag::Parameter);
    ws.push_back(uniform({n}, 0.5, 1.5, DType::F32, kGpu, gen).set_requires_grad(true));
  }
  Tensor x0 = uniform({n}, -1, 1, DType::F32, kGpu, gen);
  synchronize(kGpu);
  cuda::release_cached(0);
  memory_trace(kGpu).reset_peaks();
  int64_t base = memory_trace(kGpu).snapshot().in_use;
  Tensor x = x0;
  {
    TagScope tag(MemoryTag::Activation);
    for (int l = 0; l < layers; ++l) {
      Tensor w = ws[l];
      x = autograd::recompute([w](const std::vector<Tensor>& in) {
            return std::vector<Tensor>{scaled_tanh(scaled_tanh(in[0], w), w)};
          }, {x}, {policy, "layer"})[0];
    }
  }
  Tensor ones = Tensor::full(x.shape(), 1.0, DType::F32, kGpu);
  {
    TagScope tag(MemoryTag::Gradient);
    autograd::backward({x}, {ones});
  }
  synchronize(kGpu);
  StackResult r;
  MemorySnapshot snap = memory_trace(kGpu).snapshot();
  r.peak_in_use = snap.peak_in_use - base;
  r.saved_peak = snap.tags[static_cast<int>(MemoryTag::Activation)].peak +
                 snap.tags[static_cast<int>(MemoryTag::Checkpoint)].peak;
  for (auto& w : ws) r.grads.push_back(bytes_of(w.grad()));
  return r;
}

TEST(CudaOffload, OffloadedRecomputeMatchesKeptWithLowerPeak) {
  KESTREL_REQUIRE_GPU();
  // Bound the copies in flight to two activations, as a budgeted run would.
  const MemoryConfig saved = memory_config(kGpu);
  MemoryConfig bounded = saved;
  bounded.offload_inflight = 64 * MiB;
  configure_memory(kGpu, bounded);
  StackResult keep = run_stack(autograd::RecomputePolicy::Keep);
  cuda::OffloadStats before = cuda::offload_stats(0);
  StackResult off = run_stack(autograd::RecomputePolicy::Offload);
  cuda::OffloadStats after = cuda::offload_stats(0);
  std::printf("recompute stack: peak in use keep %.1f MiB, offload %.1f MiB; activation+checkpoint peak keep %.1f MiB, "
              "offload %.1f MiB; offloaded %.1f MiB, restored %.1f MiB\n",
              keep.peak_in_use / double(MiB), off.peak_in_use / double(MiB), keep.saved_peak / double(MiB),
              off.saved_peak / double(MiB),
              (after.offloaded_bytes - before.offloaded_bytes) / double(MiB),
              (after.restored_bytes - before.restored_bytes) / double(MiB));
  EXPECT_GT(after.num_offloads, before.num_offloads);
  ASSERT_EQ(keep.grads.size(), off.grads.size());
  for (size_t i = 0; i < keep.grads.size(); ++i) EXPECT_EQ(keep.grads[i], off.grads[i]) << "layer " << i;
  // The saved activations leave the device: their peak falls by at least a quarter (12 inputs of
  // 32 MiB kept vs at most 64 MiB in flight plus one region's restore and prefetch). The total peak
  // of this test is set by the 12 weights' gradients (as large as the activations here), not by
  // the policy, so it may only not grow by more than the one prefetched input.
  EXPECT_LT(off.saved_peak, keep.saved_peak * 3 / 4);
  EXPECT_LE(off.peak_in_use, keep.peak_in_use + 32 * MiB);
  configure_memory(kGpu, saved);
}

// configure_memory pushes every setting into the device's context, which reads them back from
// their owners (the budget from the caching allocator, the limit from the pinned pool); the
// allocator backend cannot change once the device runs.
TEST(CudaMemoryConfig, PushedIntoTheContextAndReadBack) {
  KESTREL_REQUIRE_GPU();
  cuda::init(0);
  const MemoryConfig saved = memory_config(kGpu);
  EXPECT_EQ(allocator_backend_name(saved.allocator), cuda::allocator_backend_name(0));
  MemoryConfig c = saved;
  c.budget = int64_t{30} << 30;
  c.pinned_limit = int64_t{3} << 30;
  c.offload_inflight = 96 * MiB;
  c.matmul_tf32 = !saved.matmul_tf32;
  configure_memory(kGpu, c);
  EXPECT_EQ(memory_config(kGpu), c);
  EXPECT_EQ(memory_budget(kGpu), int64_t{30} << 30);
  EXPECT_EQ(cuda::pinned_stats().limit, int64_t{3} << 30);
  set_memory_budget(kGpu, 0);  // the budget alone, through the same path
  EXPECT_EQ(memory_config(kGpu).budget, 0);
  EXPECT_EQ(memory_config(kGpu).offload_inflight, 96 * MiB);
  MemoryConfig other = c;
  other.allocator = saved.allocator == AllocatorBackend::Vmm ? AllocatorBackend::Malloc : AllocatorBackend::Vmm;
  try {
    configure_memory(kGpu, other);
    ADD_FAILURE() << "the allocator backend changed on a running device";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("memory.allocator"), std::string::npos) << e.what();
  }
  configure_memory(kGpu, saved);
  EXPECT_EQ(memory_config(kGpu), saved);
}

}  // namespace
}  // namespace kestrel
