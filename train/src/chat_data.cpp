// Conversation JSONL -> chat-templated, assistant-masked, packed token rows, with the VLM's image
// slots and decoded images (policy in chat_data.h).
#include "kestrel/train/chat_data.h"

#include <algorithm>
#include <filesystem>
#include <fstream>

#include "kestrel/models/file_io.h"
#include "kestrel/runtime/error.h"
#include "kestrel/train/vlm_data.h"

namespace kestrel::train {
namespace {
using nlohmann::json;
constexpr const char* kComp = "chat_data";
constexpr const char* kImage = "<image>";
// Images one conversation may name (each is image_token_id slots: 729 for SigLIP at 384 px): a bound on
// what one line can make the loader stat, decode and encode.
constexpr size_t kMaxImagesPerConversation = 256;

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

namespace {

std::string image_file(const std::string& dir, const std::string& name, const std::string& where) {
  return data_image_path(dir, name, where, kComp);
}

// A turn's text: a string, or (OpenAI form) an array of parts whose image parts become "<image>"
// placeholders in place (their files appended to `images`).
std::string turn_text(const json& content, bool parts_allowed, const std::string& dir, const std::string& where,
                      size_t turn, std::vector<std::string>& images) {
  if (content.is_string()) return content.get<std::string>();
  KESTREL_CHECK(parts_allowed && content.is_array(), kComp, where, ": turn ", turn, "'s ",
                parts_allowed ? "\"content\" must be a string or an array of parts" : "\"value\" must be a string");
  std::string text;
  for (size_t k = 0; k < content.size(); ++k) {
    const json& part = content[k];
    KESTREL_CHECK(part.is_object() && part.contains("type") && part["type"].is_string(), kComp, where, ": turn ", turn,
                  " part ", k, " must be an object with a string \"type\"");
    const std::string type = part["type"];
    auto string_at = [&](const json& obj, const char* key, const char* shape) {
      KESTREL_CHECK(obj.is_object() && obj.contains(key) && obj[key].is_string(), kComp, where, ": turn ", turn,
                    " part ", k, " (", type, ") must be ", shape);
      return obj[key].get<std::string>();
    };
    KESTREL_CHECK(type == "text" || images.size() < kMaxImagesPerConversation, kComp, where, ": more than ",
                  kMaxImagesPerConversation, " images in one conversation; split it");
    if (type == "text") {
      text += string_at(part, "text", "{\"type\": \"text\", \"text\": \"...\"}");
    } else if (type == "image") {
      images.push_back(image_file(dir, string_at(part, "image", "{\"type\": \"image\", \"image\": \"path\"}"), where));
      text += kImage;
    } else if (type == "image_url") {
      const char* shape = "{\"type\": \"image_url\", \"image_url\": {\"url\": \"path\"}}";
      KESTREL_CHECK(part.contains("image_url"), kComp, where, ": turn ", turn, " part ", k, " (", type, ") must be ",
                    shape);
      images.push_back(image_file(dir, string_at(part["image_url"], "url", shape), where));
      text += kImage;
    } else {
      throw make_error(kComp, where, ": turn ", turn, " part ", k, " has type '", type,
                       "'; supported: \"text\", \"image\", \"image_url\" (a file path)");
    }
  }
  return text;
}

}  // namespace

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
  c.where = where;
  KESTREL_CHECK(!(j.contains("image") && j.contains("images")), kComp, where,
                ": give the images in \"image\" or in \"images\", not both");
  for (const char* key : {"image", "images"}) {
    if (!j.contains(key)) continue;
    const json& v = j[key];
    KESTREL_CHECK(v.is_string() || (v.is_array() && !v.empty()), kComp, where, ": \"", key,
                  "\" must be a string or a non-empty array of strings (paths relative to the file)");
    KESTREL_CHECK(!v.is_array() || v.size() <= kMaxImagesPerConversation, kComp, where, ": ", v.size(),
                  " images in one conversation, more than ", kMaxImagesPerConversation, "; split it");
    for (const json& name : v.is_string() ? json::array({v}) : v) {
      KESTREL_CHECK(name.is_string(), kComp, where, ": \"", key, "\" must hold strings (paths relative to the file)");
      c.images.push_back(image_file(dir, name.get<std::string>(), where));
    }
  }
  const size_t top_images = c.images.size();
  std::vector<std::string> part_images;
  size_t placeholders = 0, assistant = 0;
  for (size_t i = 0; i < turns.size(); ++i) {
    const json& t = turns[i];
    KESTREL_CHECK(t.is_object() && t.contains(role_key) && t[role_key].is_string() && t.contains(text_key), kComp,
                  where, ": turn ", i, " must be {\"", role_key, "\": \"...\", \"", text_key, "\": ",
                  llava ? "\"...\"}" : "\"...\" or [parts]}");
    const std::string r = t[role_key];
    ChatTurn turn;
    if (r == "human" || r == "user") turn.role = "user";
    else if (r == "gpt" || r == "assistant") turn.role = "assistant";
    else if (r == "system") turn.role = "system";
    else throw make_error(kComp, where, ": turn ", i, " has role '", r,
                          "'; use human/user, gpt/assistant or system");
    turn.content = turn_text(t[text_key], openai, dir, where, i, part_images);
    const size_t n = count_of(turn.content, kImage);
    KESTREL_CHECK(n == 0 || turn.role == "user", kComp, where, ": turn ", i, " (", turn.role,
                  ") holds <image> or an image part; images belong in a user turn");
    placeholders += n;
    assistant += turn.role == "assistant";
    c.turns.push_back(std::move(turn));
  }
  KESTREL_CHECK(assistant > 0, kComp, where, ": no assistant turn, so nothing to train on");
  KESTREL_CHECK(top_images == 0 || part_images.empty(), kComp, where, ": images both in \"image\" and as image parts "
                "of the messages; give them one way (their order would be ambiguous)");
  c.images.insert(c.images.end(), part_images.begin(), part_images.end());
  if (top_images > 0 && placeholders == 0) {
    // LLaVA's rule for a sample without a placeholder: the image(s) first in the first user turn.
    auto first_user = std::find_if(c.turns.begin(), c.turns.end(), [](const ChatTurn& t) { return t.role == "user"; });
    KESTREL_CHECK(first_user != c.turns.end(), kComp, where, ": has an image but no user turn to put it in");
    std::string front;
    for (size_t k = 0; k < top_images; ++k) front += std::string(kImage) + "\n";
    first_user->content = front + first_user->content;
    placeholders = top_images;
  }
  KESTREL_CHECK(placeholders == c.images.size(), kComp, where, ": ", placeholders, " <image> placeholder(s) for ",
                c.images.size(), " image(s); each image needs one placeholder in a user turn (or, with images in "
                "\"image\", none at all: they then go first in the first user turn)");
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
                         const std::string& tokenizer_name, std::optional<ChatImageTokens> image)
    : tok_(std::move(tokenizer)), template_(t), image_(image) {
  KESTREL_CHECK(!image_ || (image_->token_id >= 0 && image_->tokens_per_image > 0), kComp, "image token id ",
                image_ ? image_->token_id : 0, " and tokens per image ", image_ ? image_->tokens_per_image : 0,
                " must be >= 0 and > 0");
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
  auto append = [&](const std::vector<int64_t>& ids, bool trained) {
    out.ids.insert(out.ids.end(), ids.begin(), ids.end());
    out.trained.insert(out.trained.end(), ids.size(), trained ? 1 : 0);
  };
  for (const Piece& p : pieces(c, template_)) {
    if (p.special) {
      append({p.text == "<|im_start|>" || p.text == "<|start_header_id|>" ? turn_start_
              : p.text == "<|begin_of_text|>"                          ? begin_
              : p.text == "<|end_header_id|>"                          ? header_end_
                                                                       : turn_end_},
             p.trained);
      continue;
    }
    // Text, split at the placeholders: each "<image>" becomes one image's block of slots.
    size_t from = 0;
    for (size_t at = p.text.find(kImage);; at = p.text.find(kImage, from)) {
      const std::string text = p.text.substr(from, at == std::string::npos ? std::string::npos : at - from);
      if (!text.empty()) append(tok_->encode(text), p.trained);
      if (at == std::string::npos) break;
      KESTREL_CHECK(image_.has_value(), kComp, c.where, ": the conversation holds an image; only model.type "
                    "\"vlm\" has image slots");
      KESTREL_CHECK(!p.trained, kComp, c.where, ": an image in an assistant turn; images belong in a user turn");
      out.image_starts.push_back(static_cast<int64_t>(out.ids.size()));
      append(std::vector<int64_t>(static_cast<size_t>(image_->tokens_per_image), image_->token_id), false);
      from = at + std::string(kImage).size();
    }
  }
  KESTREL_CHECK(out.image_starts.size() == c.images.size(), kComp, c.where, ": ", out.image_starts.size(),
                " <image> placeholder(s) for ", c.images.size(), " image(s)");
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
                   const std::string& tokenizer_name, ChatTemplate t, int64_t seq_len, int64_t vocab_size,
                   std::optional<ChatVision> vision)
    : vision_(vision), seq_len_(seq_len) {
  KESTREL_CHECK(seq_len > 1, kComp, "data.seq_len must be at least 2, got ", seq_len);
  std::optional<ChatImageTokens> slots;
  if (vision_) {
    slots = vision_->tokens;
    KESTREL_CHECK(vision_->image_size > 0, kComp, "the tower's image size must be positive, got ", vision_->image_size);
    KESTREL_CHECK(slots->tokens_per_image < seq_len, kComp, "data.seq_len (", seq_len, ") must exceed one image's ",
                  slots->tokens_per_image, " image-token slots");
  }
  const int64_t tpi = slots ? slots->tokens_per_image : 0;
  ChatEncoder enc(std::move(tokenizer), t, tokenizer_name, slots);
  pad_id_ = enc.pad_id();
  KESTREL_CHECK(!vision_ || pad_id_ != slots->token_id, kComp, "the padding id ", pad_id_, " of data.tokenizer '",
                tokenizer_name, "' is the model's image_token_id: padded rows would read as image slots (here and "
                "in an exported LLaVA); pick another image_token_id");
  std::vector<int64_t> lengths;
  for (Conversation& c : read_conversations(jsonl_path)) {
    KESTREL_CHECK(vision_ || c.images.empty(), kComp, c.where, ": the conversation has an image ('", c.images.front(),
                  "'); model.type \"decoder\" has no vision tower");
    Doc d{enc.encode(c), std::move(c.images), c.where};
    ChatTokens& k = d.tokens;
    std::vector<uint8_t> slot(k.ids.size(), 0);
    for (int64_t s : k.image_starts) std::fill_n(slot.begin() + s, tpi, 1);
    for (size_t i = 0; i < k.ids.size(); ++i) {
      KESTREL_CHECK(k.ids[i] >= 0 && k.ids[i] < vocab_size, kComp, c.where, ": data.tokenizer '", tokenizer_name, "' gives id ",
                    k.ids[i], " but the model's vocab_size is ", vocab_size);
      KESTREL_CHECK(!vision_ || slot[i] || k.ids[i] != slots->token_id, kComp, c.where, ": data.tokenizer '",
                    tokenizer_name, "' gives the text id ", k.ids[i], ", the model's image_token_id: it would read "
                    "as an image slot; pick an image_token_id the tokenizer never produces for text");
    }
    if (static_cast<int64_t>(k.ids.size()) > seq_len) {
      // Cut to seq_len, moved back to the first slot of an image the cut would split.
      int64_t cut = seq_len;
      for (int64_t s : k.image_starts)
        if (s < cut && s + tpi > cut) cut = s;
      size_t kept = 0;
      while (kept < k.image_starts.size() && k.image_starts[kept] < cut) ++kept;
      k.ids.resize(static_cast<size_t>(cut));
      k.trained.resize(static_cast<size_t>(cut));
      k.image_starts.resize(kept);
      d.images.resize(kept);
      ++truncated_;
    }
    images_ += static_cast<int64_t>(d.images.size());
    lengths.push_back(static_cast<int64_t>(k.ids.size()));
    docs_.push_back(std::move(d));
  }
  rows_ = pack_documents(lengths, seq_len);
}

HostBatch ChatData::host_batch(uint64_t index, int64_t count) const {
  KESTREL_CHECK(count > 0, kComp, "batch_size must be positive, got ", count);
  std::vector<int64_t> ids, labels, lengths, image_positions, images_per_document;
  std::vector<const Doc*> with_images;  // documents whose images the batch holds, in slot order
  const int64_t tpi = vision_ ? vision_->tokens.tokens_per_image : 0;
  ids.reserve(static_cast<size_t>(count * seq_len_));
  labels.reserve(static_cast<size_t>(count * seq_len_));
  for (int64_t r = 0; r < count; ++r) {
    const uint64_t row = (index * static_cast<uint64_t>(count) + static_cast<uint64_t>(r)) % rows_.size();
    int64_t used = 0;
    for (int64_t d : rows_[row]) {
      const Doc& doc = docs_[static_cast<size_t>(d)];
      const ChatTokens& k = doc.tokens;
      const size_t n = k.ids.size();
      for (int64_t s : k.image_starts)  // image slots carry no label (trained is 0 there and before them)
        for (int64_t i = 0; i < tpi; ++i)
          image_positions.push_back(static_cast<int64_t>(ids.size()) + s + i);
      if (!doc.images.empty()) with_images.push_back(&doc);
      for (size_t i = 0; i < n; ++i) {
        ids.push_back(k.ids[i]);
        labels.push_back(i + 1 < n && k.trained[i + 1] ? k.ids[i + 1] : -100);
      }
      lengths.push_back(static_cast<int64_t>(n));
      images_per_document.push_back(static_cast<int64_t>(doc.images.size()));
      used += static_cast<int64_t>(n);
    }
    if (used < seq_len_) {  // the row's tail: one padding document, no labels
      ids.insert(ids.end(), static_cast<size_t>(seq_len_ - used), pad_id_);
      labels.insert(labels.end(), static_cast<size_t>(seq_len_ - used), -100);
      lengths.push_back(seq_len_ - used);
      images_per_document.push_back(0);
    }
  }
  HostBatch b;
  b.index = index;
  b.tokens = count * seq_len_;
  b.arrays.push_back(host_array(ids, {b.tokens}, DType::I64));
  b.arrays.push_back(host_array(labels, {b.tokens}, DType::I64));
  if (vision_) {
    // Decoded here, on the prefetch thread: resized to the tower's S x S and normalised as the
    // image-text records are (vlm_data.h).
    const int64_t S = vision_->image_size;
    std::vector<std::vector<uint8_t>> pixels;
    for (const Doc* doc : with_images)
      for (const std::string& path : doc->images) {
        try {
          pixels.push_back(resize_nearest(read_image(path), S));
        } catch (const std::exception& e) {
          throw make_error(kComp, doc->where, ": image '", path, "' cannot be read: ", e.what());
        }
      }
    std::vector<const uint8_t*> ptrs;
    for (const auto& p : pixels) ptrs.push_back(p.data());
    const int64_t n = static_cast<int64_t>(pixels.size());
    b.arrays.push_back(host_floats(normalize_images(ptrs, S), {n, 3, S, S}, vision_->pixel_dtype));
    b.arrays.push_back(host_array(image_positions, {static_cast<int64_t>(image_positions.size())}, DType::I64));
    b.images_per_document = std::move(images_per_document);  // the VLM checks it against pixels and documents
  }
  add_packed_layout(b, lengths);
  return b;
}

}  // namespace kestrel::train
