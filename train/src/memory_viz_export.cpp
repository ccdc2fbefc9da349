// PyTorch memory snapshot export (see memory_viz_export.h for the format and its limits). One pass
// over the event log keeps the live blocks by address (their frames, for the frees), the phase
// stack (the second frame of every entry) and the bytes freed of blocks the log never saw
// allocated (per tag, to size the blocks that were live before the log and still are at its end).
#include "kestrel/train/memory_viz_export.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <unordered_map>

#include "kestrel/runtime/error.h"
#include "kestrel/train/pickle_writer.h"

namespace kestrel::train {

using Action = MemoryVizTrace::Action;

std::string_view viz_action_name(Action a) {
  switch (a) {
    case Action::SegmentAlloc: return "segment_alloc";
    case Action::Alloc: return "alloc";
    case Action::FreeRequested: return "free_requested";
    case Action::FreeCompleted: return "free_completed";
    case Action::SegmentFree: return "segment_free";
    case Action::Oom: return "oom";
  }
  return "unknown";
}

namespace {

constexpr const char* kBeforeTrace = "(allocated before the trace started)";

struct FrameTable {
  std::map<std::tuple<std::string, std::string, std::string>, int32_t> ids;
  std::vector<MemoryVizTrace::Frame>* frames;
  int32_t id(const std::string& label, std::string_view tag, const std::string& phase) {
    auto key = std::make_tuple(label.empty() ? std::string("(unlabelled)") : label, std::string(tag), phase);
    auto it = ids.find(key);
    if (it != ids.end()) return it->second;
    const auto n = static_cast<int32_t>(frames->size());
    frames->push_back({std::get<0>(key), std::get<1>(key), std::get<2>(key)});
    ids.emplace(std::move(key), n);
    return n;
  }
};

}  // namespace

MemoryVizTrace build_memory_viz_trace(const std::vector<MemoryEvent>& events, const MemorySnapshot& start,
                                      const MemorySnapshot& end, int64_t budget) {
  MemoryVizTrace t;
  t.device_index = end.device.is_cuda() ? end.device.index : 0;
  FrameTable table{{}, &t.frames};
  struct Live {
    int64_t size;
    int32_t frame;
  };
  std::unordered_map<int64_t, Live> live;
  std::array<int64_t, kNumMemoryTags> freed_unseen{};
  std::vector<std::string> phases;
  int64_t top = 0;  // highest address + size seen
  t.entries.reserve(events.size() * 2);
  auto push = [&](Action a, int64_t addr, int64_t size, int64_t time_ns, int32_t frame) {
    t.entries.push_back({a, addr, size, time_ns / 1000, frame, 0});
  };
  for (const MemoryEvent& e : events) {
    const auto addr = static_cast<int64_t>(reinterpret_cast<uintptr_t>(e.address));
    const std::string phase = phases.empty() ? std::string() : phases.back();
    switch (e.kind) {
      case MemoryEventKind::PhaseBegin:
        phases.push_back(e.label);
        break;
      case MemoryEventKind::PhaseEnd:
        if (!phases.empty()) phases.pop_back();
        break;
      case MemoryEventKind::Alloc: {
        if (e.bytes <= 0) break;
        const int32_t f = table.id(e.label, tag_name(e.tag), phase);
        push(Action::SegmentAlloc, addr, e.bytes, e.time_ns, f);
        push(Action::Alloc, addr, e.bytes, e.time_ns, f);
        live[addr] = {e.bytes, f};
        top = std::max(top, addr + e.bytes);
        break;
      }
      case MemoryEventKind::Free: {
        if (e.bytes <= 0) break;
        int32_t f;
        if (auto it = live.find(addr); it != live.end()) {
          f = it->second.frame;
          live.erase(it);
        } else {
          f = table.id(kBeforeTrace, tag_name(e.tag), phase);
          freed_unseen[static_cast<int>(e.tag)] += e.bytes;
        }
        push(Action::FreeRequested, addr, e.bytes, e.time_ns, f);
        push(Action::FreeCompleted, addr, e.bytes, e.time_ns, f);
        push(Action::SegmentFree, addr, e.bytes, e.time_ns, f);
        top = std::max(top, addr + e.bytes);
        break;
      }
      case MemoryEventKind::Oom: {
        const int32_t f = table.id(e.label, tag_name(e.tag), phase);
        push(Action::Oom, 0, e.bytes, e.time_ns, f);
        if (budget > 0) t.entries.back().device_free = std::max<int64_t>(0, budget - e.reserved_after - end.external);
        break;
      }
      default:  // reserve/release carry no address; spill/restore/prefetch have no counterpart
        break;
    }
  }
  for (const auto& [addr, l] : live) t.live_at_end.push_back({addr, l.size, l.frame});
  // Blocks live before the log and still live after it: one per tag, above every real address.
  const int64_t gib = int64_t{1} << 30;
  int64_t next = (top / gib + 2) * gib;
  for (int i = 0; i < kNumMemoryTags; ++i) {
    const auto tag = static_cast<MemoryTag>(i);
    if (tag == MemoryTag::External) continue;  // not the allocator's
    const int64_t bytes = start.tags[i].current - freed_unseen[i];
    if (bytes <= 0) continue;
    t.live_at_end.push_back({next, bytes, table.id(kBeforeTrace, tag_name(tag), "")});
    next += (bytes + gib - 1) / gib * gib + gib;
  }
  std::sort(t.live_at_end.begin(), t.live_at_end.end(), [](const auto& a, const auto& b) { return a.addr < b.addr; });
  return t;
}

std::string memory_viz_pickle(const MemoryVizTrace& t) {
  PickleWriter w;
  std::vector<int64_t> frame_memo(t.frames.size(), -1);
  // Frames lists are shared objects: written once, referenced from the memo afterwards.
  auto frames = [&](int32_t id) {
    if (frame_memo[id] >= 0) {
      w.get(static_cast<uint32_t>(frame_memo[id]));
      return;
    }
    const MemoryVizTrace::Frame& f = t.frames[id];
    w.begin_list();
    w.begin_dict();
    w.key("filename"), w.memo_string(f.label), w.key("line"), w.integer(0), w.key("name"), w.memo_string(f.tag);
    w.end_dict();
    w.begin_dict();
    w.key("filename"), w.memo_string("phase"), w.key("line"), w.integer(0), w.key("name"),
        w.memo_string(f.phase.empty() ? "(none)" : f.phase);
    w.end_dict();
    w.end_list();
    frame_memo[id] = w.memoize();
  };
  w.begin_dict();
  w.key("segments");
  w.begin_list();
  for (const MemoryVizTrace::Block& b : t.live_at_end) {
    w.begin_dict();
    w.key("device"), w.integer(t.device_index);
    w.key("address"), w.integer(b.addr);
    w.key("total_size"), w.integer(b.size);
    w.key("allocated_size"), w.integer(b.size);
    w.key("active_size"), w.integer(b.size);
    w.key("requested_size"), w.integer(b.size);
    w.key("stream"), w.integer(0);
    w.key("segment_type"), w.memo_string(b.size <= (int64_t{1} << 20) ? "small" : "large");
    w.key("frames"), w.begin_list(), w.end_list();
    w.key("blocks");
    w.begin_list();
    w.begin_dict();
    w.key("address"), w.integer(b.addr);
    w.key("size"), w.integer(b.size);
    w.key("requested_size"), w.integer(b.size);
    w.key("state"), w.memo_string("active_allocated");
    w.key("frames"), frames(b.frame);
    w.end_dict();
    w.end_list();
    w.end_dict();
  }
  w.end_list();
  w.key("device_traces");
  w.begin_list();
  for (int d = 0; d <= t.device_index; ++d) {
    w.begin_list();
    if (d == t.device_index) {
      for (const MemoryVizTrace::Entry& e : t.entries) {
        w.begin_dict();
        w.key("action"), w.memo_string(viz_action_name(e.action));
        w.key("addr"), w.integer(e.addr);
        w.key("size"), w.integer(e.size);
        w.key("stream"), w.integer(0);
        w.key("time_us"), w.integer(e.time_us);
        if (e.action == Action::Oom) w.key("device_free"), w.integer(e.device_free);
        w.key("frames"), frames(e.frame);
        w.end_dict();
      }
    }
    w.end_list();
  }
  w.end_list();
  w.key("kestrel");
  w.begin_dict();
  w.key("source"), w.string("kestrel memory trace (train/include/kestrel/train/memory_viz_export.h)");
  w.key("segments"), w.string("one per allocation: the trace records block addresses, not segment addresses");
  w.end_dict();
  w.end_dict();
  return w.finish();
}

std::string write_memory_viz(const MemoryVizTrace& trace, const std::string& dir) {
  std::filesystem::create_directories(dir);
  const std::string path = dir + "/memory_snapshot.pickle";
  std::ofstream f(path, std::ios::binary);
  KESTREL_CHECK(f.good(), "memory-viz", "cannot write ", path);
  const std::string bytes = memory_viz_pickle(trace);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  KESTREL_CHECK(f.good(), "memory-viz", "short write to ", path);
  return path;
}

}  // namespace kestrel::train
