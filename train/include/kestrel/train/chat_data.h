// Conversation data for supervised fine-tuning (issue 24): LLaVA-style JSONL, one conversation a line,
//   {"image": "rel/path.png" (optional), "conversations": [{"from": "human"|"user"|"system", "value": ...},
//                                                         {"from": "gpt"|"assistant", "value": ...}, ...]}
// or the OpenAI form {"messages": [{"role": ..., "content": ...}]}, rendered with the text model's chat
// template and packed into rows of seq_len tokens, one document per conversation.
//
// Policy:
//   - Templates, as transformers' apply_chat_template renders them (no generation prompt, no default
//     system message: Qwen2.5's template adds one, give it in the data if wanted; nor Qwen3's empty
//     "<think>\n\n</think>\n\n" before the last answer, which the data may hold in the content):
//       chatml (qwen2, qwen3): "<|im_start|>" role "\n" content "<|im_end|>\n" per turn;
//       llama3 (llama):        "<|begin_of_text|>", then "<|start_header_id|>" role "<|end_header_id|>\n\n"
//                              strip(content) "<|eot_id|>" per turn.
//     The special tokens are inserted by id (the tokenizer must know them, else refused); the text
//     pieces (role headers, contents, separators) are encoded one by one, so the ids equal the
//     tokenization of the whole rendered text wherever the pre-tokenizer splits at those seams
//     (always for the GPT-2/Qwen2/Llama-3 splits, except a content starting with a newline after a
//     header that ends in one).
//   - Loss only on assistant contents and their end-of-turn token; role headers, other turns, the
//     separators and padding carry label -100. Labels are next-token: label[i] = id[i+1] when token
//     i+1 is trained, and never across a document's end.
//   - Packing: conversations in file order fill rows greedily (the next one starts a new row when it
//     does not fit); a conversation longer than seq_len is cut to seq_len (counted, logged by the
//     caller); the tail of a row is one padding document. Positions restart per document, attention
//     stays inside it (cu_seqlens), exactly like the token-file path. Row r of the data is a pure
//     function of r, so resume is exact.
//   - Trust: lines are checked at load (errors name file:line); an image path must stay inside the
//     JSONL's folder (models::confined_path: no absolute paths, no '..', no symlink out) and be a
//     regular file. The `<image>` placeholder may appear once, in a user turn, and only with an image.
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "kestrel/train/host_batch.h"
#include "kestrel/train/tokenizer.h"

namespace kestrel::train {

enum class ChatTemplate : uint8_t { ChatMl, Llama3 };

// data.chat_template ("auto" | "chatml" | "llama3"); "auto" picks by the text model_type (qwen2/qwen3:
// chatml, llama: llama3). Anything else is refused naming the key.
ChatTemplate chat_template_from(const std::string& setting, const std::string& model_type);

struct ChatTurn {
  std::string role;  // "system", "user" or "assistant" (human/gpt mapped)
  std::string content;
};

struct Conversation {
  std::string image;  // confined path of the image, "" when none
  std::vector<ChatTurn> turns;
};

// One parsed line; `where` ("file:line") starts every error. Image paths are resolved against `dir`.
Conversation parse_conversation(const nlohmann::json& line, const std::string& dir, const std::string& where);
// Every line of a conversation JSONL (blank lines skipped).
std::vector<Conversation> read_conversations(const std::string& jsonl_path);

// The rendered text (what apply_chat_template(messages, tokenize=False) returns).
std::string render_chat(const Conversation& c, ChatTemplate t);

struct ChatTokens {
  std::vector<int64_t> ids;
  std::vector<uint8_t> trained;  // 1 for assistant content and its end-of-turn token
};

class ChatEncoder {
 public:
  // Refuses a tokenizer that lacks the template's special tokens, naming them.
  ChatEncoder(std::shared_ptr<const TextTokenizer> tokenizer, ChatTemplate t, const std::string& tokenizer_name);
  ChatTokens encode(const Conversation& c) const;
  int64_t pad_id() const { return pad_id_; }

 private:
  std::shared_ptr<const TextTokenizer> tok_;
  ChatTemplate template_;
  int64_t begin_ = -1, turn_start_ = -1, header_end_ = -1, turn_end_ = -1, pad_id_ = -1;
};

// Greedy packing of documents of `lengths` (each cut to seq_len) into rows of seq_len: the indices of
// each row's documents, in order.
std::vector<std::vector<int64_t>> pack_documents(const std::vector<int64_t>& lengths, int64_t seq_len);

class ChatData {
 public:
  // Reads, renders and tokenizes every conversation once; ids must be < vocab_size.
  ChatData(const std::string& jsonl_path, std::shared_ptr<const TextTokenizer> tokenizer,
           const std::string& tokenizer_name, ChatTemplate t, int64_t seq_len, int64_t vocab_size);
  int64_t conversations() const { return static_cast<int64_t>(docs_.size()); }
  int64_t rows() const { return static_cast<int64_t>(rows_.size()); }
  int64_t truncated() const { return truncated_; }
  // Micro-batch `index`: rows (index * count + r) mod rows(), r < count. Arrays as TokenStream's:
  // input_ids, labels [count * seq_len] i64, positions, cu_seqlens. Thread-safe.
  HostBatch host_batch(uint64_t index, int64_t count) const;

 private:
  std::vector<ChatTokens> docs_;  // each cut to seq_len
  std::vector<std::vector<int64_t>> rows_;
  int64_t seq_len_, pad_id_, truncated_ = 0;
};

}  // namespace kestrel::train
