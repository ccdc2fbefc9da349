#include "kestrel/runtime/parse_number.h"

#include <charconv>

#include "kestrel/runtime/error.h"
#include "kestrel/runtime/memory_budget.h"

namespace kestrel {

std::string integer_range_text(int64_t min, int64_t max) {
  constexpr int64_t lo = std::numeric_limits<int64_t>::min(), hi = std::numeric_limits<int64_t>::max();
  if (min == lo && max == hi) return "an integer";
  if (max == hi) return "an integer >= " + std::to_string(min);
  if (min == lo) return "an integer <= " + std::to_string(max);
  return "an integer in [" + std::to_string(min) + ", " + std::to_string(max) + "]";
}

int64_t parse_integer(std::string_view text, std::string_view what, int64_t min, int64_t max, const char* component) {
  int64_t v = 0;
  const char* first = text.data();
  const char* last = text.data() + text.size();
  // from_chars takes '-' but not '+' or spaces, and reports overflow: all three are what we want.
  auto [ptr, ec] = std::from_chars(first, last, v);
  const bool ok = !text.empty() && ec == std::errc() && ptr == last;
  KESTREL_CHECK(ok && v >= min && v <= max, component, what, ": expected ", integer_range_text(min, max), ", got '",
                text, "'", ec == std::errc::result_out_of_range ? " (out of range)" : "");
  return v;
}

int64_t parse_size(std::string_view text, std::string_view what, int64_t min, int64_t max, const char* component) {
  int64_t v = 0;
  try {
    v = parse_bytes(text);
  } catch (const Error& e) {
    throw make_error(component, what, ": ", e.what());
  }
  KESTREL_CHECK(v >= min && v <= max, component, what, ": ", text, " is ", v, " bytes; expected ",
                max == std::numeric_limits<int64_t>::max() ? "at least " + format_bytes(min)
                                                           : "between " + format_bytes(min) + " and " + format_bytes(max));
  return v;
}

}  // namespace kestrel
