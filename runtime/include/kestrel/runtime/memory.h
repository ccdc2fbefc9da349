// Memory tags: every byte Kestrel allocates belongs to exactly one tag.
//
// The current tag is thread-local and set with a scoped guard, so an op allocating its output
// does not need to know whether it runs in forward (Activation), backward (Gradient) or in the
// optimizer (OptimizerState): the caller's scope decides.
#pragma once

#include <array>
#include <cstdint>
#include <string>
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

// Who allocates: a thread-local dotted label ("decoder.layer.3.mlp") that the memory trace attaches
// to alloc events when event logging is on. Scopes nest by appending ".name" (or replace the label
// when `nested` is false, as recompute regions do: their backward re-run happens outside the
// model's scopes). Entering a scope appends to one thread-local string, so it costs a few
// nanoseconds whether or not anything is logged.
const std::string& current_memory_label();

class MemoryLabelScope {
 public:
  explicit MemoryLabelScope(std::string_view name, bool nested = true);
  ~MemoryLabelScope();
  MemoryLabelScope(const MemoryLabelScope&) = delete;
  MemoryLabelScope& operator=(const MemoryLabelScope&) = delete;

 private:
  size_t saved_size_ = 0;
  std::string saved_;  // the whole previous label, only when not nested
  bool nested_;
};

}  // namespace kestrel
