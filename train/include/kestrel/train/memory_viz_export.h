// Export of a memory trace in the format of PyTorch's memory snapshots (torch.cuda.memory._snapshot()),
// which pytorch.org/memory_viz and torch/cuda/_memory_viz.py read, so users can reuse that viewer.
//
// memory_snapshot.pickle (pickle protocol 2) holds the dict
//   {'segments': [segment...], 'device_traces': [[entry...] per device index], 'kestrel': {...}}
// entry:   {'action': 'segment_alloc' | 'alloc' | 'free_requested' | 'free_completed' | 'segment_free'
//           | 'oom', 'addr': int, 'size': int, 'stream': 0, 'time_us': int, 'frames': [frame...]}
//          ('oom' also carries 'device_free': bytes left under the budget, 0 without one)
// frame:   {'filename': str, 'line': 0, 'name': str}: the first frame names the module label that
//          made the allocation (MemoryLabelScope, e.g. "decoder.layer.3.mlp") and its tag
//          ("activation"), the second the phase it happened in ("backward", "region:...:forward").
// segment: {'device', 'address', 'total_size', 'allocated_size', 'active_size', 'requested_size',
//           'stream', 'segment_type', 'frames', 'blocks': [{'address', 'size', 'requested_size',
//           'state': 'active_allocated', 'frames'}]}: the blocks live at the end of the trace.
// Our trace records block addresses but not segment addresses, so every allocation gets its own
// segment (a segment_alloc before its alloc, a segment_free after its free): the timelines of
// allocations are exact, the "cached segment" views show in-use memory, not what the caching
// allocator reserved (memory.html draws reserved). Blocks live before the log started and still
// live at its end (the parameters, when the trainer logs one step) appear as one block per tag at
// addresses above every real one, labelled "(allocated before the trace started)".
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kestrel/runtime/memory_trace.h"

namespace kestrel::train {

struct MemoryVizTrace {
  enum class Action : uint8_t { SegmentAlloc, Alloc, FreeRequested, FreeCompleted, SegmentFree, Oom };
  struct Frame {
    std::string label, tag, phase;
  };
  struct Entry {
    Action action{};
    int64_t addr = 0, size = 0, time_us = 0;
    int32_t frame = 0;
    int64_t device_free = 0;  // oom only
  };
  struct Block {
    int64_t addr = 0, size = 0;
    int32_t frame = 0;
  };
  int device_index = 0;
  std::vector<Frame> frames;          // distinct (label, tag, phase)
  std::vector<Entry> entries;         // in time order
  std::vector<Block> live_at_end;     // sorted by address
  bool empty() const { return entries.empty() && live_at_end.empty(); }
};

std::string_view viz_action_name(MemoryVizTrace::Action a);

// `start`: the trace snapshot when logging began (its tag currents are the blocks already live);
// `end`: the snapshot at the end; `budget` (0 = none) sizes an oom entry's device_free.
MemoryVizTrace build_memory_viz_trace(const std::vector<MemoryEvent>& events, const MemorySnapshot& start,
                                      const MemorySnapshot& end, int64_t budget = 0);

// The pickle bytes of the snapshot dict above.
std::string memory_viz_pickle(const MemoryVizTrace& trace);

// Writes DIR/memory_snapshot.pickle; returns its path.
std::string write_memory_viz(const MemoryVizTrace& trace, const std::string& dir);

}  // namespace kestrel::train
