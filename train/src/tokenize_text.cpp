#include "kestrel/train/tokenize_text.h"

#include <fstream>
#include <nlohmann/json.hpp>

#include "kestrel/runtime/error.h"

namespace kestrel::train {

TokenizeResult tokenize_to_token_file(const TextTokenizer& tok, const std::vector<std::string>& inputs,
                                      const std::string& output, const std::string& separator) {
  KESTREL_CHECK(!inputs.empty(), "tokenize", "no input files");
  TokenizeResult r;
  if (separator.empty()) {
    r.separator_id = tok.token_id("<|endoftext|>");
    if (r.separator_id < 0) r.separator_id = tok.token_id("<eos>");
    KESTREL_CHECK(r.separator_id >= 0, "tokenize",
                  "the vocabulary has neither <|endoftext|> nor <eos>; name the document separator token");
  } else {
    r.separator_id = tok.token_id(separator);
    KESTREL_CHECK(r.separator_id >= 0, "tokenize", "separator token '", separator, "' is not in the vocabulary");
  }
  r.format = tok.vocab_size() <= 65536 ? TokenFormat::U16 : TokenFormat::U32;
  std::vector<uint32_t> out;
  auto add_document = [&](const std::string& text) {
    out.push_back(static_cast<uint32_t>(r.separator_id));
    for (int64_t id : tok.encode(text)) out.push_back(static_cast<uint32_t>(id));
    ++r.documents;
  };
  for (const std::string& path : inputs) {
    std::ifstream f(path);
    KESTREL_CHECK(f.good(), "tokenize", "cannot open '", path, "'");
    const bool jsonl = path.size() >= 6 && path.compare(path.size() - 6, 6, ".jsonl") == 0;
    std::string line;
    for (int64_t n = 1; std::getline(f, line); ++n) {
      if (!line.empty() && line.back() == '\r') line.pop_back();
      if (line.find_first_not_of(" \t") == std::string::npos) continue;
      if (!jsonl) {
        add_document(line);
        continue;
      }
      nlohmann::json j;
      try {
        j = nlohmann::json::parse(line);
      } catch (const std::exception& e) {
        throw make_error("tokenize", path, ":", n, ": not valid JSON (", e.what(), ")");
      }
      KESTREL_CHECK(j.is_object() && j.contains("text") && j["text"].is_string(), "tokenize", path, ":", n,
                    ": expected {\"text\": \"...\"}");
      add_document(j["text"].get<std::string>());
    }
  }
  KESTREL_CHECK(r.documents > 0, "tokenize", "the inputs hold no documents");
  write_token_file(output, out, r.format);
  r.tokens = static_cast<int64_t>(out.size());
  return r;
}

}  // namespace kestrel::train
