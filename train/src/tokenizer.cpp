#include "kestrel/train/tokenizer.h"

#include "kestrel/runtime/error.h"
#include "kestrel/train/bpe_tokenizer.h"

namespace kestrel::train {

std::vector<int64_t> ByteTokenizer::encode(const std::string& text) const {
  std::vector<int64_t> ids;
  ids.reserve(text.size());
  for (unsigned char c : text) ids.push_back(c);
  return ids;
}

std::string ByteTokenizer::decode(const std::vector<int64_t>& ids, bool show_special) const {
  std::string s;
  for (int64_t id : ids) {
    KESTREL_CHECK(id >= 0 && id < kVocabSize, "tokenizer", "id ", id, " outside the byte vocabulary [0, ", kVocabSize, ")");
    if (id < 256) {
      s.push_back(static_cast<char>(id));
    } else if (show_special) {
      s += id == kPad ? "<pad>" : id == kBos ? "<bos>" : id == kEos ? "<eos>" : "<image>";
    }
  }
  return s;
}

int64_t ByteTokenizer::token_id(const std::string& token) const {
  if (token == "<pad>") return kPad;
  if (token == "<bos>") return kBos;
  if (token == "<eos>") return kEos;
  if (token == "<image>") return kImage;
  return -1;
}

std::unique_ptr<TextTokenizer> load_text_tokenizer(const std::string& spec) {
  if (spec.empty() || spec == "byte") return std::make_unique<ByteTokenizer>();
  return std::make_unique<BpeTokenizer>(BpeTokenizer::from_file(spec));
}

}  // namespace kestrel::train
