// Launcher conventions and the TCP rendezvous (see rendezvous.h). The wire protocol is tiny and
// fixed-width, little-endian: a peer sends {magic "KSTR", version 1, rank, world_size} (4 x u32);
// rank 0, once every rank 1..N-1 has said hello, answers each with {payload length (u32), payload}.
// Every socket operation waits with poll() against one deadline, so nothing blocks past the timeout.
#include "kestrel/runtime/rendezvous.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "kestrel/runtime/error.h"
#include "kestrel/runtime/parse_number.h"


namespace kestrel {

namespace {

using Clock = std::chrono::steady_clock;

int env_int(const std::map<std::string, std::string>& vars, const char* name, int64_t min, int64_t max) {
  auto it = vars.find(name);
  if (it == vars.end()) throw make_error("launch", name, " is not set");
  return static_cast<int>(parse_integer(it->second, name, min, max, "launch"));
}

std::string env_str(const std::map<std::string, std::string>& vars, const char* name) {
  auto it = vars.find(name);
  return it == vars.end() ? std::string() : it->second;
}

}  // namespace

LaunchEnv parse_launch_env(const std::map<std::string, std::string>& vars) {
  LaunchEnv env;
  const bool torchrun = vars.count("RANK") || vars.count("WORLD_SIZE");
  const bool slurm = vars.count("SLURM_PROCID");
  if (!torchrun && !slurm) return env;
  const char* rank_var = torchrun ? "RANK" : "SLURM_PROCID";
  const char* world_var = torchrun ? "WORLD_SIZE" : "SLURM_NTASKS";
  const char* local_var = torchrun ? "LOCAL_RANK" : "SLURM_LOCALID";
  env.source = torchrun ? "torchrun" : "slurm";
  env.world_size = env_int(vars, world_var, 1, 1 << 20);
  env.rank = env_int(vars, rank_var, 0, 1 << 20);
  KESTREL_CHECK(env.rank < env.world_size, "launch", rank_var, "=", env.rank, " is not below ", world_var, "=",
                env.world_size);
  env.local_rank = env_int(vars, local_var, 0, 1 << 20);
  KESTREL_CHECK(env.local_rank <= env.rank, "launch", local_var, "=", env.local_rank, " exceeds ", rank_var, "=",
                env.rank, " (a process's index on its host cannot exceed its global rank)");
  env.master_addr = env_str(vars, "MASTER_ADDR");
  if (env.world_size > 1) {
    KESTREL_CHECK(!env.master_addr.empty(), "launch", "MASTER_ADDR is not set (", env.source,
                  " run of ", env.world_size, " processes: set it to rank 0's host name or address",
                  slurm && !torchrun ? ", e.g. the first of `scontrol show hostnames $SLURM_JOB_NODELIST`" : "", ")");
    env.master_port = env_int(vars, "MASTER_PORT", 1, 65535);
  } else if (vars.count("MASTER_PORT")) {
    env.master_port = env_int(vars, "MASTER_PORT", 1, 65535);
  }
  return env;
}

namespace {

struct Socket {
  int fd = -1;
  explicit Socket(int f = -1) : fd(f) {}
  Socket(Socket&& o) noexcept : fd(o.fd) { o.fd = -1; }
  Socket& operator=(Socket&& o) noexcept {
    std::swap(fd, o.fd);
    return *this;
  }
  ~Socket() {
    if (fd >= 0) ::close(fd);
  }
};

int remaining_ms(Clock::time_point deadline) {
  auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return ms < 0 ? 0 : static_cast<int>(std::min<int64_t>(ms, 1 << 30));
}

// Waits for `events` on fd until the deadline; false on timeout.
bool wait_fd(int fd, short events, Clock::time_point deadline) {
  for (;;) {
    pollfd p{fd, events, 0};
    int r = ::poll(&p, 1, remaining_ms(deadline));
    if (r > 0) return true;
    if (r == 0) return false;
    if (errno != EINTR) return false;
  }
}

void send_all(int fd, const void* data, size_t n, Clock::time_point deadline, const std::string& who) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    KESTREL_CHECK(wait_fd(fd, POLLOUT, deadline), "rendezvous", who, ": timed out sending");
    ssize_t k = ::send(fd, p, n, MSG_NOSIGNAL);
    if (k < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    KESTREL_CHECK(k > 0, "rendezvous", who, ": send failed: ", std::strerror(errno));
    p += k;
    n -= static_cast<size_t>(k);
  }
}

void recv_all(int fd, void* data, size_t n, Clock::time_point deadline, const std::string& who) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    KESTREL_CHECK(wait_fd(fd, POLLIN, deadline), "rendezvous", who, ": timed out waiting for data");
    ssize_t k = ::recv(fd, p, n, 0);
    if (k < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    KESTREL_CHECK(k != 0, "rendezvous", who, ": the connection closed early");
    KESTREL_CHECK(k > 0, "rendezvous", who, ": receive failed: ", std::strerror(errno));
    p += k;
    n -= static_cast<size_t>(k);
  }
}

constexpr uint32_t kMagic = 0x5254534b;  // "KSTR"
constexpr uint32_t kVersion = 1;

std::vector<uint8_t> serve(int port, int world, const std::vector<uint8_t>& payload, Clock::time_point deadline,
                           double secs) {
  Socket listener(::socket(AF_INET6, SOCK_STREAM, 0));
  bool v6 = listener.fd >= 0;
  if (!v6) listener = Socket(::socket(AF_INET, SOCK_STREAM, 0));
  KESTREL_CHECK(listener.fd >= 0, "rendezvous", "rank 0: socket failed: ", std::strerror(errno));
  int one = 1, zero = 0;
  ::setsockopt(listener.fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  int rc;
  if (v6) {
    ::setsockopt(listener.fd, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof zero);  // IPv4 peers too
    sockaddr_in6 a{};
    a.sin6_family = AF_INET6;
    a.sin6_addr = in6addr_any;
    a.sin6_port = htons(static_cast<uint16_t>(port));
    rc = ::bind(listener.fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  } else {
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_ANY);
    a.sin_port = htons(static_cast<uint16_t>(port));
    rc = ::bind(listener.fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  }
  KESTREL_CHECK(rc == 0, "rendezvous", "rank 0: cannot listen on port ", port, ": ", std::strerror(errno),
                " (MASTER_PORT taken by another run?)");
  KESTREL_CHECK(::listen(listener.fd, world) == 0, "rendezvous", "rank 0: listen failed: ", std::strerror(errno));
  std::vector<Socket> peers(world);
  int joined = 1;
  while (joined < world) {
    if (!wait_fd(listener.fd, POLLIN, deadline)) {
      std::string missing;
      for (int r = 1; r < world; ++r)
        if (peers[r].fd < 0) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
      throw make_error("rendezvous", "rank 0: timed out after ", secs, " s on port ", port, " waiting for rank(s) ",
                       missing, " of ", world);
    }
    Socket c(::accept(listener.fd, nullptr, nullptr));
    if (c.fd < 0) continue;
    uint32_t hello[4];
    recv_all(c.fd, hello, sizeof hello, deadline, "rank 0");
    KESTREL_CHECK(hello[0] == kMagic && hello[1] == kVersion, "rendezvous",
                  "rank 0: a connection on port ", port, " is not a Kestrel rank (another service on MASTER_PORT?)");
    const int r = static_cast<int>(hello[2]), w = static_cast<int>(hello[3]);
    KESTREL_CHECK(w == world, "rendezvous", "rank 0: rank ", r, " says the world size is ", w, ", rank 0 says ", world);
    KESTREL_CHECK(r >= 1 && r < world, "rendezvous", "rank 0: a peer says it is rank ", r, " of ", world);
    KESTREL_CHECK(peers[r].fd < 0, "rendezvous", "rank 0: two processes say they are rank ", r);
    peers[r] = std::move(c);
    ++joined;
  }
  const uint32_t len = static_cast<uint32_t>(payload.size());
  for (int r = 1; r < world; ++r) {
    send_all(peers[r].fd, &len, sizeof len, deadline, "rank 0");
    send_all(peers[r].fd, payload.data(), payload.size(), deadline, "rank 0");
  }
  return payload;
}

std::vector<uint8_t> join(const std::string& addr, int port, int rank, int world, Clock::time_point deadline,
                          double secs) {
  const std::string who = "rank " + std::to_string(rank);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  std::string last_error = "no attempt";
  for (;;) {
    addrinfo* res = nullptr;
    int g = ::getaddrinfo(addr.c_str(), std::to_string(port).c_str(), &hints, &res);
    if (g != 0) {
      last_error = std::string("cannot resolve MASTER_ADDR '") + addr + "': " + gai_strerror(g);
    } else {
      for (addrinfo* ai = res; ai; ai = ai->ai_next) {
        Socket s(::socket(ai->ai_family, ai->ai_socktype, ai->ai_protocol));
        if (s.fd < 0) continue;
        if (::connect(s.fd, ai->ai_addr, ai->ai_addrlen) != 0) {
          last_error = std::strerror(errno);
          continue;
        }
        ::freeaddrinfo(res);
        const uint32_t hello[4] = {kMagic, kVersion, static_cast<uint32_t>(rank), static_cast<uint32_t>(world)};
        send_all(s.fd, hello, sizeof hello, deadline, who);
        uint32_t len = 0;
        recv_all(s.fd, &len, sizeof len, deadline, who + " (waiting for rank 0 and the other ranks)");
        KESTREL_CHECK(len <= (1u << 20), "rendezvous", who, ": rank 0 announced a payload of ", len, " bytes");
        std::vector<uint8_t> payload(len);
        recv_all(s.fd, payload.data(), len, deadline, who);
        return payload;
      }
      ::freeaddrinfo(res);
    }
    if (Clock::now() >= deadline)
      throw make_error("rendezvous", who, ": no connection to rank 0 at ", addr, ":", port, " within ", secs,
                       " s (", last_error, ")");
    std::this_thread::sleep_for(std::chrono::milliseconds(std::min(50, remaining_ms(deadline) + 1)));
  }
}

}  // namespace

std::vector<uint8_t> tcp_rendezvous_broadcast(const std::string& addr, int port, int rank, int world_size,
                                              const std::vector<uint8_t>& payload, std::chrono::milliseconds timeout) {
  KESTREL_CHECK(world_size >= 1 && rank >= 0 && rank < world_size, "rendezvous", "rank ", rank,
                " is not a rank of a group of ", world_size);
  if (world_size == 1) return payload;  // nobody to meet: no address or port needed
  KESTREL_CHECK(port >= 1 && port <= 65535, "rendezvous", "port ", port, " is not in [1, 65535]");
  const auto deadline = Clock::now() + timeout;
  const double secs = std::chrono::duration<double>(timeout).count();
  if (rank == 0) return serve(port, world_size, payload, deadline, secs);
  KESTREL_CHECK(!addr.empty(), "rendezvous", "rank ", rank, ": no address for rank 0 (MASTER_ADDR)");
  return join(addr, port, rank, world_size, deadline, secs);
}

}  // namespace kestrel
