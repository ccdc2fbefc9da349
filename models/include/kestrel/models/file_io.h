// Byte-level file helpers shared by the weight and data formats: a read-only memory map and an
// atomic file writer.
//
// Policy: readers never copy file contents; they map the file read-only and hand out spans into
// the map, which stays alive as long as the MappedFile (shared by every span's owner).
// Writers never leave a half-written file under the final name: bytes go to a temporary file in
// the same folder, which is fsync'ed, renamed over the target and the folder fsync'ed, so a
// crash leaves either the old file or the new one.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

namespace kestrel::models {

// Throws "[component] '<path>' is a FIFO (named pipe), not a regular file; ..." unless `path`
// (symlinks followed) is a regular file. Readers check before opening: opening a FIFO blocks.
void require_regular_file(const std::string& path, const char* component = "file");

// `name`, a file name read from `named_by` (a sharded index's weight_map entry, ...), joined to
// `dir`, the folder of `named_by`. Throws unless it stays inside `dir` after resolving symlinks:
// absolute names and '..' are refused, and so is a symlink leading out of the folder (except, in a
// Hugging Face hub cache snapshot <repo>/snapshots/<rev>/, into that repo's blobs/ folder, where
// the hub keeps the files). Returns dir / name (unresolved, for messages).
std::string confined_path(const std::string& dir, const std::string& name, const std::string& named_by,
                          const char* component = "file");

// A whole file mapped read-only. Empty files are valid (bytes() is empty, nothing is mapped).
class MappedFile {
 public:
  // Throws kestrel::Error "[component] cannot open '<path>': <reason>"; only regular files are
  // opened (a FIFO, device or folder is an error, never a blocking open).
  static std::shared_ptr<const MappedFile> open(const std::string& path, const char* component = "file");
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const std::string& path() const { return path_; }
  uint64_t size() const { return size_; }
  std::span<const std::byte> bytes() const { return {static_cast<const std::byte*>(data_), size_}; }
  const std::byte* data() const { return static_cast<const std::byte*>(data_); }

 private:
  MappedFile() = default;
  std::string path_;
  void* data_ = nullptr;
  uint64_t size_ = 0;
};

// Writes a file atomically: construct, append() bytes, commit(). Destroying an uncommitted
// writer removes the temporary file. Errors name the final path.
class AtomicFileWriter {
 public:
  explicit AtomicFileWriter(std::string path, const char* component = "file");
  ~AtomicFileWriter();
  AtomicFileWriter(const AtomicFileWriter&) = delete;
  AtomicFileWriter& operator=(const AtomicFileWriter&) = delete;

  void append(const void* data, size_t n);
  void append(std::span<const std::byte> bytes) { append(bytes.data(), bytes.size()); }
  uint64_t bytes_written() const { return written_; }
  // fsync, rename over the target, fsync the folder.
  void commit();

 private:
  std::string path_;
  std::string tmp_path_;
  const char* component_;
  int fd_ = -1;
  uint64_t written_ = 0;
  bool committed_ = false;
};

// Convenience: atomically replaces `path` with `bytes`.
void write_file_atomic(const std::string& path, std::span<const std::byte> bytes, const char* component = "file");

// fsyncs a folder so a rename inside it is durable. Throws on failure.
void fsync_directory(const std::string& dir, const char* component = "file");

}  // namespace kestrel::models
