// A small writer of Python pickles (protocol 2) holding dicts, lists, str, int, bool and None:
// enough for PyTorch's memory snapshot format (memory_viz_export.h), which Python's pickle module
// and the JavaScript unpickler of pytorch.org/memory_viz both read.
//
// Encoding: PROTO 2; ints as BININT1 / BININT2 / BININT / LONG1 (little-endian two's complement);
// str as BINUNICODE (UTF-8); containers as EMPTY_DICT / EMPTY_LIST followed by MARK ... SETITEMS /
// APPENDS in batches of 1000 items (readers that spread a batch into one call stay within their
// argument limits). Repeated strings and shared sub-objects can be memoized (BINPUT / LONG_BINPUT)
// and referenced again (BINGET / LONG_BINGET).
//
// Usage: begin_dict(); key("a"); integer(1); key("b"); begin_list(); ... end_list(); end_dict();
// finish() returns the bytes. Nesting is checked (a Error on misuse), not the key/value pairing.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace kestrel::train {

class PickleWriter {
 public:
  PickleWriter();

  void none();
  void boolean(bool v);
  void integer(int64_t v);
  void string(std::string_view s);
  // A string written once and referenced from the memo afterwards (dict keys, repeated labels).
  void memo_string(std::string_view s);
  void key(std::string_view k) { memo_string(k); }

  void begin_dict();
  void end_dict();
  void begin_list();
  void end_list();

  // Stores the object just completed (top of the stack) in the memo; returns its index.
  uint32_t memoize();
  // Pushes a memoized object again (the same object: shared, not copied).
  void get(uint32_t index);

  // Appends STOP and returns the pickle; the writer is spent afterwards.
  std::string finish();

 private:
  struct Open {
    bool dict = false;
    int64_t items = 0;  // values written since the last MARK (dict: keys and values)
  };
  void before_item();
  void flush_batch(bool reopen);

  std::string out_;
  std::vector<Open> open_;
  std::unordered_map<std::string, uint32_t> strings_;
  uint32_t next_memo_ = 0;
  bool finished_ = false;
};

}  // namespace kestrel::train
