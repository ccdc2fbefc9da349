// Memory-mapped safetensors reading: one file, or a sharded checkpoint through its index.json.
// Every error names the file (and the tensor when there is one) and what is wrong with it.
#include <algorithm>
#include <cstring>
#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>

#include "kestrel/models/json_text.h"
#include "kestrel/models/safetensors.h"
#include "kestrel/runtime/error.h"

namespace kestrel::models {

namespace {
constexpr const char* kComp = "safetensors";
using nlohmann::json;

uint64_t read_u64_le(const std::byte* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | static_cast<uint64_t>(p[i]);
  return v;
}

// Reads a non-negative integer from a JSON number; throws naming the field.
uint64_t json_uint(const json& j, const std::string& file, const std::string& tensor, const char* field) {
  KESTREL_CHECK(j.is_number_unsigned() || (j.is_number_integer() && j.get<int64_t>() >= 0),
                kComp, "'", file, "': tensor '", tensor, "': ", field, " must hold non-negative integers, got ",
                j.dump());
  return j.get<uint64_t>();
}
}  // namespace

DType safetensors_dtype_from_string(const std::string& s, const std::string& file, const std::string& tensor) {
  if (s == "F32") return DType::F32;
  if (s == "F16") return DType::F16;
  if (s == "BF16") return DType::BF16;
  if (s == "I64") return DType::I64;
  if (s == "I32") return DType::I32;
  if (s == "U8") return DType::U8;
  if (s == "BOOL") return DType::Bool;
  static const char* known[] = {"F64", "I8", "I16", "U16", "U32", "U64", "F8_E4M3", "F8_E5M2", "F8_E8M0", "F4", "F6_E2M3", "F6_E3M2", "C64"};
  for (const char* k : known)
    if (s == k)
      throw make_error(kComp, "'", file, "': tensor '", tensor, "' has dtype ", s,
                       ", which is not supported (supported: F32, F16, BF16, I64, I32, U8, BOOL)");
  throw make_error(kComp, "'", file, "': tensor '", tensor, "' has unknown dtype '", s, "'");
}

const char* safetensors_dtype_string(DType t) {
  switch (t) {
    case DType::F32: return "F32";
    case DType::F16: return "F16";
    case DType::BF16: return "BF16";
    case DType::I64: return "I64";
    case DType::I32: return "I32";
    case DType::U8: return "U8";
    case DType::Bool: return "BOOL";
    default: break;
  }
  throw make_error(kComp, "dtype ", dtype_name(t), " is not supported in safetensors files here");
}

int64_t SafetensorsEntry::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

SafetensorsFile SafetensorsFile::open(const std::string& path) {
  SafetensorsFile f;
  f.map_ = MappedFile::open(path, kComp);
  const uint64_t size = f.map_->size();
  KESTREL_CHECK(size >= 8, kComp, "'", path, "' is truncated: ", size,
                " bytes, too small for the 8-byte header length");
  const uint64_t n = read_u64_le(f.map_->data());
  // The length is not printed here: above the limit it is most likely the first 8 bytes of a file
  // that is not safetensors at all, and errors never quote what a file holds.
  KESTREL_CHECK(n <= kSafetensorsMaxHeaderBytes, kComp, "'", path, "': header length (the first 8 bytes) exceeds ",
                "the limit of ", kSafetensorsMaxHeaderBytes, " bytes; not a safetensors file?");
  KESTREL_CHECK(n <= size - 8, kComp, "'", path, "': header length ", n, " runs beyond the end of the file (",
                size, " bytes; truncated?)");
  KESTREL_CHECK(n >= 2, kComp, "'", path, "': header length ", n, " is too small for a JSON object");
  f.data_offset_ = 8 + n;
  const uint64_t data_size = size - f.data_offset_;

  const char* hdr = reinterpret_cast<const char*>(f.map_->data() + 8);
  const json j = parse_json_text(std::string_view(hdr, n), "'" + path + "': header", kComp);
  KESTREL_CHECK(j.is_object(), kComp, "'", path, "': header must be a JSON object, got ", j.type_name());

  struct Range {
    uint64_t begin, end;
    size_t entry;
  };
  std::vector<Range> ranges;
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& name = it.key();
    const json& v = it.value();
    if (name == "__metadata__") {
      KESTREL_CHECK(v.is_object(), kComp, "'", path, "': __metadata__ must be an object of strings");
      for (auto m = v.begin(); m != v.end(); ++m) {
        KESTREL_CHECK(m.value().is_string(), kComp, "'", path, "': __metadata__ value for '", m.key(),
                      "' must be a string, got ", m.value().type_name());
        f.metadata_[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    KESTREL_CHECK(v.is_object(), kComp, "'", path, "': tensor '", name, "' must be an object, got ", v.type_name());
    KESTREL_CHECK(v.contains("dtype") && v["dtype"].is_string(), kComp, "'", path, "': tensor '", name,
                  "' has no dtype string");
    KESTREL_CHECK(v.contains("shape") && v["shape"].is_array(), kComp, "'", path, "': tensor '", name,
                  "' has no shape array");
    KESTREL_CHECK(v.contains("data_offsets") && v["data_offsets"].is_array() && v["data_offsets"].size() == 2,
                  kComp, "'", path, "': tensor '", name, "' needs data_offsets [begin, end]");
    SafetensorsEntry e;
    e.name = name;
    e.file = path;
    e.dtype = safetensors_dtype_from_string(v["dtype"].get<std::string>(), path, name);
    // numel with overflow guard: any product above the data size is already wrong.
    uint64_t numel = 1;
    bool overflow = false;
    for (const json& d : v["shape"]) {
      uint64_t dim = json_uint(d, path, name, "shape");
      KESTREL_CHECK(dim <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()), kComp, "'", path,
                    "': tensor '", name, "' has a dimension too large: ", dim);
      e.shape.push_back(static_cast<int64_t>(dim));
      if (dim != 0 && numel > std::numeric_limits<uint64_t>::max() / dim) overflow = true;
      numel *= dim;
    }
    const uint64_t begin = json_uint(v["data_offsets"][0], path, name, "data_offsets");
    const uint64_t end = json_uint(v["data_offsets"][1], path, name, "data_offsets");
    KESTREL_CHECK(begin <= end, kComp, "'", path, "': tensor '", name, "' has data_offsets begin ", begin,
                  " > end ", end);
    KESTREL_CHECK(end <= data_size, kComp, "'", path, "': tensor '", name, "' data_offsets [", begin, ", ", end,
                  "] lie outside the data section of ", data_size, " bytes (file truncated?)");
    const uint64_t esz = dtype_size(e.dtype);
    KESTREL_CHECK(!overflow && numel <= std::numeric_limits<uint64_t>::max() / esz && numel * esz == end - begin,
                  kComp, "'", path, "': tensor '", name, "' shape ", v["shape"].dump(), " x ",
                  safetensors_dtype_string(e.dtype), " needs ", overflow ? std::string("overflowing")
                                                                        : std::to_string(numel * esz),
                  " bytes but data_offsets give ", end - begin, " (byte length mismatch)");
    e.bytes = std::span<const std::byte>(f.map_->data() + f.data_offset_ + begin, end - begin);
    ranges.push_back({begin, end, f.entries_.size()});
    f.entries_.push_back(std::move(e));
  }

  // Overlap: sort by begin and compare neighbours (empty tensors cannot overlap anything).
  std::sort(ranges.begin(), ranges.end(), [](const Range& a, const Range& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  const Range* prev = nullptr;
  for (const Range& r : ranges) {
    if (r.begin == r.end) continue;
    if (prev != nullptr) {
      KESTREL_CHECK(r.begin >= prev->end, kComp, "'", path, "': tensors '", f.entries_[prev->entry].name, "' [",
                    prev->begin, ", ", prev->end, ") and '", f.entries_[r.entry].name, "' [", r.begin, ", ", r.end,
                    ") overlap");
    }
    prev = &r;
  }

  std::sort(f.entries_.begin(), f.entries_.end(),
            [](const SafetensorsEntry& a, const SafetensorsEntry& b) { return a.name < b.name; });
  for (size_t i = 0; i < f.entries_.size(); ++i) f.index_[f.entries_[i].name] = i;
  return f;
}

const SafetensorsEntry* SafetensorsFile::find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &entries_[it->second];
}

const SafetensorsEntry& SafetensorsFile::get(const std::string& name) const {
  const SafetensorsEntry* e = find(name);
  KESTREL_CHECK(e != nullptr, kComp, "'", path(), "' has no tensor named '", name, "' (", entries_.size(),
                " tensors)");
  return *e;
}

// ---- SafetensorsReader ----

SafetensorsReader SafetensorsReader::open(const std::string& path) {
  namespace fs = std::filesystem;
  SafetensorsReader r;
  r.path_ = path;
  std::string target = path;
  std::error_code ec;
  if (fs::is_directory(path, ec)) {
    fs::path single = fs::path(path) / "model.safetensors";
    fs::path index = fs::path(path) / "model.safetensors.index.json";
    if (fs::exists(single, ec)) {
      target = single.string();
    } else if (fs::exists(index, ec)) {
      target = index.string();
    } else {
      throw make_error(kComp, "folder '", path, "' holds neither model.safetensors nor model.safetensors.index.json");
    }
  }

  const bool is_index = target.size() >= 5 && target.compare(target.size() - 5, 5, ".json") == 0;
  if (!is_index) {
    r.files_.push_back(SafetensorsFile::open(target));
    r.metadata_ = r.files_[0].metadata();
  } else {
    auto map = MappedFile::open(target, kComp);
    const json j = parse_json_text(std::string_view(reinterpret_cast<const char*>(map->data()), map->size()),
                                   "index '" + target + "'", kComp);
    KESTREL_CHECK(j.is_object() && j.contains("weight_map") && j["weight_map"].is_object(), kComp, "index '",
                  target, "' has no weight_map object");
    if (j.contains("metadata") && j["metadata"].is_object()) {
      for (auto m = j["metadata"].begin(); m != j["metadata"].end(); ++m)
        r.metadata_[m.key()] = m.value().is_string() ? m.value().get<std::string>() : m.value().dump();
    }
    const std::string dir = fs::path(target).parent_path().string();
    std::map<std::string, size_t> shard_of;  // shard file name -> index in files_
    std::vector<std::pair<std::string, std::string>> wanted;  // tensor, shard
    for (auto it = j["weight_map"].begin(); it != j["weight_map"].end(); ++it) {
      KESTREL_CHECK(it.value().is_string(), kComp, "index '", target, "': weight_map entry for '", it.key(),
                    "' must be a file name string");
      const std::string shard = it.value().get<std::string>();
      if (!shard_of.count(shard)) {
        // Shards stay inside the index's folder: an entry like "../../x" or "/etc/x" is refused.
        const std::string shard_path = confined_path(dir, shard, target, kComp);
        KESTREL_CHECK(fs::exists(shard_path, ec), kComp, "index '", target, "' names shard '", shard,
                      "' (for tensor '", it.key(), "') but '", shard_path, "' does not exist");
        shard_of[shard] = r.files_.size();
        r.files_.push_back(SafetensorsFile::open(shard_path));
      }
      wanted.emplace_back(it.key(), shard);
    }
    for (const auto& [tensor, shard] : wanted) {
      size_t fi = shard_of.at(shard);
      const SafetensorsEntry* e = r.files_[fi].find(tensor);
      KESTREL_CHECK(e != nullptr, kComp, "index '", target, "' maps tensor '", tensor, "' to '", shard,
                    "', which has no such tensor");
      r.by_name_[tensor] = {fi, static_cast<size_t>(e - r.files_[fi].entries().data())};
    }
    return r;
  }
  for (size_t i = 0; i < r.files_[0].entries().size(); ++i) r.by_name_[r.files_[0].entries()[i].name] = {0, i};
  return r;
}

std::vector<std::string> SafetensorsReader::names() const {
  std::vector<std::string> out;
  out.reserve(by_name_.size());
  for (const auto& kv : by_name_) out.push_back(kv.first);
  return out;
}

const SafetensorsEntry* SafetensorsReader::find(const std::string& name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : &files_[it->second.first].entries()[it->second.second];
}

const SafetensorsEntry& SafetensorsReader::get(const std::string& name) const {
  const SafetensorsEntry* e = find(name);
  KESTREL_CHECK(e != nullptr, kComp, "'", path_, "' has no tensor named '", name, "' (", by_name_.size(),
                " tensors)");
  return *e;
}

}  // namespace kestrel::models
