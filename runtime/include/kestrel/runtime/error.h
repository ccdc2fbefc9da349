// kestrel::Error and the check macros.
//
// Policy: library code never exits. User-facing argument checks are always on and
// throw kestrel::Error whose message starts with the op or component in brackets,
// e.g. "[rms_norm] weight must be 1-D, got 2-D". Library status codes (CUDA,
// cuBLAS, cuDNN, NCCL) are checked by macros in cuda_check.h that report the
// failing expression and file:line.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace kestrel {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

namespace detail {
template <typename... Args>
std::string concat(Args&&... args) {
  std::ostringstream os;
  (os << ... << std::forward<Args>(args));
  return os.str();
}
}  // namespace detail

// Builds "[component] message..." from streamable parts.
template <typename... Args>
[[nodiscard]] Error make_error(const char* component, Args&&... args) {
  return Error(detail::concat("[", component, "] ", std::forward<Args>(args)...));
}

}  // namespace kestrel

// KESTREL_CHECK(cond, "op", parts...): throws kestrel::Error "[op] parts..." when cond is false.
#define KESTREL_CHECK(cond, component, ...)                        \
  do {                                                             \
    if (!(cond)) throw ::kestrel::make_error(component, __VA_ARGS__); \
  } while (0)

// Internal invariant: names the expression and location; still throws, never aborts.
#define KESTREL_ASSERT(cond)                                                              \
  do {                                                                                    \
    if (!(cond))                                                                          \
      throw ::kestrel::make_error("internal", "assertion failed: ", #cond, " at ", __FILE__, \
                                  ":", __LINE__);                                         \
  } while (0)
