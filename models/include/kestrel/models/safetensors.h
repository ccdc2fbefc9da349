// safetensors reading (memory-mapped, single file or sharded index) and atomic writing.
//
// Format (https://huggingface.co/docs/safetensors): u64 little-endian header length N, N bytes of
// JSON {name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}},
// then the data section; offsets are relative to the start of the data section.
// Readers validate everything a malformed or truncated file could get wrong (header bound, JSON,
// dtype, offsets inside the data section, begin <= end, no two tensors overlapping, shape x dtype
// size == byte length) and name the file and the tensor in every error. Bytes are never copied:
// entries hold spans into a shared read-only mapping that lives as long as any reader.
// Writers follow the reference implementation: tensors sorted by element size (largest first) then
// name so each starts aligned to its element size, header padded with spaces to a multiple of 8.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "kestrel/models/file_io.h"
#include "kestrel/runtime/dtype.h"

namespace kestrel::models {

// Largest header accepted (same bound as the reference implementation).
inline constexpr uint64_t kSafetensorsMaxHeaderBytes = 100'000'000;

// "F32" <-> DType. Unsupported safetensors dtypes (F64, I8, I16, U16, ...) throw.
DType safetensors_dtype_from_string(const std::string& s, const std::string& file, const std::string& tensor);
const char* safetensors_dtype_string(DType t);

struct SafetensorsEntry {
  std::string name;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  std::span<const std::byte> bytes;  // into the mapping of `file`
  std::string file;                  // path of the file holding the bytes

  int64_t numel() const;
};

// One .safetensors file.
class SafetensorsFile {
 public:
  static SafetensorsFile open(const std::string& path);

  const std::string& path() const { return map_->path(); }
  const std::vector<SafetensorsEntry>& entries() const { return entries_; }  // sorted by name
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const SafetensorsEntry* find(const std::string& name) const;
  const SafetensorsEntry& get(const std::string& name) const;  // throws naming file and tensor
  bool contains(const std::string& name) const { return find(name) != nullptr; }
  uint64_t data_offset() const { return data_offset_; }  // 8 + header length
  const std::shared_ptr<const MappedFile>& mapping() const { return map_; }

 private:
  std::shared_ptr<const MappedFile> map_;
  std::vector<SafetensorsEntry> entries_;
  std::unordered_map<std::string, size_t> index_;
  std::map<std::string, std::string> metadata_;
  uint64_t data_offset_ = 0;
};

// A whole checkpoint: one .safetensors file, a model.safetensors.index.json (weight_map -> shards,
// each opened once), or a folder holding either (model.safetensors first, else
// model.safetensors.index.json, the order transformers uses).
class SafetensorsReader {
 public:
  static SafetensorsReader open(const std::string& path);

  const std::string& path() const { return path_; }
  std::vector<std::string> names() const;  // sorted
  size_t size() const { return by_name_.size(); }
  const SafetensorsEntry* find(const std::string& name) const;
  const SafetensorsEntry& get(const std::string& name) const;  // throws naming path and tensor
  bool contains(const std::string& name) const { return find(name) != nullptr; }
  // Single file: its __metadata__. Index: the index's "metadata" object, values as strings
  // (total_size included), plus nothing from the shards.
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const std::vector<SafetensorsFile>& files() const { return files_; }

 private:
  std::string path_;
  std::vector<SafetensorsFile> files_;
  std::map<std::string, std::pair<size_t, size_t>> by_name_;  // name -> (file, entry)
  std::map<std::string, std::string> metadata_;
};

// ---- writing ----

struct SafetensorsWriteEntry {
  std::string name;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  const void* data = nullptr;  // numel * dtype_size bytes, contiguous, little-endian

  uint64_t nbytes() const;
};

// Serialises header + data to bytes (the exact file image); validates names/shapes/pointers.
std::vector<std::byte> serialize_safetensors(const std::vector<SafetensorsWriteEntry>& entries,
                                             const std::map<std::string, std::string>& metadata = {});

// Atomically writes one .safetensors file.
void write_safetensors(const std::string& path, const std::vector<SafetensorsWriteEntry>& entries,
                       const std::map<std::string, std::string>& metadata = {});

// Writes a checkpoint into folder `dir` (created if missing) the way transformers' save_pretrained
// does: if the tensors' bytes total at most `max_shard_bytes`, one `<base>.safetensors`; otherwise
// shards `<base>-00001-of-0000N.safetensors` filled greedily in the given order (a tensor larger
// than the limit gets a shard of its own) plus `<base>.safetensors.index.json` with
// metadata.total_size and weight_map. `metadata` goes into every file's __metadata__. Stale files of
// the other layout (and stale shards with the same base) are removed afterwards. Returns the paths
// written (index last).
std::vector<std::string> write_safetensors_checkpoint(const std::string& dir,
                                                      const std::vector<SafetensorsWriteEntry>& entries,
                                                      const std::map<std::string, std::string>& metadata = {},
                                                      uint64_t max_shard_bytes = uint64_t{5} << 30,
                                                      const std::string& base = "model");

}  // namespace kestrel::models
