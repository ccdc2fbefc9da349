// Pickle protocol 2 writer (see pickle_writer.h). Opcode values from Python's pickletools table.
#include "kestrel/train/pickle_writer.h"

#include "kestrel/runtime/error.h"

namespace kestrel::train {
namespace {

constexpr char kProto = '\x80', kStop = '.', kMark = '(', kNone = 'N', kNewTrue = '\x88', kNewFalse = '\x89';
constexpr char kBinInt = 'J', kBinInt1 = 'K', kBinInt2 = 'M', kLong1 = '\x8a', kBinUnicode = 'X';
constexpr char kEmptyDict = '}', kSetItems = 'u', kEmptyList = ']', kAppends = 'e';
constexpr char kBinPut = 'q', kLongBinPut = 'r', kBinGet = 'h', kLongBinGet = 'j';
constexpr int64_t kBatch = 1000;

void put_u32(std::string& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

}  // namespace

PickleWriter::PickleWriter() {
  out_.push_back(kProto);
  out_.push_back('\x02');
}

void PickleWriter::before_item() {
  KESTREL_CHECK(!finished_, "pickle", "writer already finished");
  if (open_.empty()) return;
  Open& o = open_.back();
  const int64_t limit = o.dict ? 2 * kBatch : kBatch;  // a dict batch ends between pairs
  if (o.items == limit) flush_batch(true);
  open_.back().items += 1;
}

void PickleWriter::flush_batch(bool reopen) {
  Open& o = open_.back();
  out_.push_back(o.dict ? kSetItems : kAppends);
  o.items = 0;
  if (reopen) out_.push_back(kMark);
}

void PickleWriter::none() {
  before_item();
  out_.push_back(kNone);
}

void PickleWriter::boolean(bool v) {
  before_item();
  out_.push_back(v ? kNewTrue : kNewFalse);
}

void PickleWriter::integer(int64_t v) {
  before_item();
  if (v >= 0 && v < 256) {
    out_.push_back(kBinInt1);
    out_.push_back(static_cast<char>(v));
  } else if (v >= 0 && v < 65536) {
    out_.push_back(kBinInt2);
    out_.push_back(static_cast<char>(v & 0xff));
    out_.push_back(static_cast<char>((v >> 8) & 0xff));
  } else if (v >= INT32_MIN && v <= INT32_MAX) {
    out_.push_back(kBinInt);
    put_u32(out_, static_cast<uint32_t>(static_cast<int32_t>(v)));
  } else {
    // LONG1: the fewest little-endian two's-complement bytes whose top bit carries the sign.
    uint8_t bytes[8];
    const auto u = static_cast<uint64_t>(v);
    for (int i = 0; i < 8; ++i) bytes[i] = static_cast<uint8_t>((u >> (8 * i)) & 0xff);
    int n = 8;
    while (n > 1) {
      const uint8_t top = bytes[n - 1], next = bytes[n - 2];
      if ((top == 0x00 && !(next & 0x80)) || (top == 0xff && (next & 0x80))) --n; else break;
    }
    out_.push_back(kLong1);
    out_.push_back(static_cast<char>(n));
    for (int i = 0; i < n; ++i) out_.push_back(static_cast<char>(bytes[i]));
  }
}

void PickleWriter::string(std::string_view s) {
  before_item();
  KESTREL_CHECK(s.size() < (uint64_t{1} << 32), "pickle", "string too long: ", s.size(), " bytes");
  out_.push_back(kBinUnicode);
  put_u32(out_, static_cast<uint32_t>(s.size()));
  out_.append(s);
}

void PickleWriter::memo_string(std::string_view s) {
  auto it = strings_.find(std::string(s));
  if (it != strings_.end()) {
    get(it->second);
    return;
  }
  string(s);
  strings_.emplace(std::string(s), memoize());
}

void PickleWriter::begin_dict() {
  before_item();
  out_.push_back(kEmptyDict);
  out_.push_back(kMark);
  open_.push_back({true, 0});
}

void PickleWriter::end_dict() {
  KESTREL_CHECK(!open_.empty() && open_.back().dict, "pickle", "end_dict without an open dict");
  KESTREL_CHECK(open_.back().items % 2 == 0, "pickle", "a dict key has no value");
  flush_batch(false);
  open_.pop_back();
}

void PickleWriter::begin_list() {
  before_item();
  out_.push_back(kEmptyList);
  out_.push_back(kMark);
  open_.push_back({false, 0});
}

void PickleWriter::end_list() {
  KESTREL_CHECK(!open_.empty() && !open_.back().dict, "pickle", "end_list without an open list");
  flush_batch(false);
  open_.pop_back();
}

uint32_t PickleWriter::memoize() {
  const uint32_t index = next_memo_++;
  if (index < 256) {
    out_.push_back(kBinPut);
    out_.push_back(static_cast<char>(index));
  } else {
    out_.push_back(kLongBinPut);
    put_u32(out_, index);
  }
  return index;
}

void PickleWriter::get(uint32_t index) {
  KESTREL_CHECK(index < next_memo_, "pickle", "memo index ", index, " was never stored");
  before_item();
  if (index < 256) {
    out_.push_back(kBinGet);
    out_.push_back(static_cast<char>(index));
  } else {
    out_.push_back(kLongBinGet);
    put_u32(out_, index);
  }
}

std::string PickleWriter::finish() {
  KESTREL_CHECK(open_.empty(), "pickle", open_.size(), " container(s) still open");
  KESTREL_CHECK(!finished_, "pickle", "writer already finished");
  out_.push_back(kStop);
  finished_ = true;
  return std::move(out_);
}

}  // namespace kestrel::train
