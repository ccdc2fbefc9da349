// The in-process communicator (threads as ranks) against a serial reference, on fresh random data
// for world sizes 1-5 and odd element counts: all_reduce (sum, avg; f32, bf16, f64),
// reduce_scatter, all_gather, broadcast, barrier. The reference adds the ranks' values in rank order
// in f32 and rounds once, as the backend promises, so results must match bit for bit; it is itself
// checked against an f64 sum. Then the failure modes: mismatched collectives, bad arguments, a dead
// rank (an error naming it within the timeout) and an abort carrying the failing rank's message.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <exception>
#include <functional>
#include <mutex>
#include <random>
#include <thread>

#include "kestrel/runtime/communicator.h"
#include "kestrel/runtime/dtype.h"
#include "support/errors.h"

namespace kestrel {
namespace {

using testing::error_of;
using testing::expect_has;

// Runs fn(comm) on one thread per rank; returns each rank's error message ("" when it succeeded).
// A rank that throws aborts the group, as the trainer does, so the others do not wait for the timeout.
std::vector<std::string> run_ranks(int world, const std::function<void(Communicator&)>& fn,
                                   std::chrono::milliseconds timeout = std::chrono::seconds(20)) {
  auto group = make_inprocess_group(world, CommOptions{timeout});
  std::vector<std::string> errors(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r)
    threads.emplace_back([&, r] {
      try {
        fn(*group[r]);
      } catch (const std::exception& e) {
        errors[r] = e.what();
        group[r]->abort(e.what());
      }
    });
  for (auto& t : threads) t.join();
  return errors;
}

void expect_no_errors(const std::vector<std::string>& errors) {
  for (size_t r = 0; r < errors.size(); ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

uint64_t fresh_seed() {
  const uint64_t s = std::random_device{}();
  std::printf("seed %llu\n", static_cast<unsigned long long>(s));
  return s;
}

// Per-rank random tensors of `n` elements.
std::vector<Tensor> random_inputs(int world, int64_t n, DType dt, std::mt19937_64& rng) {
  std::normal_distribution<float> d(0.f, 1.f);
  std::vector<Tensor> out;
  for (int r = 0; r < world; ++r) {
    std::vector<float> v(n);
    for (auto& x : v) x = d(rng);
    out.push_back(Tensor::from_vector(v, {n}, DType::F32).to(dt));
  }
  return out;
}

// The reference: rank-order f32 sum (f64 for f64), the mean divides it, rounded once to the dtype;
// the max is the largest value (NaN when any is NaN).
double max_or_nan(double a, double b) { return std::isnan(a) || std::isnan(b) ? std::nan("") : std::max(a, b); }

Tensor serial_reduce(const std::vector<Tensor>& in, ReduceOp op) {
  const int world = static_cast<int>(in.size());
  const int64_t n = in[0].numel();
  std::vector<std::vector<double>> v;
  for (const auto& t : in) v.push_back(t.to_double_vector());
  std::vector<double> out(n);
  for (int64_t i = 0; i < n; ++i) {
    if (in[0].dtype() == DType::F64) {
      double acc = v[0][i];
      for (int r = 1; r < world; ++r) acc = op == ReduceOp::Max ? max_or_nan(acc, v[r][i]) : acc + v[r][i];
      out[i] = op == ReduceOp::Avg ? acc / world : acc;
    } else {
      float acc = static_cast<float>(v[0][i]);
      for (int r = 1; r < world; ++r) {
        const float x = static_cast<float>(v[r][i]);
        acc = op == ReduceOp::Max ? static_cast<float>(max_or_nan(acc, x)) : acc + x;
      }
      out[i] = op == ReduceOp::Avg ? acc / static_cast<float>(world) : acc;
    }
  }
  Tensor t = Tensor::empty({n}, DType::F64);
  std::memcpy(t.data_ptr(), out.data(), n * sizeof(double));
  return t.to(in[0].dtype());
}

void expect_bitwise(const Tensor& got, const Tensor& want, const std::string& what) {
  ASSERT_EQ(got.nbytes(), want.nbytes()) << what;
  ASSERT_EQ(std::memcmp(got.data_ptr(), want.data_ptr(), got.nbytes()), 0) << what;
}

struct Case {
  int world;
  int64_t n;
};

TEST(InProcessComm, AllReduceEqualsSerialReferenceBitwise) {
  std::mt19937_64 rng(fresh_seed());
  for (Case c : {Case{1, 5}, Case{2, 1}, Case{2, 1000}, Case{3, 7}, Case{3, 1001}, Case{4, 4099}, Case{5, 13}})
    for (DType dt : {DType::F32, DType::BF16, DType::F64})
      for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max}) {
        auto in = random_inputs(c.world, c.n, dt, rng);
        Tensor want = serial_reduce(in, op);
        // The reference against an f64 sum: it is the reduction it claims to be.
        if (dt == DType::F32) {
          for (int64_t i = 0; i < c.n; ++i) {
            double s = 0;
            for (const auto& t : in) s += t.data<float>()[i];
            if (op == ReduceOp::Avg) s /= c.world;
            if (op == ReduceOp::Max) {
              s = -INFINITY;
              for (const auto& t : in) s = std::max(s, static_cast<double>(t.data<float>()[i]));
            }
            ASSERT_NEAR(want.data<float>()[i], s, 1e-5 * (1 + std::fabs(s)));
          }
        }
        std::vector<Tensor> got(c.world);
        for (int r = 0; r < c.world; ++r) got[r] = in[r].clone();
        expect_no_errors(run_ranks(c.world, [&](Communicator& comm) { comm.all_reduce(got[comm.rank()], op); }));
        for (int r = 0; r < c.world; ++r)
          expect_bitwise(got[r], want, "world " + std::to_string(c.world) + " n " + std::to_string(c.n) + " " +
                                           std::string(dtype_name(dt)) + " rank " + std::to_string(r));
      }
}

// The max of the FP8 amax reduction: the largest value, whichever rank holds it; a NaN anywhere wins
// (an infinity is a value like any other), so every rank receives the same result.
TEST(InProcessComm, MaxTakesTheLargestValueAndNanWins) {
  const float nan = std::nanf(""), inf = INFINITY;
  std::vector<Tensor> got = {Tensor::from_vector(std::vector<float>{1.f, -3.f, 0.f, nan, 2.f}, {5}),
                             Tensor::from_vector(std::vector<float>{0.5f, -2.f, inf, 1.f, 2.f}, {5}),
                             Tensor::from_vector(std::vector<float>{4.f, -5.f, 1.f, 1.f, nan}, {5})};
  expect_no_errors(run_ranks(3, [&](Communicator& comm) { comm.all_reduce(got[comm.rank()], ReduceOp::Max); }));
  for (int r = 0; r < 3; ++r) {
    const std::vector<float> v = got[r].to_float_vector();
    EXPECT_EQ(v[0], 4.f);
    EXPECT_EQ(v[1], -2.f);
    EXPECT_EQ(v[2], inf);
    EXPECT_TRUE(std::isnan(v[3]));
    EXPECT_TRUE(std::isnan(v[4]));
  }
}

TEST(InProcessComm, ReduceScatterAllGatherBroadcastBarrier) {
  std::mt19937_64 rng(fresh_seed());
  for (Case c : {Case{1, 3}, Case{2, 5}, Case{3, 1}, Case{3, 37}, Case{4, 129}, Case{5, 2}}) {
    const int w = c.world;
    const int64_t n = c.n;
    auto whole = random_inputs(w, w * n, DType::F32, rng);  // reduce_scatter inputs
    auto parts = random_inputs(w, n, DType::F32, rng);      // all_gather inputs
    auto bcast = random_inputs(w, n, DType::F32, rng);
    const int root = w - 1;
    std::vector<Tensor> rs(w), ag(w), bc(w);
    for (int r = 0; r < w; ++r) {
      rs[r] = Tensor::zeros({n});
      ag[r] = Tensor::zeros({w * n});
      bc[r] = bcast[r].clone();
    }
    expect_no_errors(run_ranks(w, [&](Communicator& comm) {
      const int r = comm.rank();
      comm.reduce_scatter(whole[r], rs[r], ReduceOp::Avg);
      comm.barrier();
      comm.all_gather(parts[r], ag[r]);
      comm.broadcast(bc[r], root);
    }));
    Tensor reduced = serial_reduce(whole, ReduceOp::Avg);
    for (int r = 0; r < w; ++r) {
      expect_bitwise(rs[r], reduced.narrow_view(0, r * n, n).contiguous(), "reduce_scatter rank " + std::to_string(r));
      for (int q = 0; q < w; ++q)
        expect_bitwise(ag[r].narrow_view(0, q * n, n).contiguous(), parts[q], "all_gather rank " + std::to_string(r));
      expect_bitwise(bc[r], bcast[root], "broadcast rank " + std::to_string(r));
    }
  }
}

TEST(InProcessComm, ReduceGivesTheRootTheReductionAndLeavesTheOthers) {
  std::mt19937_64 rng(fresh_seed());
  for (Case c : {Case{1, 3}, Case{2, 5}, Case{3, 37}, Case{4, 129}, Case{5, 2}}) {
    const int w = c.world;
    for (DType dt : {DType::F32, DType::BF16}) {
      auto in = random_inputs(w, c.n, dt, rng);
      const int root = static_cast<int>(rng() % static_cast<uint64_t>(w));
      std::vector<Tensor> got(w);
      for (int r = 0; r < w; ++r) got[r] = in[r].clone();
      expect_no_errors(run_ranks(w, [&](Communicator& comm) { comm.reduce(got[comm.rank()], root, ReduceOp::Avg); }));
      expect_bitwise(got[root], serial_reduce(in, ReduceOp::Avg), "reduce root " + std::to_string(root));
      for (int r = 0; r < w; ++r)
        if (r != root) expect_bitwise(got[r], in[r], "reduce non-root " + std::to_string(r));
    }
  }
}

TEST(InProcessComm, ManyCollectivesBackToBackStayConsistent) {
  // Rounds of different sizes reuse the group's scratch: no rank may see another round's values.
  std::mt19937_64 rng(fresh_seed());
  const int w = 3;
  std::vector<std::vector<Tensor>> rounds;
  for (int k = 0; k < 40; ++k) rounds.push_back(random_inputs(w, 1 + (k * 37) % 97, DType::F32, rng));
  std::vector<std::vector<Tensor>> got(rounds.size(), std::vector<Tensor>(w));
  for (size_t k = 0; k < rounds.size(); ++k)
    for (int r = 0; r < w; ++r) got[k][r] = rounds[k][r].clone();
  expect_no_errors(run_ranks(w, [&](Communicator& comm) {
    for (size_t k = 0; k < rounds.size(); ++k) comm.all_reduce(got[k][comm.rank()], ReduceOp::Sum);
  }));
  for (size_t k = 0; k < rounds.size(); ++k) {
    Tensor want = serial_reduce(rounds[k], ReduceOp::Sum);
    for (int r = 0; r < w; ++r) expect_bitwise(got[k][r], want, "round " + std::to_string(k));
  }
}

TEST(InProcessComm, MismatchedCollectivesAreNamedOnEveryRank) {
  auto errors = run_ranks(2, [](Communicator& comm) {
    Tensor t = Tensor::full({4}, 1.0);
    if (comm.rank() == 0) {
      Tensor out = Tensor::zeros({8});
      comm.all_gather(t, out);
    } else {
      comm.broadcast(t, 0);
    }
  });
  for (const auto& e : errors) expect_has(e, {"[comm]", "all_gather", "broadcast"});
  errors = run_ranks(2, [](Communicator& comm) {
    Tensor t = Tensor::full({comm.rank() == 0 ? 4 : 5}, 1.0);
    comm.all_reduce(t, ReduceOp::Sum);
  });
  for (const auto& e : errors) expect_has(e, {"[comm] all_reduce", "4", "5"});
  // reduce: ranks that disagree on the root (a ZeRO-2 bucket's owner) would each leave the sum to
  // the other; named on every rank as broadcast's roots are.
  errors = run_ranks(2, [](Communicator& comm) {
    Tensor t = Tensor::full({4}, 1.0);
    comm.reduce(t, comm.rank(), ReduceOp::Sum);
  });
  for (const auto& e : errors) expect_has(e, {"[comm] reduce", "root 0", "root 1"});
}

TEST(InProcessComm, BadArgumentsAreRefusedNamingTheCollective) {
  auto group = make_inprocess_group(2);
  Communicator& c = *group[0];
  Tensor i64 = Tensor::zeros({4}, DType::I64);
  expect_has(error_of([&] { c.all_reduce(i64, ReduceOp::Sum); }), {"[comm] all_reduce", "i64"});
  Tensor strided = Tensor::zeros({4, 4}).permute_view({1, 0});
  expect_has(error_of([&] { c.all_reduce(strided, ReduceOp::Sum); }), {"[comm] all_reduce", "contiguous"});
  Tensor in = Tensor::zeros({6}), out = Tensor::zeros({2});
  expect_has(error_of([&] { c.reduce_scatter(in, out, ReduceOp::Sum); }), {"[comm] reduce_scatter", "4", "6"});
  expect_has(error_of([&] { c.all_gather(out, in); }), {"[comm] all_gather", "4", "6"});
  expect_has(error_of([&] { c.broadcast(out, 2); }), {"[comm] broadcast", "root 2"});
  expect_has(error_of([] { make_inprocess_group(0); }), {"[comm]", "world size"});
}

TEST(InProcessComm, ADeadRankIsAnErrorNamingItWithinTheTimeout) {
  auto group = make_inprocess_group(3, CommOptions{std::chrono::milliseconds(200)});
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::string> errors(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r)  // rank 2 never calls
    threads.emplace_back([&, r] {
      errors[r] = error_of([&] {
        Tensor t = Tensor::full({3}, 1.0);
        group[r]->all_reduce(t, ReduceOp::Sum);
      });
    });
  for (auto& t : threads) t.join();
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(secs, 2.0);
  for (const auto& e : errors) expect_has(e, {"[comm] all_reduce", "rank(s) 2"});
  // The group is failed from then on: a late collective errors at once instead of waiting again.
  Tensor t = Tensor::full({3}, 1.0);
  expect_has(error_of([&] { group[2]->all_reduce(t, ReduceOp::Sum); }), {"aborted", "timed out"});
}

TEST(InProcessComm, AFailingRankEndsTheCollectiveOnEveryRankWithItsMessage) {
  const auto start = std::chrono::steady_clock::now();
  auto errors = run_ranks(
      4,
      [](Communicator& comm) {
        if (comm.rank() == 2) throw make_error("test", "rank two's data file is missing");
        Tensor t = Tensor::full({3}, 1.0);
        comm.all_reduce(t, ReduceOp::Sum);
      },
      std::chrono::seconds(60));
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 5.0);
  for (int r = 0; r < 4; ++r) expect_has(errors[r], {"rank two's data file is missing"});
  expect_has(errors[0], {"[comm] all_reduce: aborted", "rank 2"});
}

TEST(SingleRankComm, CollectivesAreTheIdentity) {
  auto c = make_single_rank_communicator();
  EXPECT_EQ(c->world_size(), 1);
  std::mt19937_64 rng(fresh_seed());
  Tensor x = random_inputs(1, 9, DType::F32, rng)[0], y = x.clone();
  c->all_reduce(y, ReduceOp::Avg);
  expect_bitwise(y, x, "all_reduce");
  Tensor z = Tensor::zeros({9});
  c->all_gather(x, z);
  expect_bitwise(z, x, "all_gather");
  Tensor i64 = Tensor::zeros({2}, DType::I64);
  expect_has(error_of([&] { c->all_reduce(i64, ReduceOp::Sum); }), {"[comm] all_reduce", "i64"});
}

TEST(NcclComm, UnavailableBuildRefusesByName) {
  if (nccl_available()) GTEST_SKIP() << "NCCL is here (tests/runtime/cuda covers it)";
  // Not built, or built but libnccl.so.2 cannot be loaded: either way an error naming NCCL.
  const std::string e = error_of([] { make_nccl_communicator({}, 0, 1, 0); });
  expect_has(e, {"[comm]"});
  EXPECT_TRUE(e.find("NCCL backend not built") != std::string::npos || e.find("libnccl.so.2") != std::string::npos) << e;
}

}  // namespace
}  // namespace kestrel
