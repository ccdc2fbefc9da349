// Starting N worker processes on this host the way torchrun does (kestrel-train --nproc-per-node):
// each child is `program args...` with RANK, WORLD_SIZE, LOCAL_RANK (= RANK), MASTER_ADDR and
// MASTER_PORT set (the launcher variables rendezvous.h reads; Slurm's SLURM_PROCID / SLURM_NTASKS /
// SLURM_LOCALID are removed from the children's environment so they cannot disagree). Policy:
// - the children's stdout is the parent's; their stderr comes through a pipe, line by line, to
//   `on_stderr_line` (default: the parent's stderr with a "[rank R] " prefix), and the last lines of
//   each rank are kept for the failure message;
// - the first child to end with a non-zero status or a signal fails the launch: the others get
//   SIGTERM, and SIGKILL after `grace`; the launch returns once every child is reaped, with the
//   failed rank, its exit code (128 + signal for a signal) and its last stderr lines;
// - SIGTERM, SIGINT or SIGHUP to the launcher while it waits ends every rank the same way (the
//   result then names no failed rank, exit code 128 + the signal);
// - MASTER_PORT 0 picks a free port (bind to port 0 on MASTER_ADDR, then release it).
// Spawning errors are kestrel::Error "[launch] ..."; no process is left running on any path.
#pragma once

#include <chrono>
#include <functional>
#include <string>
#include <vector>

namespace kestrel {

struct LocalLaunchOptions {
  std::string program;            // an absolute path (kestrel-train passes /proc/self/exe)
  std::vector<std::string> args;  // argv[1...]
  int nproc = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 0;  // 0: a free port
  std::chrono::milliseconds grace{std::chrono::seconds(10)};
  std::function<void(int rank, const std::string& line)> on_stderr_line;  // null: "[rank R] line" on stderr
};

struct LocalLaunchResult {
  int exit_code = 0;     // 0 when every rank succeeded; else the failed rank's (128 + signal), or
                         // 128 + the signal the launcher received
  int failed_rank = -1;  // the first rank that failed, -1 if none
  std::string message;   // its last stderr lines (up to 8)
  int master_port = 0;   // the port the ranks were given
};

LocalLaunchResult launch_local_workers(const LocalLaunchOptions& options);

// What the launcher itself reports for `r` (kestrel-train --nproc-per-node): its exit status, 0
// only when every rank succeeded (else the failed rank's code, or 128 + the signal the launcher
// received, so a scheduler that stopped the job does not see success), and a message for stderr
// ("" on success).
struct LaunchReport {
  int exit_status = 0;
  std::string message;
};
LaunchReport launch_report(const LocalLaunchResult& r, int nproc);

// The process environment as NAME=VALUE strings (read in runtime/src/environment.cpp, the one
// place that reads it), for handing to a child process.
std::vector<std::string> process_environment();

}  // namespace kestrel
