// launch_local_workers (kestrel-train --nproc-per-node) with /bin/sh as a tiny fake child: every
// rank gets torchrun's variables; the first failing rank ends the others (SIGTERM, then SIGKILL
// past the grace period for one that ignores it) and its exit code and last stderr lines come back;
// stderr lines are forwarded per rank; a SIGTERM to the launcher ends every rank; a program that
// cannot start is an error.
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <thread>

#include <fcntl.h>
#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include "kestrel/runtime/error.h"
#include "kestrel/runtime/local_launch.h"

namespace kestrel {
namespace {

std::string temp_dir(const std::string& name) {
  const auto d = std::filesystem::temp_directory_path() /
                 ("kestrel_launch_" + name + "_" + std::to_string(::getpid()));
  std::filesystem::remove_all(d);
  std::filesystem::create_directories(d);
  return d.string();
}

LocalLaunchOptions sh(const std::string& script, int nproc) {
  LocalLaunchOptions o;
  o.program = "/bin/sh";
  o.args = {"-c", script};
  o.nproc = nproc;
  o.on_stderr_line = [](int, const std::string&) {};
  return o;
}

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

TEST(LocalLaunch, EveryRankGetsTorchrunsVariables) {
  const std::string dir = temp_dir("vars");
  LocalLaunchOptions o =
      sh("echo \"$RANK $WORLD_SIZE $LOCAL_RANK $MASTER_ADDR $MASTER_PORT ${SLURM_PROCID:-none}\" > " + dir + "/$RANK",
         4);
  const LocalLaunchResult r = launch_local_workers(o);
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_EQ(r.failed_rank, -1);
  EXPECT_GT(r.master_port, 0);
  for (int rank = 0; rank < 4; ++rank) {
    std::ifstream f(dir + "/" + std::to_string(rank));
    std::string line;
    std::getline(f, line);
    EXPECT_EQ(line, std::to_string(rank) + " 4 " + std::to_string(rank) + " 127.0.0.1 " +
                        std::to_string(r.master_port) + " none");
  }
}

TEST(LocalLaunch, TheFirstFailureEndsTheOthersWithItsMessage) {
  const auto start = std::chrono::steady_clock::now();
  std::mutex mu;
  std::map<int, std::vector<std::string>> lines;
  LocalLaunchOptions o = sh("if [ \"$RANK\" = 2 ]; then sleep 0.2; echo \"rank $RANK: [train] out of data\" >&2; "
                            "exit 3; fi; echo \"hello from $RANK\" >&2; exec sleep 30",
                            4);
  o.on_stderr_line = [&](int rank, const std::string& line) {
    std::lock_guard<std::mutex> lock(mu);
    lines[rank].push_back(line);
  };
  const LocalLaunchResult r = launch_local_workers(o);
  EXPECT_LT(seconds_since(start), 10.0) << "the sleeping ranks were not ended";
  EXPECT_EQ(r.failed_rank, 2);
  EXPECT_EQ(r.exit_code, 3);
  EXPECT_NE(r.message.find("rank 2: [train] out of data"), std::string::npos) << r.message;
  for (int rank : {0, 1, 3}) {
    ASSERT_EQ(lines[rank].size(), 1u) << rank;
    EXPECT_EQ(lines[rank][0], "hello from " + std::to_string(rank));
  }
}

TEST(LocalLaunch, ARankThatIgnoresSigtermIsKilledAfterTheGrace) {
  const auto start = std::chrono::steady_clock::now();
  LocalLaunchOptions o = sh("if [ \"$RANK\" = 0 ]; then sleep 0.3; exit 7; fi; trap '' TERM; "
                            "i=0; while [ $i -lt 300 ]; do sleep 0.1; i=$((i+1)); done",
                            2);
  o.grace = std::chrono::milliseconds(500);
  const LocalLaunchResult r = launch_local_workers(o);
  const double secs = seconds_since(start);
  EXPECT_EQ(r.failed_rank, 0);
  EXPECT_EQ(r.exit_code, 7);
  EXPECT_GE(secs, 0.4);
  EXPECT_LT(secs, 10.0);
}

TEST(LocalLaunch, ASignalIsReportedAs128PlusItsNumber) {
  const LocalLaunchResult r = launch_local_workers(sh("if [ \"$RANK\" = 1 ]; then kill -SEGV $$; fi; exit 0", 2));
  EXPECT_EQ(r.failed_rank, 1);
  EXPECT_EQ(r.exit_code, 128 + 11);
}

TEST(LocalLaunch, ASigtermToTheLauncherEndsEveryRank) {
  const auto start = std::chrono::steady_clock::now();
  std::thread killer([] {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    ::kill(::getpid(), SIGTERM);  // the handler is the launcher's while it waits
  });
  const LocalLaunchResult r = launch_local_workers(sh("exec sleep 30", 3));
  killer.join();
  EXPECT_LT(seconds_since(start), 10.0);
  EXPECT_EQ(r.failed_rank, -1);
  EXPECT_EQ(r.exit_code, 128 + SIGTERM);
  EXPECT_NE(r.message.find("signal 15"), std::string::npos) << r.message;
}

// kestrel-train --nproc-per-node exits with launch_report's status: a launcher stopped by a signal
// must not exit 0 (it names no failed rank, yet the ranks were ended).
TEST(LocalLaunch, TheLaunchersReportIsNoSuccessAfterASignalOrAFailure) {
  LocalLaunchResult r;
  EXPECT_EQ(launch_report(r, 2).exit_status, 0);
  EXPECT_EQ(launch_report(r, 2).message, "");
  r.exit_code = 128 + SIGTERM;
  r.message = "the launcher received signal 15 and ended every rank";
  LaunchReport rep = launch_report(r, 2);
  EXPECT_EQ(rep.exit_status, 128 + SIGTERM);
  EXPECT_NE(rep.message.find("signal 15"), std::string::npos) << rep.message;
  r.failed_rank = 1;
  r.exit_code = 3;
  r.message = "boom";
  rep = launch_report(r, 2);
  EXPECT_EQ(rep.exit_status, 3);
  EXPECT_NE(rep.message.find("rank 1 of 2 failed (exit code 3)"), std::string::npos) << rep.message;
  EXPECT_NE(rep.message.find("boom"), std::string::npos) << rep.message;
}

std::set<int> open_fds() {
  std::set<int> listed, fds;
  for (const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) listed.insert(std::stoi(e.path().filename()));
  for (int fd : listed)
    if (::fcntl(fd, F_GETFD) != -1) fds.insert(fd);  // not the listing's own, closed by now
  return fds;
}

// Rank 1 cannot get its stderr pipe (RLIMIT_NOFILE leaves two free descriptors: rank 0's pipe takes
// both, its write end is closed after the spawn, one is not enough): rank 0, which ignores SIGTERM,
// is ended at once, reaped, and its pipe closed; the launch is an error, not a hang.
TEST(LocalLaunch, AStartThatFailsPartWayEndsTheStartedRanks) {
  LocalLaunchOptions o = sh("trap '' TERM; exec sleep 30", 2);
  o.master_port = 29500;  // no port probe (its socket would take a descriptor)
  const std::set<int> before = open_fds();
  rlimit old{};
  ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &old), 0);
  int limit = 0;
  for (int free = 0; free < 2; ++limit)
    if (!before.count(limit)) ++free;
  rlimit lim = old;
  lim.rlim_cur = static_cast<rlim_t>(limit);
  const auto start = std::chrono::steady_clock::now();
  std::string error;
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &lim), 0);
  try {
    launch_local_workers(o);
  } catch (const Error& e) {
    error = e.what();
  }
  ::setrlimit(RLIMIT_NOFILE, &old);
  EXPECT_NE(error.find("pipe for rank 1"), std::string::npos) << error;
  EXPECT_LT(seconds_since(start), 10.0) << "rank 0 ignored SIGTERM and the launcher waited for it";
  EXPECT_EQ(open_fds(), before) << "a started rank's pipe was left open";
}

TEST(LocalLaunch, AProgramThatCannotStartIsAnError) {
  LocalLaunchOptions o = sh("true", 2);
  o.program = "/nonexistent/kestrel-train";
  try {
    launch_local_workers(o);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("[launch] cannot start rank 0"), std::string::npos) << e.what();
  }
  o.program = "/bin/sh";
  o.nproc = 0;
  EXPECT_THROW(launch_local_workers(o), Error);
}

}  // namespace
}  // namespace kestrel
