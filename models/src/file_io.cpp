// Read-only memory maps and atomic (temp + fsync + rename + fsync folder) file writes, and the
// checks that keep readers on regular files inside the folder that named them.
#include "kestrel/models/file_io.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include "kestrel/runtime/error.h"

namespace kestrel::models {

namespace {
std::string errno_text() { return std::strerror(errno); }

std::string parent_dir(const std::string& path) {
  std::filesystem::path p(path);
  auto parent = p.parent_path();
  return parent.empty() ? std::string(".") : parent.string();
}

// "a FIFO", "a folder", ...: what a path that is not a regular file names.
const char* file_kind(mode_t mode) {
  if (S_ISDIR(mode)) return "a folder";
  if (S_ISFIFO(mode)) return "a FIFO (named pipe)";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  return "not a regular file";
}

// True when `p` is `base` or lies below it (both absolute, normalised).
bool is_within(const std::filesystem::path& p, const std::filesystem::path& base) {
  auto b = base.begin(), q = p.begin();
  for (; b != base.end(); ++b, ++q) {
    if (b->empty()) continue;  // a trailing separator
    if (q == p.end() || *q != *b) return false;
  }
  return true;
}
}  // namespace

void require_regular_file(const std::string& path, const char* component) {
  struct stat st {};
  KESTREL_CHECK(::stat(path.c_str(), &st) == 0, component, "cannot open '", path, "': ", errno_text());
  KESTREL_CHECK(S_ISREG(st.st_mode), component, "'", path, "' is ", file_kind(st.st_mode),
                ", not a regular file; only regular files are read");
}

std::string confined_path(const std::string& dir, const std::string& name, const std::string& named_by,
                          const char* component) {
  namespace fs = std::filesystem;
  const fs::path rel(name);
  KESTREL_CHECK(!name.empty() && name.find('\0') == std::string::npos, component, "'", named_by,
                "' names an empty or malformed file name");
  KESTREL_CHECK(rel.is_relative() && !rel.has_root_name(), component, "'", named_by, "' names '", name,
                "', an absolute path; only file names relative to its folder are allowed");
  for (const fs::path& part : rel)
    KESTREL_CHECK(part != "..", component, "'", named_by, "' names '", name,
                  "', which climbs out of its folder ('..'); only file names inside its folder are allowed");
  std::error_code ec;
  const fs::path base = fs::canonical(dir.empty() ? fs::path(".") : fs::path(dir), ec);
  KESTREL_CHECK(!ec, component, "cannot resolve the folder of '", named_by, "': ", ec.message());
  const fs::path real = fs::weakly_canonical(base / rel, ec);  // symlinks of the existing part resolved
  KESTREL_CHECK(!ec, component, "'", named_by, "' names '", name, "', which cannot be resolved: ", ec.message());
  // A Hugging Face hub cache snapshot (<repo>/snapshots/<revision>/) holds symlinks to <repo>/blobs.
  const bool hub_blob = base.parent_path().filename() == "snapshots" &&
                        is_within(real, base.parent_path().parent_path() / "blobs");
  KESTREL_CHECK(is_within(real, base) || hub_blob, component, "'", named_by, "' names '", name,
                "', which resolves (through symlinks) to '", real.string(), "', outside its folder '",
                base.string(), "'");
  return (fs::path(dir) / rel).string();
}

std::shared_ptr<const MappedFile> MappedFile::open(const std::string& path, const char* component) {
  // stat before open: opening a FIFO for reading blocks until a writer appears. O_NONBLOCK covers
  // a path swapped for a FIFO between the two calls; fstat below checks what was opened.
  require_regular_file(path, component);
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
  KESTREL_CHECK(fd >= 0, component, "cannot open '", path, "': ", errno_text());
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    std::string why = errno_text();
    ::close(fd);
    throw make_error(component, "cannot stat '", path, "': ", why);
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    throw make_error(component, "'", path, "' is ", file_kind(st.st_mode), ", not a regular file");
  }
  std::shared_ptr<MappedFile> m(new MappedFile());
  m->path_ = path;
  m->size_ = static_cast<uint64_t>(st.st_size);
  if (m->size_ > 0) {
    void* p = ::mmap(nullptr, m->size_, PROT_READ, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
      std::string why = errno_text();
      ::close(fd);
      throw make_error(component, "cannot map '", path, "' (", m->size_, " bytes): ", why);
    }
    m->data_ = p;
  }
  ::close(fd);  // the mapping keeps the file referenced
  return m;
}

MappedFile::~MappedFile() {
  if (data_ != nullptr) ::munmap(data_, size_);
}

AtomicFileWriter::AtomicFileWriter(std::string path, const char* component)
    : path_(std::move(path)), component_(component) {
  static std::atomic<uint64_t> counter{0};
  std::filesystem::path p(path_);
  std::string name = p.filename().string();
  KESTREL_CHECK(!name.empty(), component_, "cannot write '", path_, "': not a file name");
  tmp_path_ = (p.parent_path() / ("." + name + ".tmp." + std::to_string(::getpid()) + "." +
                                  std::to_string(counter.fetch_add(1))))
                  .string();
  fd_ = ::open(tmp_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  KESTREL_CHECK(fd_ >= 0, component_, "cannot create temporary file for '", path_, "' (", tmp_path_,
                "): ", errno_text());
}

AtomicFileWriter::~AtomicFileWriter() {
  if (fd_ >= 0) ::close(fd_);
  if (!committed_) ::unlink(tmp_path_.c_str());
}

void AtomicFileWriter::append(const void* data, size_t n) {
  KESTREL_CHECK(fd_ >= 0 && !committed_, component_, "write to '", path_, "' after commit");
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    size_t chunk = n < (size_t{1} << 30) ? n : (size_t{1} << 30);
    ssize_t w = ::write(fd_, p, chunk);
    if (w < 0 && errno == EINTR) continue;
    KESTREL_CHECK(w > 0, component_, "writing '", path_, "' failed after ", written_, " bytes: ",
                  w < 0 ? errno_text() : std::string("no progress"));
    p += w;
    n -= static_cast<size_t>(w);
    written_ += static_cast<uint64_t>(w);
  }
}

void AtomicFileWriter::commit() {
  KESTREL_CHECK(fd_ >= 0 && !committed_, component_, "'", path_, "' committed twice");
  KESTREL_CHECK(::fsync(fd_) == 0, component_, "fsync of '", path_, "' failed: ", errno_text());
  int rc = ::close(fd_);
  fd_ = -1;
  KESTREL_CHECK(rc == 0, component_, "close of '", path_, "' failed: ", errno_text());
  KESTREL_CHECK(::rename(tmp_path_.c_str(), path_.c_str()) == 0, component_, "cannot rename '", tmp_path_,
                "' to '", path_, "': ", errno_text());
  committed_ = true;
  fsync_directory(parent_dir(path_), component_);
}

void write_file_atomic(const std::string& path, std::span<const std::byte> bytes, const char* component) {
  AtomicFileWriter w(path, component);
  w.append(bytes);
  w.commit();
}

void fsync_directory(const std::string& dir, const char* component) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  KESTREL_CHECK(fd >= 0, component, "cannot open folder '", dir, "' to fsync it: ", errno_text());
  int rc = ::fsync(fd);
  std::string why = rc != 0 ? errno_text() : std::string();
  ::close(fd);
  KESTREL_CHECK(rc == 0, component, "fsync of folder '", dir, "' failed: ", why);
}

}  // namespace kestrel::models
