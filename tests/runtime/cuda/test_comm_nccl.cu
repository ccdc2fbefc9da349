// The NCCL communicator at world size 1 on one GPU (the only shape one machine can test): every
// collective equals its input bit for bit; the communication stream waits for the compute stream's
// queued work (a slow kernel writing the input) and wait() orders the compute stream after it; the
// communicator's device memory is charged as External. Run with: ctest -L gpu -R NcclComm, or
// build-*/tests/test_runtime_cuda --gtest_filter='NcclComm*'.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>

#include "kestrel/cuda/check.h"
#include "kestrel/cuda/context.h"
#include "kestrel/cuda/memory.h"
#include "kestrel/runtime/communicator.h"
#include "kestrel/runtime/memory_trace.h"
#include "kestrel/runtime/rendezvous.h"
#include "support/gpu.h"

namespace kestrel {
namespace {

const Device kGpu = Device::cuda(0);

// Progress on stderr, flushed: a crash inside NCCL still shows how far the test got.
void progress(const char* what) {
  std::fprintf(stderr, "[nccl test] %s\n", what);
  std::fflush(stderr);
}

std::unique_ptr<Communicator> world_of_one() {
  progress("loading NCCL, unique id");
  std::vector<uint8_t> id = nccl_unique_id();
  progress("creating the communicator");
  auto comm = make_nccl_communicator(id, 0, 1, 0, CommOptions{std::chrono::seconds(60)});
  progress("communicator ready");
  return comm;
}

Tensor random_tensor(int64_t n, DType dt, std::mt19937& rng) {
  std::normal_distribution<float> d;
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return Tensor::from_vector(v, {n}, DType::F32).to(dt).to(kGpu);
}

bool same_bytes(const Tensor& a, const Tensor& b) {
  Tensor ha = a.to(Device::cpu()), hb = b.to(Device::cpu());
  return ha.nbytes() == hb.nbytes() && std::memcmp(ha.data_ptr(), hb.data_ptr(), ha.nbytes()) == 0;
}

TEST(NcclComm, WorldOfOneCollectivesAreTheIdentity) {
  KESTREL_REQUIRE_GPU();
  ASSERT_TRUE(nccl_available());
  auto comm = world_of_one();
  EXPECT_EQ(comm->backend(), "nccl");
  EXPECT_EQ(comm->world_size(), 1);
  std::mt19937 rng(std::random_device{}());
  for (DType dt : {DType::F32, DType::BF16})
    for (int64_t n : {1, 1000, 65537}) {
      Tensor x = random_tensor(n, dt, rng);
      for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max}) {
        progress(n == 1 && op == ReduceOp::Sum ? "first all_reduce" : "all_reduce");
        Tensor y = x.clone();
        comm->all_reduce(y, op);
        comm->wait();
        EXPECT_TRUE(same_bytes(y, x)) << dtype_name(dt) << " n " << n;
        Tensor rs = Tensor::zeros({n}, dt, kGpu);
        comm->reduce_scatter(x, rs, op);
        comm->wait();
        EXPECT_TRUE(same_bytes(rs, x));
        Tensor red = x.clone();
        comm->reduce(red, 0, op);
        comm->wait();
        EXPECT_TRUE(same_bytes(red, x));
      }
      Tensor ag = Tensor::zeros({n}, dt, kGpu);
      comm->all_gather(x, ag);
      Tensor b = x.clone();
      comm->broadcast(b, 0);
      comm->wait();
      EXPECT_TRUE(same_bytes(ag, x));
      EXPECT_TRUE(same_bytes(b, x));
    }
  progress("barrier");
  comm->barrier();
  Tensor host = Tensor::zeros({4});
  EXPECT_THROW(comm->all_reduce(host, ReduceOp::Sum), Error);  // a CPU tensor is refused by name
  progress("destroying the communicator");
  comm.reset();
  progress("destroyed");
}

__global__ void spin_then_fill(float* p, int64_t n, long long cycles, float value) {
  const long long start = clock64();
  while (clock64() - start < cycles) {
  }
  for (int64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) p[i] = value;
}

TEST(NcclComm, TheCommStreamWaitsForComputeAndWaitOrdersComputeAfterIt) {
  KESTREL_REQUIRE_GPU();
  auto comm = world_of_one();
  const int64_t n = 1 << 20;
  for (int round = 0; round < 3; ++round) {
    Tensor in = Tensor::full({n}, 1.0, DType::F32, kGpu), out = Tensor::zeros({n}, DType::F32, kGpu);
    KESTREL_CUDA_CHECK(cudaDeviceSynchronize());
    // ~20 ms of spinning on the compute stream before the input gets its value; the reduce_scatter
    // (a copy at world size 1) must see the new value, so the comm stream must have waited.
    const float value = 3.0f + round;
    spin_then_fill<<<64, 256, 0, cuda::current_stream(0)>>>(in.data<float>(), n, 40'000'000LL, value);
    KESTREL_CUDA_CHECK_LAUNCH();
    comm->reduce_scatter(in, out, ReduceOp::Sum);
    comm->wait();
    Tensor h = out.to(Device::cpu());  // on the compute stream, after wait()
    const float* p = h.data<float>();
    EXPECT_EQ(p[0], value);
    EXPECT_EQ(p[n - 1], value);
  }
}

TEST(NcclComm, ItsDeviceMemoryIsChargedAsExternal) {
  KESTREL_REQUIRE_GPU();
  cuda::init(0);
  const int64_t before = memory_trace(kGpu).snapshot().external;
  auto comm = world_of_one();
  const MemorySnapshot s = memory_trace(kGpu).snapshot();
  // What the driver says this process took since before its CUDA context existed.
  const double used = static_cast<double>(cuda::free_memory_at_start(0) - cuda::free_memory_now(0));
  std::printf("External before the communicator %.1f MiB, after %.1f MiB; footprint %.1f MiB vs the driver's "
              "%.1f MiB\n", before / 1048576.0, s.external / 1048576.0, s.footprint() / 1048576.0, used / 1048576.0);
  EXPECT_GE(s.external, before);
  EXPECT_LE(std::fabs(static_cast<double>(s.footprint()) - used), 64.0 * 1048576) << "footprint vs driver";
}

TEST(NcclComm, RendezvousOfOneHandsBackTheId) {
  KESTREL_REQUIRE_GPU();
  std::vector<uint8_t> id = nccl_unique_id();
  EXPECT_EQ(tcp_rendezvous_broadcast("", 1, 0, 1, id, std::chrono::seconds(1)), id);
}

}  // namespace
}  // namespace kestrel
