// Storage: one allocation (or a borrowed external buffer) shared by a tensor and its views.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>

#include "kestrel/runtime/allocator.h"

namespace kestrel {

class Storage {
 public:
  // Allocates `bytes` on `device` through allocator_for(device), tagged with the current tag.
  Storage(size_t bytes, Device device, MemoryTag tag, StreamHandle stream = nullptr);
  // Borrows external memory (not freed, not counted) — e.g. a memory-mapped safetensors file.
  // `keep_alive` is held for the storage's lifetime.
  Storage(void* data, size_t bytes, Device device, std::shared_ptr<void> keep_alive);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;

  void* data() const { return alloc_.ptr; }
  size_t bytes() const { return alloc_.bytes; }
  Device device() const { return alloc_.device; }
  MemoryTag tag() const { return alloc_.tag; }
  bool owned() const { return owned_; }
  const Allocation& allocation() const { return alloc_; }

 private:
  Allocation alloc_;
  bool owned_ = true;
  std::shared_ptr<void> keep_alive_;
};

}  // namespace kestrel
