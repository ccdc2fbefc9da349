#include "kestrel/runtime/memory.h"

namespace kestrel {
namespace {
thread_local MemoryTag t_current_tag = MemoryTag::Temporary;
}
MemoryTag current_memory_tag() { return t_current_tag; }
TagScope::TagScope(MemoryTag tag) : saved_(t_current_tag) { t_current_tag = tag; }
TagScope::~TagScope() { t_current_tag = saved_; }
}  // namespace kestrel
