// Strict parsing of the numbers users type: command-line arguments and config values. One helper
// for every integer and size argument of the binaries (kestrel-train, kestrel-mem, kestrel-grad) and
// the trainer config's integer keys, so "1e12", "abc", "2.5", "-3" or "99999999999999999999" are
// refused with a message naming the argument, never truncated, wrapped or thrown as a raw
// std::invalid_argument.
#pragma once

#include <cstdint>
#include <limits>
#include <string>
#include <string_view>

namespace kestrel {

// A decimal integer: an optional '-', digits only, the whole text, within [min, max]. Throws
// kestrel::Error "[component] <what>: expected an integer in [min, max], got '<text>'".
int64_t parse_integer(std::string_view text, std::string_view what,
                      int64_t min = std::numeric_limits<int64_t>::min(),
                      int64_t max = std::numeric_limits<int64_t>::max(), const char* component = "args");

// A byte count as parse_bytes reads it (40GiB, 512MiB, 1.5GB, 4096), within [min, max]; errors name `what`.
int64_t parse_size(std::string_view text, std::string_view what, int64_t min = 0,
                   int64_t max = std::numeric_limits<int64_t>::max(), const char* component = "args");

// The accepted range in words: "an integer", "an integer >= 1", "an integer in [1, 64]".
std::string integer_range_text(int64_t min, int64_t max);

}  // namespace kestrel
