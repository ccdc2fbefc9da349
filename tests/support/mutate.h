// Bounded random mutation of parser inputs (issue 18's fuzz-ish hardening): byte-level edits of a
// valid file and structural edits of a valid JSON document. Tests run a few thousand mutants of
// each input and require every failure to be a kestrel::Error: never a crash, a hang, a raw
// library exception (nlohmann type_error / out_of_range, std::invalid_argument) or bad_alloc.
// Deterministic (a fixed seed per test), header-only. CI runs the default counts (well under a
// second of CPU per binary); KESTREL_FUZZ_SCALE=N multiplies them for a longer local run.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "kestrel/runtime/error.h"

namespace kestrel::testing {

// `n` mutants, times KESTREL_FUZZ_SCALE when set (a positive integer).
inline int fuzz_iterations(int n) {
  const char* s = std::getenv("KESTREL_FUZZ_SCALE");
  const long scale = s != nullptr ? std::strtol(s, nullptr, 10) : 1;
  return scale > 1 ? static_cast<int>(std::min<long>(scale, 100000) * n) : n;
}

// Values that break parsers: wrong types, signs, sizes, precision, empty containers.
inline nlohmann::json hostile_json_value(std::mt19937_64& rng) {
  using nlohmann::json;
  switch (rng() % 16) {
    case 0: return json(nullptr);
    case 1: return json(true);
    case 2: return json(-1);
    case 3: return json(0);
    case 4: return json(int64_t{1} << 40);
    case 5: return json(std::numeric_limits<int64_t>::max());
    case 6: return json(std::numeric_limits<uint64_t>::max());
    case 7: return json(0.5);
    case 8: return json(1e300);
    case 9: return json(-1e-300);
    case 10: return json("");
    case 11: return json("x");
    case 12: return json::array();
    case 13: return json::object();
    case 14: return json::array({1, "a", nullptr});
    default: return json(static_cast<int64_t>(rng() % 100000) - 50000);
  }
}

// A copy of `j` with one random node replaced, removed, or given a hostile extra member.
inline nlohmann::json mutate_json(const nlohmann::json& j, std::mt19937_64& rng) {
  using nlohmann::json;
  json out = j;
  // Walk down to a random node.
  json* node = &out;
  json* parent = nullptr;
  std::string key;
  size_t index = 0;
  for (int depth = 0; depth < 8; ++depth) {
    if (!(node->is_object() || node->is_array()) || node->empty() || rng() % 3 == 0) break;
    parent = node;
    if (node->is_object()) {
      auto it = node->begin();
      std::advance(it, static_cast<long>(rng() % node->size()));
      key = it.key();
      node = &(*node)[key];
    } else {
      index = rng() % node->size();
      key.clear();
      node = &(*node)[index];
    }
  }
  switch (rng() % 4) {
    case 0:  // remove the node
      if (parent != nullptr && parent->is_object()) parent->erase(key);
      else if (parent != nullptr && parent->is_array()) parent->erase(index);
      else *node = hostile_json_value(rng);
      break;
    case 1:  // add a member / element
      if (node->is_object()) (*node)["k" + std::to_string(rng() % 4)] = hostile_json_value(rng);
      else if (node->is_array()) node->push_back(hostile_json_value(rng));
      else *node = hostile_json_value(rng);
      break;
    default:  // replace it
      *node = hostile_json_value(rng);
      break;
  }
  return out;
}

// A copy of `b` with 1-4 random byte edits: flips, overwrites with boundary bytes, insertions,
// deletions, duplicated ranges, truncation, or a JSON-significant token spliced in.
inline std::string mutate_bytes(const std::string& b, std::mt19937_64& rng) {
  static const char* tokens[] = {"{", "}", "[", "]", ",", ":", "\"", "-1", "1e999", "18446744073709551616",
                                 "null", "true", "0.5", "\\u0000", "\xff", "\\", "-0", "[[[[[[[["};
  std::string s = b;
  const int edits = 1 + static_cast<int>(rng() % 4);
  for (int e = 0; e < edits; ++e) {
    const size_t at = s.empty() ? 0 : rng() % s.size();
    switch (rng() % 7) {
      case 0:
        if (!s.empty()) s[at] = static_cast<char>(s[at] ^ (1 << (rng() % 8)));
        break;
      case 1:
        if (!s.empty()) s[at] = static_cast<char>("\x00\x01\x7f\x80\xff"[rng() % 5]);
        break;
      case 2: s.insert(at, 1, static_cast<char>(rng())); break;
      case 3:
        if (!s.empty()) s.erase(at, 1 + rng() % 16);
        break;
      case 4:
        if (!s.empty()) s.insert(at, s.substr(at, 1 + rng() % 32));
        break;
      case 5: s.resize(at); break;
      default: s.insert(at, tokens[rng() % (sizeof(tokens) / sizeof(tokens[0]))]); break;
    }
  }
  return s;
}

// Runs `parse(input)` and records a test failure when it throws anything but kestrel::Error.
// Returns true when it succeeded.
inline bool parses_or_kestrel_error(const std::function<void()>& parse, const std::string& what) {
  try {
    parse();
    return true;
  } catch (const Error&) {
    return false;
  } catch (const std::exception& e) {
    ADD_FAILURE() << what << ": threw a non-kestrel exception: " << e.what();
    return false;
  }
}

}  // namespace kestrel::testing
