// Device time per op over a stretch of work: the step's breakdown by kernel family
// (kestrel-train's `profile_step`). While an OpProfile records, every op's kernel dispatch (the ops
// layer's registry) is bracketed by two timestamps on the current stream of the op's device (CUDA
// events; the host clock on the CPU, where kernels run synchronously) and attributed to the
// outermost op only, under the op's name. Only the thread that called start() is recorded (the one
// that runs the step; ops on other threads are not timed and cannot race with stop()). stop() waits for the device and sums per name; what the
// sum leaves of the wall time is launch gaps, host waits and copies outside ops. Not recording, a
// dispatch costs one atomic load.
#pragma once

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "kestrel/runtime/device.h"

namespace kestrel {

struct OpTime {
  std::string op;
  int64_t calls = 0;
  double ms = 0;
};

class OpProfile {
 public:
  OpProfile() = default;
  ~OpProfile();  // stops recording (its results are dropped)
  OpProfile(const OpProfile&) = delete;
  OpProfile& operator=(const OpProfile&) = delete;

  // Becomes the process's recording profile; an error while another one records.
  void start();
  // Stops recording, waits for the devices that ran ops and sums the time per op.
  void stop();
  // Per op name, by total time (descending); valid after stop().
  const std::vector<OpTime>& ops() const { return ops_; }
  double total_ms() const;

  // The recording profile, or null.
  static OpProfile* recording() noexcept;

  // The bracket around one dispatch (RAII; nested brackets are not recorded).
  class Bracket {
   public:
    Bracket(const char* op, Device device);
    ~Bracket();
    Bracket(const Bracket&) = delete;
    Bracket& operator=(const Bracket&) = delete;

   private:
    OpProfile* profile_ = nullptr;
    size_t mark_ = 0;
    bool counted_ = false;
  };

 private:
  struct Mark {
    const char* op;  // a string literal of the op's name
    Device device;
    void* begin = nullptr;  // device timestamps (CUDA events)
    void* end = nullptr;
    double host_ms = -1;    // CPU: the host clock's interval
    int64_t host_start_ns = 0;
  };
  size_t begin(const char* op, Device device);
  void end(size_t mark);
  void release();

  std::mutex mu_;
  std::vector<Mark> marks_;
  std::vector<OpTime> ops_;
  bool started_ = false;
  std::thread::id owner_;  // the thread that called start()
};

}  // namespace kestrel
