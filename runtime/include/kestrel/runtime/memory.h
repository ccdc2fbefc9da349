// Memory tags: every byte Kestrel allocates belongs to exactly one tag.
//
// The current tag is thread-local and set with a scoped guard, so an op allocating its output
// does not need to know whether it runs in forward (Activation), backward (Gradient) or in the
// optimizer (OptimizerState): the caller's scope decides.
#pragma once

#include <array>
#include <cstdint>
#include <string_view>

namespace kestrel {

enum class MemoryTag : uint8_t {
  Parameter,
  Gradient,
  OptimizerState,
  Activation,
  Checkpoint,
  Workspace,
  Loss,
  Temporary,
  External,
};
inline constexpr int kNumMemoryTags = 9;

constexpr std::string_view tag_name(MemoryTag t) {
  constexpr std::array<std::string_view, kNumMemoryTags> names = {
      "parameter", "gradient", "optimizer_state", "activation", "checkpoint",
      "workspace", "loss",     "temporary",       "external"};
  return names[static_cast<int>(t)];
}

// The tag new allocations on this thread get (Temporary when no scope is active).
MemoryTag current_memory_tag();

class TagScope {
 public:
  explicit TagScope(MemoryTag tag);
  ~TagScope();
  TagScope(const TagScope&) = delete;
  TagScope& operator=(const TagScope&) = delete;

 private:
  MemoryTag saved_;
};

}  // namespace kestrel
