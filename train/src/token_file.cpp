// llm.c token-file reading (mmap + header validation), writing (atomic), vocab checks, shard globs.
#include "kestrel/train/token_file.h"

#include <glob.h>
#include <sys/stat.h>

#include <algorithm>
#include <cstring>
#include <filesystem>

#include "kestrel/runtime/error.h"

namespace kestrel::train {

namespace {
constexpr const char* kComp = "token_file";

int32_t read_i32_le(const std::byte* p) {
  uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = (v << 8) | static_cast<uint32_t>(p[i]);
  return static_cast<int32_t>(v);
}

void put_i32_le(std::byte* p, int32_t v) {
  uint32_t u = static_cast<uint32_t>(v);
  for (int i = 0; i < 4; ++i) p[i] = static_cast<std::byte>((u >> (8 * i)) & 0xff);
}

// Token i of a little-endian array of `f` tokens.
inline uint32_t load_token(const std::byte* base, TokenFormat f, int64_t i) {
  if (f == TokenFormat::U16) {
    const std::byte* p = base + 2 * i;
    return static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8);
  }
  const std::byte* p = base + 4 * i;
  return static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8) | (static_cast<uint32_t>(p[2]) << 16) |
         (static_cast<uint32_t>(p[3]) << 24);
}
}  // namespace

TokenFile TokenFile::open(const std::string& path) {
  TokenFile f;
  f.map_ = models::MappedFile::open(path, kComp);
  const uint64_t size = f.map_->size();
  KESTREL_CHECK(size >= static_cast<uint64_t>(kTokenHeaderBytes), kComp, "'", path, "' is truncated: ", size,
                " bytes, smaller than the ", kTokenHeaderBytes, "-byte header");
  const std::byte* h = f.map_->data();
  const int32_t magic = read_i32_le(h), version = read_i32_le(h + 4), count = read_i32_le(h + 8);
  if (magic == kTokenMagicU16) {
    KESTREL_CHECK(version == kTokenVersionU16, kComp, "'", path, "': uint16 token file (magic ", magic,
                  ") has version ", version, ", expected ", kTokenVersionU16);
    f.format_ = TokenFormat::U16;
  } else if (magic == kTokenMagicU32) {
    KESTREL_CHECK(version == kTokenVersionU32, kComp, "'", path, "': uint32 token file (magic ", magic,
                  ") has version ", version, ", expected ", kTokenVersionU32);
    f.format_ = TokenFormat::U32;
  } else {
    throw make_error(kComp, "'", path, "': bad magic number ", magic, " (expected ", kTokenMagicU16,
                     " for uint16 or ", kTokenMagicU32, " for uint32 llm.c token files)");
  }
  KESTREL_CHECK(count >= 0, kComp, "'", path, "': negative token count ", count, " in the header");
  f.count_ = count;
  const uint64_t want = static_cast<uint64_t>(kTokenHeaderBytes) +
                        static_cast<uint64_t>(count) * static_cast<uint64_t>(token_size(f.format_));
  KESTREL_CHECK(size == want, kComp, "'", path, "': header says ", count, " tokens (", want,
                " bytes with the header) but the file has ", size, " bytes",
                size < want ? " (truncated)" : " (trailing bytes)");
  return f;
}

std::span<const std::byte> TokenFile::token_bytes() const {
  return map_->bytes().subspan(kTokenHeaderBytes, static_cast<size_t>(count_ * token_size(format_)));
}

uint32_t TokenFile::operator[](int64_t i) const { return load_token(map_->data() + kTokenHeaderBytes, format_, i); }

uint32_t TokenFile::at(int64_t i) const {
  KESTREL_CHECK(i >= 0 && i < count_, kComp, "'", path(), "': token index ", i, " out of range [0, ", count_, ")");
  return (*this)[i];
}

void TokenFile::read(int64_t start, std::span<uint32_t> out) const {
  const int64_t n = static_cast<int64_t>(out.size());
  KESTREL_CHECK(start >= 0 && start <= count_ && n <= count_ - start, kComp, "'", path(), "': read of ", n,
                " tokens at ", start, " runs past the ", count_, " tokens in the file");
  const std::byte* base = map_->data() + kTokenHeaderBytes;
  if (n == 0) return;
  if (format_ == TokenFormat::U32) {
    std::memcpy(out.data(), base + 4 * start, static_cast<size_t>(4 * n));  // little-endian host
    return;
  }
  for (int64_t i = 0; i < n; ++i) out[i] = load_token(base, format_, start + i);
}

void TokenFile::read(int64_t start, std::span<int32_t> out) const {
  read(start, std::span<uint32_t>(reinterpret_cast<uint32_t*>(out.data()), out.size()));
  for (int32_t v : out)
    KESTREL_CHECK(v >= 0, kComp, "'", path(), "': token id ", static_cast<uint32_t>(v), " does not fit in int32");
}

void TokenFile::check_vocab(int64_t vocab_size) const {
  KESTREL_CHECK(vocab_size > 0, kComp, "'", path(), "': vocab size must be positive, got ", vocab_size);
  const std::byte* base = map_->data() + kTokenHeaderBytes;
  for (int64_t i = 0; i < count_; ++i) {
    const uint32_t t = load_token(base, format_, i);
    KESTREL_CHECK(static_cast<int64_t>(t) < vocab_size, kComp, "'", path(), "': token ", t, " at position ", i,
                  " is >= vocab size ", vocab_size);
  }
}

void write_token_file(const std::string& path, std::span<const uint32_t> tokens, TokenFormat format) {
  const int64_t n = static_cast<int64_t>(tokens.size());
  KESTREL_CHECK(n < (int64_t{1} << 31), kComp, "writing '", path, "': ", n,
                " tokens do not fit the int32 count of the header; split into shards");
  if (format == TokenFormat::U16) {
    for (int64_t i = 0; i < n; ++i)
      KESTREL_CHECK(tokens[i] <= 0xffffu, kComp, "writing '", path, "': token ", tokens[i], " at position ", i,
                    " does not fit the uint16 format; use the uint32 format");
  }
  std::vector<std::byte> header(kTokenHeaderBytes, std::byte{0});
  put_i32_le(header.data(), format == TokenFormat::U16 ? kTokenMagicU16 : kTokenMagicU32);
  put_i32_le(header.data() + 4, format == TokenFormat::U16 ? kTokenVersionU16 : kTokenVersionU32);
  put_i32_le(header.data() + 8, static_cast<int32_t>(n));
  models::AtomicFileWriter w(path, kComp);
  w.append(header);
  // Convert in chunks so a large write does not double memory.
  constexpr int64_t kChunk = 1 << 16;
  std::vector<std::byte> buf(static_cast<size_t>(kChunk * token_size(format)));
  for (int64_t s = 0; s < n; s += kChunk) {
    const int64_t m = std::min(kChunk, n - s);
    for (int64_t i = 0; i < m; ++i) {
      const uint32_t t = tokens[s + i];
      std::byte* p = buf.data() + i * token_size(format);
      p[0] = static_cast<std::byte>(t & 0xff);
      p[1] = static_cast<std::byte>((t >> 8) & 0xff);
      if (format == TokenFormat::U32) {
        p[2] = static_cast<std::byte>((t >> 16) & 0xff);
        p[3] = static_cast<std::byte>((t >> 24) & 0xff);
      }
    }
    w.append(buf.data(), static_cast<size_t>(m * token_size(format)));
  }
  w.commit();
}

std::vector<std::string> expand_shards(const std::string& patterns) {
  std::vector<std::string> out;
  size_t start = 0;
  bool any_pattern = false;
  while (start <= patterns.size()) {
    size_t comma = patterns.find(',', start);
    if (comma == std::string::npos) comma = patterns.size();
    std::string pat = patterns.substr(start, comma - start);
    start = comma + 1;
    // trim spaces around list items
    pat.erase(0, pat.find_first_not_of(" \t"));
    if (const size_t e = pat.find_last_not_of(" \t"); e != std::string::npos) pat.erase(e + 1);
    if (pat.empty()) continue;
    any_pattern = true;
    if (pat.find_first_of("*?[") == std::string::npos) {
      std::error_code ec;
      KESTREL_CHECK(std::filesystem::exists(pat, ec), kComp, "shard file '", pat, "' does not exist");
      models::require_regular_file(pat, kComp);
      out.push_back(pat);
      continue;
    }
    glob_t g{};
    const int rc = ::glob(pat.c_str(), 0, nullptr, &g);  // results come sorted
    std::vector<std::string> found;
    if (rc == 0)
      for (size_t i = 0; i < g.gl_pathc; ++i) found.emplace_back(g.gl_pathv[i]);
    ::globfree(&g);
    KESTREL_CHECK(rc == 0 || rc == GLOB_NOMATCH, kComp, "cannot expand shard pattern '", pat, "' (glob error ", rc, ")");
    KESTREL_CHECK(!found.empty(), kComp, "no files match the shard pattern '", pat, "'");
    // A FIFO or device among the matches would block or stream forever when opened: refuse it here,
    // naming the pattern that matched it.
    for (const std::string& f : found) {
      struct stat st {};
      KESTREL_CHECK(::stat(f.c_str(), &st) == 0 && S_ISREG(st.st_mode), kComp, "shard pattern '", pat,
                    "' matches '", f, "', which is not a regular file (a folder, FIFO or device); only regular ",
                    "token files are read");
    }
    std::sort(found.begin(), found.end());
    out.insert(out.end(), found.begin(), found.end());
  }
  KESTREL_CHECK(any_pattern, kComp, "empty shard pattern");
  return out;
}

}  // namespace kestrel::train
