// Byte parsing/formatting and the OutOfBudget report text. (The budget itself lives in the device's
// caching allocator, pushed there by configure_memory: memory_config.cpp.)
#include "kestrel/runtime/memory_budget.h"

#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <map>
#include <sstream>

#include "kestrel/runtime/memory_trace.h"

namespace kestrel {

int64_t device_footprint(Device device) { return memory_trace(device).snapshot().footprint(); }
int64_t device_peak_footprint(Device device) { return memory_trace(device).snapshot().peak_footprint; }

int64_t parse_bytes(std::string_view text) {
  std::string s;
  for (char c : text)
    if (!std::isspace(static_cast<unsigned char>(c))) s.push_back(c);
  size_t i = 0;
  while (i < s.size() && (std::isdigit(static_cast<unsigned char>(s[i])) || s[i] == '.')) ++i;
  KESTREL_CHECK(i > 0, "memory", "cannot parse byte count '", text, "'; expected e.g. 40GiB, 512MiB, 4096");
  double value = 0;
  // The whole numeric part must be one number ("1.2.3" is not 1.2).
  auto [end, ec] = std::from_chars(s.data(), s.data() + i, value);
  KESTREL_CHECK(ec == std::errc() && end == s.data() + i, "memory", "cannot parse byte count '", text,
                "'; expected e.g. 40GiB, 512MiB, 4096");
  std::string unit = s.substr(i);
  for (char& c : unit) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  static const std::map<std::string, double> units = {
      {"", 1.0},          {"b", 1.0},
      {"k", 1024.0},      {"kib", 1024.0},      {"kb", 1e3},
      {"m", 1048576.0},   {"mib", 1048576.0},   {"mb", 1e6},
      {"g", 1073741824.0}, {"gib", 1073741824.0}, {"gb", 1e9},
      {"t", 1099511627776.0}, {"tib", 1099511627776.0}, {"tb", 1e12}};
  auto it = units.find(unit);
  KESTREL_CHECK(it != units.end(), "memory", "unknown unit '", s.substr(i), "' in '", text,
                "'; use B, KiB, MiB, GiB, TiB (binary) or KB, MB, GB, TB (decimal)");
  const double bytes = value * it->second;
  KESTREL_CHECK(bytes < 9.2e18, "memory", "byte count '", text, "' is too large");
  return static_cast<int64_t>(std::llround(bytes));
}

std::string format_bytes(int64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes < 0 ? -bytes : bytes);
  int u = 0;
  while (v >= 1024.0 && u < 4) {
    v /= 1024.0;
    ++u;
  }
  char buf[64];
  if (u == 0)
    std::snprintf(buf, sizeof buf, "%s%lld B", bytes < 0 ? "-" : "", static_cast<long long>(v));
  else
    std::snprintf(buf, sizeof buf, "%s%.2f %s", bytes < 0 ? "-" : "", v, units[u]);
  return buf;
}

std::string OutOfBudgetReport::str() const {
  std::ostringstream os;
  os << "[memory] out of " << (device_full ? "device memory" : "budget") << " on " << device.str()
     << ": request " << format_bytes(request) << " (new segment " << format_bytes(segment) << ")\n";
  os << "  budget " << (budget > 0 ? format_bytes(budget) : std::string("none")) << ", footprint "
     << format_bytes(footprint) << " = reserved " << format_bytes(reserved) << " + external "
     << format_bytes(external) << "\n";
  os << "  reserved " << format_bytes(reserved) << " vs in use " << format_bytes(in_use) << "; cached free "
     << format_bytes(cached_free) << ", largest free block " << format_bytes(largest_free)
     << ", fragmentation " << static_cast<int>(std::lround(fragmentation * 100)) << "%\n";
  os << "  by tag:";
  for (int t = 0; t < kNumMemoryTags; ++t)
    if (tag_bytes[t] != 0) os << " " << tag_name(static_cast<MemoryTag>(t)) << "=" << format_bytes(tag_bytes[t]);
  os << "\n  suggestion: " << suggestion;
  return os.str();
}

OutOfBudget::OutOfBudget(OutOfBudgetReport report) : Error(report.str()), report_(std::move(report)) {}

}  // namespace kestrel
