// Byte-level BPE from an HF tokenizer.json (see bpe_tokenizer.h for what is supported and why).
// Encoding: added tokens are cut out of the raw text first; each remaining stretch is split by the
// pre-tokenizer, each piece's bytes become byte symbols (the GPT-2 byte-to-unicode map), and merges
// are applied lowest rank first until none applies (the standard BPE rule: ranks, not left to right).
#include "kestrel/train/bpe_tokenizer.h"

#include <algorithm>
#include <array>
#include <mutex>

#include "kestrel/models/config.h"
#include "kestrel/models/json_text.h"
#include "kestrel/runtime/error.h"

namespace kestrel::train {
namespace {
using nlohmann::json;
constexpr const char* kComp = "tokenizer";

std::string utf8(char32_t cp) {
  std::string s;
  if (cp < 0x80) {
    s.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    s.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    s.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    s.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    s.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    s.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
  return s;
}

// GPT-2's map: the printable bytes '!'..'~', 0xA1..0xAC and 0xAE..0xFF stand for themselves; the
// other 68 bytes take the code points 256, 257, ... in byte order.
struct ByteMap {
  std::array<std::string, 256> symbol;
  std::unordered_map<std::string, uint8_t> byte_of;
  ByteMap() {
    char32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
      symbol[static_cast<size_t>(b)] = utf8(printable ? static_cast<char32_t>(b) : next++);
      byte_of[symbol[static_cast<size_t>(b)]] = static_cast<uint8_t>(b);
    }
  }
};
const ByteMap& byte_map() {
  static const ByteMap m;
  return m;
}

// The Split regexes this file implements (as JSON-decoded strings).
const char* const kGpt2Pattern = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
const char* const kQwen2Pattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
const char* const kLlama3Pattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

bool truthy(const json& j, const char* key) { return j.contains(key) && j[key].is_boolean() && j[key].get<bool>(); }

// Reads the pre-tokenizer: sets `split` and `prefix_space`; returns an error message or "".
std::string read_pre_tokenizer(const json& pt, BpeSplit& split, bool& prefix_space, bool& have_split) {
  if (pt.is_null()) return "no pre_tokenizer (byte-level BPE needs ByteLevel)";
  const std::string type = pt.value("type", "");
  if (type == "Sequence") {
    bool byte_level = false;
    for (const json& p : pt.value("pretokenizers", json::array())) {
      const std::string t = p.value("type", "");
      if (t == "ByteLevel" && (have_split || !truthy(p, "use_regex"))) {
        byte_level = true;
        prefix_space = prefix_space || truthy(p, "add_prefix_space");
        continue;
      }
      if (std::string e = read_pre_tokenizer(p, split, prefix_space, have_split); !e.empty()) return e;
      byte_level = byte_level || t == "ByteLevel";
    }
    return byte_level ? "" : "a Sequence pre_tokenizer without ByteLevel";
  }
  if (type == "ByteLevel") {
    prefix_space = prefix_space || truthy(pt, "add_prefix_space");
    if (!pt.contains("use_regex") || truthy(pt, "use_regex")) {
      if (have_split) return "two split patterns";
      split = BpeSplit::Gpt2;
      have_split = true;
    }
    return "";
  }
  if (type == "Split") {
    if (have_split) return "two split patterns";
    const json& pat = pt.value("pattern", json::object());
    const std::string re = pat.is_object() && pat.contains("Regex") ? pat["Regex"].get<std::string>() : "";
    if (re == kGpt2Pattern) split = BpeSplit::Gpt2;
    else if (re == kQwen2Pattern) split = BpeSplit::Qwen2;
    else if (re == kLlama3Pattern) split = BpeSplit::Llama3;
    else return "a Split pattern other than the GPT-2, Qwen2 and Llama 3 regexes: " + pat.dump();
    if (pt.value("behavior", "Isolated") != "Isolated" || truthy(pt, "invert"))
      return "a Split pre_tokenizer with behavior " + pt.value("behavior", "") + " (only Isolated, not inverted)";
    have_split = true;
    return "";
  }
  return "pre_tokenizer type '" + type + "'";
}

uint64_t pair_key(int64_t a, int64_t b) { return (static_cast<uint64_t>(a) << 32) | static_cast<uint64_t>(b); }

}  // namespace

const std::string& byte_level_symbol(uint8_t byte) { return byte_map().symbol[byte]; }

struct BpeTokenizer::Cache {
  std::mutex mu;
  std::unordered_map<std::string, std::vector<int64_t>> pieces;
};

BpeTokenizer BpeTokenizer::from_file(const std::string& path) {
  return from_json(models::read_json_file(path, kComp), path);  // regular files only, errors quote no bytes
}

// A function-try-block: any JSON-library error left (a field of the wrong type read by value() or
// get()) becomes an error naming the file, never a raw nlohmann exception.
BpeTokenizer BpeTokenizer::from_json(const json& j, const std::string& source) try {
  KESTREL_CHECK(j.is_object() && j.contains("model") && j["model"].is_object(), kComp, "'", source,
                "' is not an HF tokenizer.json (no \"model\" object)");
  const json& m = j["model"];
  const std::string type = m.value("type", "");
  KESTREL_CHECK(type == "BPE", kComp, "'", source, "': model.type is '", type,
                "'; only byte-level BPE tokenizers (GPT-2, Qwen2, Llama 3 style) are supported");
  KESTREL_CHECK(!truthy(m, "byte_fallback"), kComp, "'", source,
                "': model.byte_fallback is a SentencePiece-style BPE (<0xNN> tokens), not byte-level BPE");
  for (const char* k : {"continuing_subword_prefix", "end_of_word_suffix"})
    KESTREL_CHECK(!m.contains(k) || m[k].is_null() || m[k] == "", kComp, "'", source, "': model.", k,
                  " is set; byte-level BPE does not use it");
  KESTREL_CHECK(m.contains("vocab") && m["vocab"].is_object() && m.contains("merges") && m["merges"].is_array(),
                kComp, "'", source, "': model.vocab (object) and model.merges (array) are required");
  if (j.contains("normalizer") && !j["normalizer"].is_null()) {
    const std::string nt = j["normalizer"].value("type", "");
    KESTREL_CHECK(nt == "NFC", kComp, "'", source, "': normalizer '", nt, "' is not supported (none or NFC)");
  }
  BpeTokenizer t;
  bool have_split = false;
  std::string err = read_pre_tokenizer(j.value("pre_tokenizer", json()), t.split_, t.add_prefix_space_, have_split);
  KESTREL_CHECK(err.empty(), kComp, "'", source, "' is not a byte-level BPE tokenizer: ", err);
  KESTREL_CHECK(have_split, kComp, "'", source, "': the pre_tokenizer has no split (ByteLevel use_regex or Split)");
  t.ignore_merges_ = truthy(m, "ignore_merges");

  // The id table is sized by the largest id: an id far past the number of tokens the file holds
  // would allocate gigabytes for nothing (gaps of up to kIdGap unused ids are allowed).
  constexpr int64_t kIdGap = int64_t{1} << 20;
  const size_t n_added = j.contains("added_tokens") && j["added_tokens"].is_array() ? j["added_tokens"].size() : 0;
  const int64_t id_limit = static_cast<int64_t>(m["vocab"].size() + n_added) + kIdGap;
  auto add_token = [&](const std::string& tok, int64_t id, bool added) {
    KESTREL_CHECK(id >= 0 && id < (int64_t{1} << 31), kComp, "'", source, "': token '", tok, "' has id ", id);
    KESTREL_CHECK(id < id_limit, kComp, "'", source, "': token '", tok, "' has id ", id, ", far beyond the ",
                  id_limit - kIdGap, " tokens the file holds (ids must be nearly dense; at most ", kIdGap,
                  " unused ids)");
    t.vocab_[tok] = id;
    if (id >= static_cast<int64_t>(t.id_to_token_.size())) {
      t.id_to_token_.resize(static_cast<size_t>(id) + 1);
      t.id_is_added_.resize(static_cast<size_t>(id) + 1, 0);
    }
    t.id_to_token_[static_cast<size_t>(id)] = tok;
    t.id_is_added_[static_cast<size_t>(id)] = added ? 1 : 0;
  };
  for (auto it = m["vocab"].begin(); it != m["vocab"].end(); ++it) {
    KESTREL_CHECK(it.value().is_number_integer(), kComp, "'", source, "': vocab entry '", it.key(), "' is not an id");
    add_token(it.key(), it.value().get<int64_t>(), false);
  }
  for (const json& a : j.value("added_tokens", json::array())) {
    KESTREL_CHECK(a.is_object() && a.contains("id") && a["id"].is_number_integer() && a.contains("content") &&
                      a["content"].is_string(),
                  kComp, "'", source, "': added_tokens entries need an integer id and a string content, got ",
                  a.dump().substr(0, 200));
    const std::string content = a["content"];
    KESTREL_CHECK(!content.empty(), kComp, "'", source, "': empty added token");
    add_token(content, a["id"].get<int64_t>(), true);
    t.added_.emplace_back(content, a["id"].get<int64_t>());
  }
  std::sort(t.added_.begin(), t.added_.end(), [](auto& x, auto& y) { return x.first.size() > y.first.size(); });
  for (auto& a : t.added_) t.added_first_[static_cast<unsigned char>(a.first[0])] = true;
  t.vocab_size_ = static_cast<int64_t>(t.id_to_token_.size());
  if (m.contains("unk_token") && m["unk_token"].is_string()) {
    auto u = t.vocab_.find(m["unk_token"].get<std::string>());
    KESTREL_CHECK(u != t.vocab_.end(), kComp, "'", source, "': unk_token '", m["unk_token"].get<std::string>(),
                  "' is not in the vocabulary");
    t.unk_id_ = u->second;
  }

  int32_t rank = 0;
  for (const json& mg : m["merges"]) {
    std::string a, b;
    if (mg.is_string()) {  // "a b": byte-level symbols never hold a plain space, so one split is exact
      const std::string s = mg;
      const size_t sp = s.find(' ');
      KESTREL_CHECK(sp != std::string::npos && sp > 0 && sp + 1 < s.size() && s.find(' ', sp + 1) == std::string::npos,
                    kComp, "'", source, "': merge ", rank, " '", s, "' is not \"left right\"");
      a = s.substr(0, sp);
      b = s.substr(sp + 1);
    } else {
      KESTREL_CHECK(mg.is_array() && mg.size() == 2 && mg[0].is_string() && mg[1].is_string(), kComp, "'", source,
                    "': merge ", rank, " is neither \"left right\" nor [left, right]: ", mg.dump());
      a = mg[0];
      b = mg[1];
    }
    auto ia = t.vocab_.find(a), ib = t.vocab_.find(b), ir = t.vocab_.find(a + b);
    KESTREL_CHECK(ia != t.vocab_.end() && ib != t.vocab_.end() && ir != t.vocab_.end(), kComp, "'", source,
                  "': merge ", rank, " (", a, " + ", b, ") uses a token missing from the vocabulary");
    t.merges_.emplace(pair_key(ia->second, ib->second), std::make_pair(rank, ir->second));  // first rank wins
    ++rank;
  }
  t.cache_ = std::make_shared<Cache>();
  return t;
} catch (const json::exception& e) {
  throw make_error(kComp, "'", source, "': a field has the wrong JSON type (", models::json_error_text(e), ")");
}

int64_t BpeTokenizer::token_id(const std::string& token) const {
  auto it = vocab_.find(token);
  return it == vocab_.end() ? -1 : it->second;
}

int64_t BpeTokenizer::symbol_id(const std::string& symbol) const {
  auto it = vocab_.find(symbol);
  if (it != vocab_.end()) return it->second;
  if (unk_id_ >= 0) return unk_id_;
  const uint8_t byte = byte_map().byte_of.at(symbol);
  throw make_error(kComp, "byte 0x", "0123456789abcdef"[byte >> 4], "0123456789abcdef"[byte & 15], " (symbol '", symbol,
                   "') is not in the vocabulary and the tokenizer has no unk_token");
}

void BpeTokenizer::encode_piece(const std::string& piece, std::vector<int64_t>& out) const {
  {
    std::lock_guard<std::mutex> lock(cache_->mu);
    auto it = cache_->pieces.find(piece);
    if (it != cache_->pieces.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  std::string mapped;
  for (unsigned char c : piece) mapped += byte_map().symbol[c];
  std::vector<int64_t> ids;
  auto whole = ignore_merges_ ? vocab_.find(mapped) : vocab_.end();
  if (whole != vocab_.end()) {
    ids.push_back(whole->second);
  } else {
    for (unsigned char c : piece) ids.push_back(symbol_id(byte_map().symbol[c]));
    // Merge the lowest-ranked adjacent pair (the leftmost of equal ranks) until none is in the table.
    while (ids.size() > 1) {
      int32_t best = INT32_MAX;
      size_t at = 0;
      int64_t merged = 0;
      for (size_t i = 0; i + 1 < ids.size(); ++i) {
        auto it = merges_.find(pair_key(ids[i], ids[i + 1]));
        if (it != merges_.end() && it->second.first < best) {
          best = it->second.first;
          at = i;
          merged = it->second.second;
        }
      }
      if (best == INT32_MAX) break;
      ids[at] = merged;
      ids.erase(ids.begin() + static_cast<std::ptrdiff_t>(at) + 1);
    }
  }
  out.insert(out.end(), ids.begin(), ids.end());
  std::lock_guard<std::mutex> lock(cache_->mu);
  if (cache_->pieces.size() < (1u << 18)) cache_->pieces.emplace(piece, std::move(ids));
}

std::vector<int64_t> BpeTokenizer::encode(const std::string& text) const {
  std::vector<int64_t> out;
  // HF pre-tokenizes each stretch between added tokens on its own (prefix space included).
  auto encode_plain = [&](const std::string& s) {
    if (s.empty()) return;
    std::string t = add_prefix_space_ && s[0] != ' ' ? " " + s : s;
    for (const std::string& piece : bpe_pre_tokenize(t, split_)) encode_piece(piece, out);
  };
  size_t start = 0, i = 0;
  while (i < text.size()) {
    const std::pair<std::string, int64_t>* hit = nullptr;
    if (added_first_[static_cast<unsigned char>(text[i])])
      for (const auto& a : added_)  // longest first
      if (text.compare(i, a.first.size(), a.first) == 0) {
        hit = &a;
        break;
      }
    if (!hit) {
      ++i;
      continue;
    }
    encode_plain(text.substr(start, i - start));
    out.push_back(hit->second);
    i += hit->first.size();
    start = i;
  }
  encode_plain(text.substr(start));
  return out;
}

std::string BpeTokenizer::decode(const std::vector<int64_t>& ids) const {
  std::string out, symbols;
  auto flush = [&] {
    // Byte symbols are 1- or 2-byte UTF-8 sequences (code points < 0x144).
    for (size_t i = 0; i < symbols.size();) {
      const size_t len = (static_cast<unsigned char>(symbols[i]) & 0x80) ? 2 : 1;
      auto it = byte_map().byte_of.find(symbols.substr(i, len));
      KESTREL_CHECK(it != byte_map().byte_of.end(), kComp, "token text '", symbols, "' holds a non-byte symbol");
      out.push_back(static_cast<char>(it->second));
      i += len;
    }
    symbols.clear();
  };
  for (int64_t id : ids) {
    KESTREL_CHECK(id >= 0 && id < vocab_size_ && !id_to_token_[static_cast<size_t>(id)].empty(), kComp, "id ", id,
                  " is not in the vocabulary (size ", vocab_size_, ")");
    if (id_is_added_[static_cast<size_t>(id)]) {
      flush();
      out += id_to_token_[static_cast<size_t>(id)];
    } else {
      symbols += id_to_token_[static_cast<size_t>(id)];
    }
  }
  flush();
  return out;
}

}  // namespace kestrel::train
