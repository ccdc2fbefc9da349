// The thread-local memory tag and allocation label scopes (see memory.h).
#include "kestrel/runtime/memory.h"

namespace kestrel {
namespace {
thread_local MemoryTag t_current_tag = MemoryTag::Temporary;
thread_local std::string t_label;
}  // namespace
MemoryTag current_memory_tag() { return t_current_tag; }
TagScope::TagScope(MemoryTag tag) : saved_(t_current_tag) { t_current_tag = tag; }
TagScope::~TagScope() { t_current_tag = saved_; }

const std::string& current_memory_label() { return t_label; }

MemoryLabelScope::MemoryLabelScope(std::string_view name, bool nested) : nested_(nested) {
  if (nested_) {
    saved_size_ = t_label.size();
    if (!t_label.empty() && !name.empty()) t_label.push_back('.');
    t_label.append(name);
  } else {
    saved_ = std::move(t_label);
    t_label.assign(name);
  }
}

MemoryLabelScope::~MemoryLabelScope() {
  if (nested_)
    t_label.resize(saved_size_);
  else
    t_label = std::move(saved_);
}

}  // namespace kestrel
