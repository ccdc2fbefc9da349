// Conversation JSONL -> chat-templated, assistant-masked, packed token rows (policy in chat_data.h).
#include "kestrel/train/chat_data.h"

#include <filesystem>
#include <fstream>

#include "kestrel/models/file_io.h"
#include "kestrel/runtime/error.h"

namespace kestrel::train {
namespace {
using nlohmann::json;
constexpr const char* kComp = "chat_data";
constexpr const char* kImage = "<image>";

// Python's str.strip() on ASCII whitespace (Jinja's trim in the Llama-3 template).
std::string strip(const std::string& s) {
  const char* ws = " \t\n\r\f\v";
  const size_t b = s.find_first_not_of(ws);
  if (b == std::string::npos) return "";
  return s.substr(b, s.find_last_not_of(ws) - b + 1);
}

size_t count_of(const std::string& s, const std::string& what) {
  size_t n = 0;
  for (size_t p = s.find(what); p != std::string::npos; p = s.find(what, p + what.size())) ++n;
  return n;
}

// One piece of a rendered conversation: a special token (by name) or text, trained or not.
struct Piece {
  bool special;
  std::string text;
  bool trained;
};

std::vector<Piece> pieces(const Conversation& c, ChatTemplate t) {
  std::vector<Piece> out;
  if (t == ChatTemplate::ChatMl) {
    for (const ChatTurn& turn : c.turns) {
      const bool a = turn.role == "assistant";
      out.push_back({true, "<|im_start|>", false});
      out.push_back({false, turn.role + "\n", false});
      out.push_back({false, turn.content, a});
      out.push_back({true, "<|im_end|>", a});
      out.push_back({false, "\n", false});
    }
  } else {
    out.push_back({true, "<|begin_of_text|>", false});
    for (const ChatTurn& turn : c.turns) {
      const bool a = turn.role == "assistant";
      out.push_back({true, "<|start_header_id|>", false});
      out.push_back({false, turn.role, false});
      out.push_back({true, "<|end_header_id|>", false});
      out.push_back({false, "\n\n", false});
      out.push_back({false, strip(turn.content), a});
      out.push_back({true, "<|eot_id|>", a});
    }
  }
  return out;
}

}  // namespace

ChatTemplate chat_template_from(const std::string& setting, const std::string& model_type) {
  if (setting == "chatml") return ChatTemplate::ChatMl;
  if (setting == "llama3") return ChatTemplate::Llama3;
  KESTREL_CHECK(setting == "auto", kComp, "data.chat_template '", setting,
                "' is unknown; use \"auto\" (from the model type), \"chatml\" or \"llama3\"");
  if (model_type == "qwen2" || model_type == "qwen3") return ChatTemplate::ChatMl;
  if (model_type == "llama") return ChatTemplate::Llama3;
  throw make_error(kComp, "data.chat_template \"auto\" has no template for model_type '", model_type,
                   "'; set data.chat_template to \"chatml\" or \"llama3\"");
}

Conversation parse_conversation(const json& j, const std::string& dir, const std::string& where) {
  KESTREL_CHECK(j.is_object(), kComp, where, ": expected an object {\"conversations\": [...]} or {\"messages\": [...]}");
  const bool llava = j.contains("conversations"), openai = j.contains("messages");
  KESTREL_CHECK(llava != openai, kComp, where, ": expected exactly one of \"conversations\" (LLaVA: from/value) or "
                "\"messages\" (OpenAI: role/content)");
  const json& turns = llava ? j["conversations"] : j["messages"];
  const char* role_key = llava ? "from" : "role";
  const char* text_key = llava ? "value" : "content";
  KESTREL_CHECK(turns.is_array() && !turns.empty(), kComp, where, ": \"", llava ? "conversations" : "messages",
                "\" must be a non-empty array of turns");
  Conversation c;
  if (j.contains("image")) {
    KESTREL_CHECK(j["image"].is_string(), kComp, where, ": \"image\" must be a string (a path relative to the file)");
    c.image = models::confined_path(dir, j["image"].get<std::string>(), where, kComp);
    std::error_code ec;  // status() never opens, so a FIFO cannot block here
    KESTREL_CHECK(std::filesystem::is_regular_file(c.image, ec), kComp, where, ": image '", c.image,
                  "' is not a regular file (missing, a folder, a FIFO or a device)");
  }
  size_t placeholders = 0, assistant = 0;
  for (size_t i = 0; i < turns.size(); ++i) {
    const json& t = turns[i];
    KESTREL_CHECK(t.is_object() && t.contains(role_key) && t[role_key].is_string() && t.contains(text_key) &&
                      t[text_key].is_string(),
                  kComp, where, ": turn ", i, " must be {\"", role_key, "\": \"...\", \"", text_key, "\": \"...\"}");
    const std::string r = t[role_key];
    ChatTurn turn;
    if (r == "human" || r == "user") turn.role = "user";
    else if (r == "gpt" || r == "assistant") turn.role = "assistant";
    else if (r == "system") turn.role = "system";
    else throw make_error(kComp, where, ": turn ", i, " has role '", r,
                          "'; use human/user, gpt/assistant or system");
    turn.content = t[text_key];
    const size_t n = count_of(turn.content, kImage);
    KESTREL_CHECK(n == 0 || turn.role == "user", kComp, where, ": turn ", i, " (", turn.role,
                  ") holds <image>; the placeholder belongs in a user turn");
    placeholders += n;
    assistant += turn.role == "assistant";
    c.turns.push_back(std::move(turn));
  }
  KESTREL_CHECK(assistant > 0, kComp, where, ": no assistant turn, so nothing to train on");
  KESTREL_CHECK(placeholders <= (c.image.empty() ? 0u : 1u), kComp, where, ": ", placeholders,
                " <image> placeholders for ", c.image.empty() ? "no image" : "one image");
  return c;
}

std::vector<Conversation> read_conversations(const std::string& jsonl_path) {
  models::require_regular_file(jsonl_path, kComp);  // a FIFO would block the open below
  std::ifstream f(jsonl_path);
  KESTREL_CHECK(f.good(), kComp, "cannot open '", jsonl_path, "'");
  const std::string dir = std::filesystem::path(jsonl_path).parent_path().string();
  std::vector<Conversation> out;
  std::string line;
  for (int64_t n = 1; std::getline(f, line); ++n) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = jsonl_path + ":" + std::to_string(n);
    json j;
    try {
      j = json::parse(line);
    } catch (const std::exception& e) {
      throw make_error(kComp, where, ": not valid JSON (", e.what(), ")");
    }
    out.push_back(parse_conversation(j, dir, where));
  }
  KESTREL_CHECK(!out.empty(), kComp, "'", jsonl_path, "' holds no conversations");
  return out;
}

std::string render_chat(const Conversation& c, ChatTemplate t) {
  std::string s;
  for (const Piece& p : pieces(c, t)) s += p.text;
  return s;
}

ChatEncoder::ChatEncoder(std::shared_ptr<const TextTokenizer> tokenizer, ChatTemplate t,
                         const std::string& tokenizer_name)
    : tok_(std::move(tokenizer)), template_(t) {
  auto need = [&](const char* token) {
    const int64_t id = tok_->token_id(token);
    KESTREL_CHECK(id >= 0, kComp, "data.tokenizer '", tokenizer_name, "' has no special token ", token, "; the ",
                  t == ChatTemplate::ChatMl ? "chatml" : "llama3",
                  " chat template (data.chat_template) needs it: use the tokenizer.json of the model's family");
    return id;
  };
  if (t == ChatTemplate::ChatMl) {
    turn_start_ = need("<|im_start|>");
    turn_end_ = need("<|im_end|>");
  } else {
    begin_ = need("<|begin_of_text|>");
    turn_start_ = need("<|start_header_id|>");
    header_end_ = need("<|end_header_id|>");
    turn_end_ = need("<|eot_id|>");
  }
  const int64_t eot = tok_->token_id("<|endoftext|>");
  pad_id_ = eot >= 0 ? eot : turn_end_;  // padding is never a label; any valid id will do
}

ChatTokens ChatEncoder::encode(const Conversation& c) const {
  ChatTokens out;
  for (const Piece& p : pieces(c, template_)) {
    std::vector<int64_t> ids;
    if (p.special) {
      ids.push_back(p.text == "<|im_start|>" || p.text == "<|start_header_id|>" ? turn_start_
                    : p.text == "<|begin_of_text|>"                          ? begin_
                    : p.text == "<|end_header_id|>"                          ? header_end_
                                                                             : turn_end_);
    } else if (!p.text.empty()) {
      ids = tok_->encode(p.text);
    }
    out.ids.insert(out.ids.end(), ids.begin(), ids.end());
    out.trained.insert(out.trained.end(), ids.size(), p.trained ? 1 : 0);
  }
  return out;
}

std::vector<std::vector<int64_t>> pack_documents(const std::vector<int64_t>& lengths, int64_t seq_len) {
  KESTREL_CHECK(seq_len > 0, kComp, "seq_len must be positive, got ", seq_len);
  std::vector<std::vector<int64_t>> rows;
  int64_t used = seq_len;  // forces a first row
  for (size_t d = 0; d < lengths.size(); ++d) {
    const int64_t len = std::min(lengths[d], seq_len);
    if (used + len > seq_len) {
      rows.emplace_back();
      used = 0;
    }
    rows.back().push_back(static_cast<int64_t>(d));
    used += len;
  }
  return rows;
}

ChatData::ChatData(const std::string& jsonl_path, std::shared_ptr<const TextTokenizer> tokenizer,
                   const std::string& tokenizer_name, ChatTemplate t, int64_t seq_len, int64_t vocab_size)
    : seq_len_(seq_len) {
  KESTREL_CHECK(seq_len > 1, kComp, "data.seq_len must be at least 2, got ", seq_len);
  ChatEncoder enc(std::move(tokenizer), t, tokenizer_name);
  pad_id_ = enc.pad_id();
  std::vector<int64_t> lengths;
  for (const Conversation& c : read_conversations(jsonl_path)) {
    KESTREL_CHECK(c.image.empty(), kComp, "'", jsonl_path, "' has a conversation with an image ('", c.image,
                  "'); model.type \"decoder\" has no vision tower");
    ChatTokens d = enc.encode(c);
    for (int64_t id : d.ids)
      KESTREL_CHECK(id >= 0 && id < vocab_size, kComp, "data.tokenizer '", tokenizer_name, "' gives id ", id,
                    " but the model's vocab_size is ", vocab_size);
    if (static_cast<int64_t>(d.ids.size()) > seq_len) {
      d.ids.resize(static_cast<size_t>(seq_len));
      d.trained.resize(static_cast<size_t>(seq_len));
      ++truncated_;
    }
    lengths.push_back(static_cast<int64_t>(d.ids.size()));
    docs_.push_back(std::move(d));
  }
  rows_ = pack_documents(lengths, seq_len);
}

HostBatch ChatData::host_batch(uint64_t index, int64_t count) const {
  KESTREL_CHECK(count > 0, kComp, "batch_size must be positive, got ", count);
  std::vector<int64_t> ids, labels, lengths;
  ids.reserve(static_cast<size_t>(count * seq_len_));
  labels.reserve(static_cast<size_t>(count * seq_len_));
  for (int64_t r = 0; r < count; ++r) {
    const uint64_t row = (index * static_cast<uint64_t>(count) + static_cast<uint64_t>(r)) % rows_.size();
    int64_t used = 0;
    for (int64_t d : rows_[row]) {
      const ChatTokens& doc = docs_[static_cast<size_t>(d)];
      const size_t n = doc.ids.size();
      for (size_t i = 0; i < n; ++i) {
        ids.push_back(doc.ids[i]);
        labels.push_back(i + 1 < n && doc.trained[i + 1] ? doc.ids[i + 1] : -100);
      }
      lengths.push_back(static_cast<int64_t>(n));
      used += static_cast<int64_t>(n);
    }
    if (used < seq_len_) {  // the row's tail: one padding document, no labels
      ids.insert(ids.end(), static_cast<size_t>(seq_len_ - used), pad_id_);
      labels.insert(labels.end(), static_cast<size_t>(seq_len_ - used), -100);
      lengths.push_back(seq_len_ - used);
    }
  }
  HostBatch b;
  b.index = index;
  b.tokens = count * seq_len_;
  b.arrays.push_back(host_array(ids, {b.tokens}, DType::I64));
  b.arrays.push_back(host_array(labels, {b.tokens}, DType::I64));
  add_packed_layout(b, lengths);
  return b;
}

}  // namespace kestrel::train
