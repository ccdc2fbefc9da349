// How the processes of a multi-process run find each other.
// - The launcher's conventions, read once at start-up: torchrun (RANK, WORLD_SIZE, LOCAL_RANK,
//   MASTER_ADDR, MASTER_PORT) or Slurm (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, with MASTER_ADDR
//   and MASTER_PORT set by the job script). torchrun's variables win when both are present; with
//   neither the run is one process. Missing, malformed or inconsistent values are errors naming the
//   variable ("[launch] RANK=4 is not below WORLD_SIZE=4").
// - A TCP rendezvous (plain POSIX sockets) at MASTER_ADDR:MASTER_PORT: rank 0 listens, every other
//   rank connects (retrying while rank 0 is not up yet) and says who it is; once all have come,
//   rank 0 sends them its payload (the NCCL unique id). Everything happens within a timeout, so a
//   rank that never comes is an error naming it, not a hang. One host or many: the same code.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace kestrel {

struct LaunchEnv {
  std::string source = "none";  // "torchrun", "slurm" or "none" (one process)
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;  // the GPU index on its host
  std::string master_addr;
  int master_port = 0;
};

// Parses the launcher's variables from `vars` (name -> value); throws "[launch] ..." naming the
// variable on a missing, malformed or inconsistent value.
LaunchEnv parse_launch_env(const std::map<std::string, std::string>& vars);
// The same over the process environment (read in runtime/src/environment.cpp, the one place that
// reads it; call it at start-up only).
LaunchEnv launch_env_from_process();

// Rank 0 sends `payload` to every other rank of `world_size` through a TCP rendezvous at
// addr:port and returns it; the other ranks pass an empty payload and return what rank 0 sent.
// Throws "[rendezvous] ..." when a peer does not come, or nothing arrives, within `timeout`. A
// world of one returns `payload` without touching the network (addr and port unused).
std::vector<uint8_t> tcp_rendezvous_broadcast(const std::string& addr, int port, int rank, int world_size,
                                              const std::vector<uint8_t>& payload, std::chrono::milliseconds timeout);

}  // namespace kestrel
