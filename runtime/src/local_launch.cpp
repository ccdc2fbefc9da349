// N worker processes on one host with torchrun's variables; the first failure ends the others
// (local_launch.h states the policy).
#include "kestrel/runtime/local_launch.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <deque>
#include <optional>

#include "kestrel/runtime/error.h"

namespace kestrel {

namespace {

using Clock = std::chrono::steady_clock;

// SIGTERM / SIGINT / SIGHUP to the launcher while it waits: passed on to the children (a scheduler
// that ends the job's main process must not leave its ranks running).
volatile sig_atomic_t g_signal = 0;
void on_signal(int sig) { g_signal = sig; }

// Installs the handlers for the launch and puts the previous ones back.
class SignalForwarding {
 public:
  SignalForwarding() {
    g_signal = 0;
    struct sigaction sa {};
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    for (size_t i = 0; i < 3; ++i) ::sigaction(kSignals[i], &sa, &old_[i]);
  }
  ~SignalForwarding() {
    for (size_t i = 0; i < 3; ++i) ::sigaction(kSignals[i], &old_[i], nullptr);
  }
  static constexpr int kSignals[3] = {SIGTERM, SIGINT, SIGHUP};

 private:
  struct sigaction old_[3];
};

int free_port(const std::string& addr) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  KESTREL_CHECK(fd >= 0, "launch", "socket: ", std::strerror(errno));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = 0;
  if (::inet_pton(AF_INET, addr.c_str(), &a.sin_addr) != 1) a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 &&
                  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0;
  const int err = errno;
  ::close(fd);
  KESTREL_CHECK(ok, "launch", "cannot find a free port on ", addr, ": ", std::strerror(err));
  return ntohs(a.sin_port);
}

bool launcher_variable(const std::string& kv) {
  for (const char* name : {"RANK=", "WORLD_SIZE=", "LOCAL_RANK=", "MASTER_ADDR=", "MASTER_PORT=", "SLURM_PROCID=",
                           "SLURM_NTASKS=", "SLURM_LOCALID=", "LOCAL_WORLD_SIZE="})
    if (kv.rfind(name, 0) == 0) return true;
  return false;
}

struct Child {
  pid_t pid = -1;
  int err_fd = -1;       // read end of its stderr pipe (-1 once at EOF)
  std::string partial;   // a line not yet ended
  std::deque<std::string> last;  // its last stderr lines
  bool running = false;
};

}  // namespace

LocalLaunchResult launch_local_workers(const LocalLaunchOptions& o) {
  KESTREL_CHECK(o.nproc >= 1, "launch", "--nproc-per-node must be >= 1, got ", o.nproc);
  KESTREL_CHECK(!o.program.empty(), "launch", "no program to start");
  LocalLaunchResult result;
  result.master_port = o.master_port > 0 ? o.master_port : free_port(o.master_addr);
  auto emit = [&](int rank, const std::string& line) {
    if (o.on_stderr_line)
      o.on_stderr_line(rank, line);
    else
      std::fprintf(stderr, "[rank %d] %s\n", rank, line.c_str());
  };

  std::vector<std::string> base;
  for (std::string& kv : process_environment())
    if (!launcher_variable(kv)) base.push_back(std::move(kv));
  std::vector<Child> kids(static_cast<size_t>(o.nproc));
  SignalForwarding forwarding;

  // Ends every running child: SIGTERM now, SIGKILL past the grace period (in the loop below).
  auto terminate_all = [&] {
    for (Child& c : kids)
      if (c.running) ::kill(c.pid, SIGTERM);
  };
  // A start that fails part way: the ranks already started have only just begun (and would wait for
  // the missing one), so SIGKILL them, reap them and close their pipes; a blocking wait after a
  // SIGTERM they ignore would never return.
  auto abandon_started = [&] {
    for (Child& c : kids)
      if (c.running) ::kill(c.pid, SIGKILL);
    for (Child& c : kids) {
      if (c.running) ::waitpid(c.pid, nullptr, 0);
      c.running = false;
      if (c.err_fd >= 0) ::close(c.err_fd);
      c.err_fd = -1;
    }
  };

  for (int r = 0; r < o.nproc; ++r) {
    std::vector<std::string> env = base;
    env.push_back("RANK=" + std::to_string(r));
    env.push_back("LOCAL_RANK=" + std::to_string(r));
    env.push_back("WORLD_SIZE=" + std::to_string(o.nproc));
    env.push_back("LOCAL_WORLD_SIZE=" + std::to_string(o.nproc));
    env.push_back("MASTER_ADDR=" + o.master_addr);
    env.push_back("MASTER_PORT=" + std::to_string(result.master_port));
    std::vector<char*> envp, argv;
    for (std::string& s : env) envp.push_back(s.data());
    envp.push_back(nullptr);
    std::string prog = o.program;
    std::vector<std::string> args = o.args;
    argv.push_back(prog.data());
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);

    int fds[2];
    if (::pipe2(fds, O_CLOEXEC) != 0) {
      const int err = errno;
      abandon_started();
      throw make_error("launch", "pipe for rank ", r, ": ", std::strerror(err));
    }
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, fds[1], 2);  // dup2 clears close-on-exec on fd 2
    pid_t pid = -1;
    const int rc = ::posix_spawn(&pid, prog.c_str(), &fa, nullptr, argv.data(), envp.data());
    posix_spawn_file_actions_destroy(&fa);
    ::close(fds[1]);
    if (rc != 0) {
      ::close(fds[0]);
      abandon_started();
      throw make_error("launch", "cannot start rank ", r, " (", prog, "): ", std::strerror(rc));
    }
    kids[r].pid = pid;
    kids[r].err_fd = fds[0];
    kids[r].running = true;
  }

  std::optional<Clock::time_point> kill_at, drain_until;
  auto take_line = [&](int r, std::string line) {
    Child& c = kids[r];
    c.last.push_back(line);
    if (c.last.size() > 8) c.last.pop_front();
    emit(r, line);
  };
  for (;;) {
    // Forward what the children wrote to stderr.
    std::vector<pollfd> pfds;
    std::vector<int> rank_of;
    for (int r = 0; r < o.nproc; ++r)
      if (kids[r].err_fd >= 0) {
        pfds.push_back({kids[r].err_fd, POLLIN, 0});
        rank_of.push_back(r);
      }
    if (!pfds.empty()) ::poll(pfds.data(), pfds.size(), 50);
    for (size_t i = 0; i < pfds.size(); ++i) {
      if (!(pfds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      Child& c = kids[rank_of[i]];
      char buf[4096];
      const ssize_t n = ::read(c.err_fd, buf, sizeof buf);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        if (!c.partial.empty()) take_line(rank_of[i], std::move(c.partial));
        c.partial.clear();
        ::close(c.err_fd);
        c.err_fd = -1;
        continue;
      }
      c.partial.append(buf, static_cast<size_t>(n));
      for (size_t nl; (nl = c.partial.find('\n')) != std::string::npos;) {
        take_line(rank_of[i], c.partial.substr(0, nl));
        c.partial.erase(0, nl + 1);
      }
    }
    // The launcher itself was told to stop: so are the ranks (a failure of none of them).
    if (g_signal != 0 && !kill_at && result.exit_code == 0) {
      result.exit_code = 128 + g_signal;
      result.message = "the launcher received signal " + std::to_string(g_signal) + " and ended every rank";
      terminate_all();
      kill_at = Clock::now() + o.grace;
    }
    // Reap the children that ended; the first failure ends the others.
    bool any_running = false;
    for (int r = 0; r < o.nproc; ++r) {
      Child& c = kids[r];
      if (!c.running) continue;
      int status = 0;
      const pid_t w = ::waitpid(c.pid, &status, WNOHANG);
      if (w == 0) {
        any_running = true;
        continue;
      }
      c.running = false;
      const int code = w < 0 ? 255 : WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      if (code != 0 && result.failed_rank < 0 && result.exit_code == 0) {
        result.failed_rank = r;
        result.exit_code = code;
        terminate_all();
        kill_at = Clock::now() + o.grace;
      }
    }
    if (kill_at && Clock::now() >= *kill_at) {
      for (Child& c : kids)
        if (c.running) ::kill(c.pid, SIGKILL);
      kill_at.reset();
    }
    if (!any_running) {
      bool open = false;
      for (Child& c : kids) open = open || c.err_fd >= 0;
      if (!open) break;
      // Every child is gone; a grandchild it left may hold a pipe open: drain for a moment, no longer.
      if (!drain_until) drain_until = Clock::now() + std::chrono::milliseconds(200);
      if (Clock::now() >= *drain_until) break;
    }
    if (pfds.empty() && any_running) ::usleep(20000);
  }
  for (Child& c : kids)
    if (c.err_fd >= 0) ::close(c.err_fd);
  if (result.failed_rank >= 0)
    for (const std::string& l : kids[result.failed_rank].last) result.message += (result.message.empty() ? "" : "\n") + l;
  return result;
}

LaunchReport launch_report(const LocalLaunchResult& r, int nproc) {
  LaunchReport rep;
  if (r.exit_code == 0 && r.failed_rank < 0) return rep;
  rep.exit_status = r.exit_code == 0 ? 1 : r.exit_code;
  if (r.failed_rank >= 0)
    rep.message = "kestrel-train: rank " + std::to_string(r.failed_rank) + " of " + std::to_string(nproc) +
                  " failed (exit code " + std::to_string(r.exit_code) + "); the other ranks were ended. Its last lines:\n" +
                  r.message;
  else
    rep.message = "kestrel-train: " + r.message + " (exit code " + std::to_string(rep.exit_status) + ")";
  return rep;
}

}  // namespace kestrel
