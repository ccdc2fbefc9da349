// The launcher conventions (torchrun, Slurm) and the TCP rendezvous between threads on localhost:
// every rank receives rank 0's payload; a rank that never comes, or a rank 0 that is not there, is
// an error naming it within the timeout.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <chrono>
#include <random>
#include <thread>

#include "kestrel/runtime/rendezvous.h"
#include "support/errors.h"

namespace kestrel {
namespace {

using testing::error_of;
using testing::expect_has;
using Vars = std::map<std::string, std::string>;

TEST(LaunchEnv, NoLauncherIsOneProcess) {
  LaunchEnv e = parse_launch_env({});
  EXPECT_EQ(e.source, "none");
  EXPECT_EQ(e.world_size, 1);
  EXPECT_EQ(e.rank, 0);
}

TEST(LaunchEnv, TorchrunAndSlurmConventions) {
  LaunchEnv t = parse_launch_env(Vars{{"RANK", "5"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "1"},
                                      {"MASTER_ADDR", "node0"}, {"MASTER_PORT", "29500"}});
  EXPECT_EQ(t.source, "torchrun");
  EXPECT_EQ(t.rank, 5);
  EXPECT_EQ(t.world_size, 8);
  EXPECT_EQ(t.local_rank, 1);
  EXPECT_EQ(t.master_addr, "node0");
  EXPECT_EQ(t.master_port, 29500);
  LaunchEnv s = parse_launch_env(Vars{{"SLURM_PROCID", "3"}, {"SLURM_NTASKS", "4"}, {"SLURM_LOCALID", "3"},
                                      {"MASTER_ADDR", "10.0.0.1"}, {"MASTER_PORT", "1234"}});
  EXPECT_EQ(s.source, "slurm");
  EXPECT_EQ(s.rank, 3);
  EXPECT_EQ(s.world_size, 4);
  EXPECT_EQ(s.local_rank, 3);
  // torchrun inside an srun allocation: torchrun's variables describe the process.
  LaunchEnv both = parse_launch_env(Vars{{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"LOCAL_RANK", "0"},
                                         {"SLURM_PROCID", "7"}, {"SLURM_NTASKS", "9"}});
  EXPECT_EQ(both.source, "torchrun");
  EXPECT_EQ(both.world_size, 1);
}

TEST(LaunchEnv, MissingMalformedAndInconsistentValuesNameTheVariable) {
  const Vars ok{{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "1"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "9"}};
  auto without = [&](const char* k) {
    Vars v = ok;
    v.erase(k);
    return v;
  };
  auto with = [&](const char* k, const char* val) {
    Vars v = ok;
    v[k] = val;
    return v;
  };
  expect_has(error_of([&] { parse_launch_env(without("WORLD_SIZE")); }), {"[launch]", "WORLD_SIZE is not set"});
  expect_has(error_of([&] { parse_launch_env(without("RANK")); }), {"[launch]", "RANK is not set"});
  expect_has(error_of([&] { parse_launch_env(without("LOCAL_RANK")); }), {"LOCAL_RANK is not set"});
  expect_has(error_of([&] { parse_launch_env(without("MASTER_ADDR")); }), {"MASTER_ADDR is not set"});
  expect_has(error_of([&] { parse_launch_env(without("MASTER_PORT")); }), {"MASTER_PORT is not set"});
  expect_has(error_of([&] { parse_launch_env(with("RANK", "2")); }), {"RANK=2 is not below WORLD_SIZE=2"});
  expect_has(error_of([&] { parse_launch_env(with("RANK", "one")); }), {"RANK", "'one'"});
  expect_has(error_of([&] { parse_launch_env(with("WORLD_SIZE", "0")); }), {"WORLD_SIZE", "'0'"});
  expect_has(error_of([&] { parse_launch_env(with("MASTER_PORT", "70000")); }), {"MASTER_PORT", "70000"});
  expect_has(error_of([&] { parse_launch_env(with("LOCAL_RANK", "-1")); }), {"LOCAL_RANK"});
  expect_has(error_of([&] { parse_launch_env(Vars{{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_LOCALID", "0"}}); }),
             {"MASTER_ADDR is not set", "slurm", "scontrol"});
  expect_has(error_of([&] { parse_launch_env(Vars{{"SLURM_PROCID", "2"}, {"SLURM_NTASKS", "3"}, {"SLURM_LOCALID", "3"}}); }),
             {"SLURM_LOCALID=3 exceeds SLURM_PROCID=2"});
}

// A port that was free a moment ago (the kernel's choice for port 0).
int free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  socklen_t len = sizeof a;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return ntohs(a.sin_port);
}

TEST(TcpRendezvous, EveryRankReceivesRankZerosPayload) {
  std::mt19937 rng(std::random_device{}());
  std::vector<uint8_t> id(128);
  for (auto& b : id) b = static_cast<uint8_t>(rng());
  for (int world : {1, 2, 4}) {
    const int port = free_port();
    std::vector<std::vector<uint8_t>> got(world);
    std::vector<std::string> errors(world);
    std::vector<std::thread> threads;
    // Ranks start out of order: the joiners retry until rank 0 listens.
    for (int r = world - 1; r >= 0; --r)
      threads.emplace_back([&, r] {
        try {
          if (r == 0) std::this_thread::sleep_for(std::chrono::milliseconds(100));
          got[r] = tcp_rendezvous_broadcast("127.0.0.1", port, r, world, r == 0 ? id : std::vector<uint8_t>{},
                                            std::chrono::seconds(10));
        } catch (const std::exception& e) {
          errors[r] = e.what();
        }
      });
    for (auto& t : threads) t.join();
    for (int r = 0; r < world; ++r) {
      EXPECT_EQ(errors[r], "") << "world " << world << " rank " << r;
      EXPECT_EQ(got[r], id) << "world " << world << " rank " << r;
    }
  }
}

TEST(TcpRendezvous, AMissingRankOrAbsentRankZeroIsAnErrorWithinTheTimeout) {
  const int port = free_port();
  std::string e0, e1;
  const auto start = std::chrono::steady_clock::now();
  std::thread a([&] {
    e0 = error_of([&] { tcp_rendezvous_broadcast("127.0.0.1", port, 0, 3, {1, 2, 3}, std::chrono::milliseconds(400)); });
  });
  std::thread b([&] {
    e1 = error_of([&] { tcp_rendezvous_broadcast("127.0.0.1", port, 1, 3, {}, std::chrono::milliseconds(400)); });
  });
  a.join();
  b.join();
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 3.0);
  expect_has(e0, {"[rendezvous] rank 0", "timed out", "rank(s) 2 of 3"});
  expect_has(e1, {"[rendezvous] rank 1"});
  // A world of one needs no address or port (a single process without MASTER_PORT).
  EXPECT_EQ(tcp_rendezvous_broadcast("", 0, 0, 1, {7, 8}, std::chrono::milliseconds(1)), (std::vector<uint8_t>{7, 8}));
  // Nobody listening at all.
  const int lonely = free_port();
  expect_has(error_of([&] { tcp_rendezvous_broadcast("127.0.0.1", lonely, 1, 2, {}, std::chrono::milliseconds(200)); }),
             {"[rendezvous] rank 1", "no connection to rank 0 at 127.0.0.1:"});
  expect_has(error_of([&] { tcp_rendezvous_broadcast("127.0.0.1", lonely, 2, 2, {}, std::chrono::milliseconds(200)); }),
             {"rank 2 is not a rank of a group of 2"});
}

}  // namespace
}  // namespace kestrel
