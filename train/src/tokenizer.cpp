#include "kestrel/train/tokenizer.h"

#include "kestrel/runtime/error.h"

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

}  // namespace kestrel::train
