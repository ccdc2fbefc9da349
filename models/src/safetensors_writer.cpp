// safetensors writing: one file or a sharded checkpoint + index.json, always atomically.
//
// Layout policy (as the reference implementation): tensors sorted by element size, largest first,
// then by name, packed back to back, so every tensor starts at a multiple of its element size once
// the header is padded with spaces to a multiple of 8 bytes.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>

#include "kestrel/models/safetensors.h"
#include "kestrel/runtime/error.h"

namespace kestrel::models {

namespace {
constexpr const char* kComp = "safetensors";

void validate_entries(const std::vector<SafetensorsWriteEntry>& entries, const std::string& target) {
  std::set<std::string> seen;
  for (const auto& e : entries) {
    KESTREL_CHECK(!e.name.empty(), kComp, "writing '", target, "': empty tensor name");
    KESTREL_CHECK(e.name != "__metadata__", kComp, "writing '", target, "': '__metadata__' is not a tensor name");
    KESTREL_CHECK(seen.insert(e.name).second, kComp, "writing '", target, "': tensor '", e.name, "' given twice");
    for (int64_t d : e.shape)
      KESTREL_CHECK(d >= 0, kComp, "writing '", target, "': tensor '", e.name, "' has negative dimension ", d);
    (void)safetensors_dtype_string(e.dtype);  // throws for dtypes without a mapping
    KESTREL_CHECK(e.data != nullptr || e.nbytes() == 0, kComp, "writing '", target, "': tensor '", e.name,
                  "' has no data pointer");
  }
}

// The order tensors are laid out in: element size descending, then name.
std::vector<const SafetensorsWriteEntry*> layout_order(const std::vector<SafetensorsWriteEntry>& entries) {
  std::vector<const SafetensorsWriteEntry*> order;
  for (const auto& e : entries) order.push_back(&e);
  std::sort(order.begin(), order.end(), [](const SafetensorsWriteEntry* a, const SafetensorsWriteEntry* b) {
    size_t sa = dtype_size(a->dtype), sb = dtype_size(b->dtype);
    return sa != sb ? sa > sb : a->name < b->name;
  });
  return order;
}

// Header bytes (padded) for `order`; data offsets are assigned back to back.
std::string build_header(const std::vector<const SafetensorsWriteEntry*>& order,
                         const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json h = nlohmann::ordered_json::object();
  if (!metadata.empty()) {
    nlohmann::ordered_json m = nlohmann::ordered_json::object();
    for (const auto& [k, v] : metadata) m[k] = v;
    h["__metadata__"] = m;
  }
  uint64_t offset = 0;
  for (const SafetensorsWriteEntry* e : order) {
    const uint64_t n = e->nbytes();
    h[e->name] = {{"dtype", safetensors_dtype_string(e->dtype)}, {"shape", e->shape}, {"data_offsets", {offset, offset + n}}};
    offset += n;
  }
  std::string text = h.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  return text;
}

void append_u64_le(std::string& out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

std::string shard_name(const std::string& base, size_t i, size_t n) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "-%05zu-of-%05zu.safetensors", i + 1, n);
  return base + buf;
}
}  // namespace

uint64_t SafetensorsWriteEntry::nbytes() const {
  uint64_t n = dtype_size(dtype);
  for (int64_t d : shape) n *= static_cast<uint64_t>(d);
  return n;
}

std::vector<std::byte> serialize_safetensors(const std::vector<SafetensorsWriteEntry>& entries,
                                             const std::map<std::string, std::string>& metadata) {
  validate_entries(entries, "<memory>");
  auto order = layout_order(entries);
  std::string prefix;
  const std::string header = build_header(order, metadata);
  append_u64_le(prefix, header.size());
  prefix += header;
  uint64_t total = prefix.size();
  for (const auto* e : order) total += e->nbytes();
  std::vector<std::byte> out(total);
  std::memcpy(out.data(), prefix.data(), prefix.size());
  uint64_t at = prefix.size();
  for (const auto* e : order) {
    if (e->nbytes() > 0) std::memcpy(out.data() + at, e->data, e->nbytes());
    at += e->nbytes();
  }
  return out;
}

void write_safetensors(const std::string& path, const std::vector<SafetensorsWriteEntry>& entries,
                       const std::map<std::string, std::string>& metadata) {
  validate_entries(entries, path);
  auto order = layout_order(entries);
  std::string prefix;
  const std::string header = build_header(order, metadata);
  append_u64_le(prefix, header.size());
  prefix += header;
  // Stream straight from the callers' buffers: no second copy of the weights in memory.
  AtomicFileWriter w(path, kComp);
  w.append(prefix.data(), prefix.size());
  for (const auto* e : order)
    if (e->nbytes() > 0) w.append(e->data, e->nbytes());
  w.commit();
}

std::vector<std::string> write_safetensors_checkpoint(const std::string& dir,
                                                      const std::vector<SafetensorsWriteEntry>& entries,
                                                      const std::map<std::string, std::string>& metadata,
                                                      uint64_t max_shard_bytes, const std::string& base) {
  namespace fs = std::filesystem;
  KESTREL_CHECK(max_shard_bytes > 0, kComp, "writing '", dir, "': max_shard_bytes must be positive");
  validate_entries(entries, dir);
  std::error_code ec;
  fs::create_directories(dir, ec);
  KESTREL_CHECK(!ec, kComp, "cannot create folder '", dir, "': ", ec.message());

  uint64_t total = 0;
  for (const auto& e : entries) total += e.nbytes();
  const fs::path single = fs::path(dir) / (base + ".safetensors");
  const fs::path index = fs::path(dir) / (base + ".safetensors.index.json");
  const std::regex shard_re(std::regex_replace(base, std::regex(R"([.^$|()\[\]{}*+?\\])"), R"(\$&)") +
                            R"(-\d{5}-of-\d{5}\.safetensors)");
  std::vector<std::string> written;

  if (total <= max_shard_bytes) {
    write_safetensors(single.string(), entries, metadata);
    written.push_back(single.string());
  } else {
    // Greedy fill in the callers' order, as save_pretrained does.
    std::vector<std::vector<SafetensorsWriteEntry>> shards(1);
    uint64_t cur = 0;
    for (const auto& e : entries) {
      if (!shards.back().empty() && cur + e.nbytes() > max_shard_bytes) {
        shards.emplace_back();
        cur = 0;
      }
      shards.back().push_back(e);
      cur += e.nbytes();
    }
    nlohmann::ordered_json weight_map = nlohmann::ordered_json::object();
    std::map<std::string, std::string> sorted_map;
    for (size_t i = 0; i < shards.size(); ++i) {
      const std::string name = shard_name(base, i, shards.size());
      const fs::path p = fs::path(dir) / name;
      write_safetensors(p.string(), shards[i], metadata);
      written.push_back(p.string());
      for (const auto& e : shards[i]) sorted_map[e.name] = name;
    }
    for (const auto& [k, v] : sorted_map) weight_map[k] = v;
    nlohmann::ordered_json idx = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
    const std::string text = idx.dump(2) + "\n";
    write_file_atomic(index.string(), std::as_bytes(std::span(text.data(), text.size())), kComp);
    written.push_back(index.string());
  }

  // Remove files of the other layout (or older shard sets) so readers see only this checkpoint.
  std::set<std::string> keep;
  for (const auto& w : written) keep.insert(fs::path(w).filename().string());
  for (const auto& de : fs::directory_iterator(dir, ec)) {
    const std::string fname = de.path().filename().string();
    if (keep.count(fname)) continue;
    if (fname == single.filename().string() || fname == index.filename().string() ||
        std::regex_match(fname, shard_re))
      fs::remove(de.path(), ec);
  }
  return written;
}

}  // namespace kestrel::models
