#include "kestrel/runtime/storage.h"

namespace kestrel {

Storage::Storage(size_t bytes, Device device, MemoryTag tag, StreamHandle stream)
    : alloc_(allocator_for(device).allocate(bytes, tag, stream)) {}

Storage::Storage(void* data, size_t bytes, Device device, std::shared_ptr<void> keep_alive)
    : owned_(false), keep_alive_(std::move(keep_alive)) {
  alloc_.ptr = data;
  alloc_.bytes = bytes;
  alloc_.device = device;
  alloc_.tag = MemoryTag::External;
}

Storage::~Storage() {
  if (owned_ && (alloc_.ptr || alloc_.bytes)) allocator_for(alloc_.device).deallocate(alloc_);
}

}  // namespace kestrel
