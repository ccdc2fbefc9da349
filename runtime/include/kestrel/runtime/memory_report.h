// Memory reports of one device for embedding applications and tools: the numbers of
// memory_trace(device).snapshot() (per-tag current/peak, in use, reserved, external, footprint,
// counters) plus the device's budget, as readable text or as a JSON document (a string, so no
// JSON library type appears here). The trainer's memory_report.json carries the same fields.
#pragma once

#include <string>

#include "kestrel/runtime/device.h"
#include "kestrel/runtime/memory_trace.h"

namespace kestrel {

// The device's current statistics (same as memory_trace(device).snapshot()).
MemorySnapshot memory_stats(Device device);

// Multi-line text: one line per tag with bytes held now and at peak, then the totals and budget.
std::string memory_report(Device device);
std::string memory_report(const MemorySnapshot& snapshot, int64_t budget = 0);

// JSON text: {"device", "budget", "in_use", "peak_in_use", "reserved", "peak_reserved", "external",
// "footprint", "peak_footprint", "num_allocs", "num_frees", "num_retries", "num_ooms",
// "tags": {"<tag>": {"current", "peak", "count"}}}.
std::string memory_report_json(Device device);

}  // namespace kestrel
