// Conversation data for supervised fine-tuning (issue 24): LLaVA-style JSONL, one conversation a line,
//   {"image": "rel/path.png" | ["a.png", "b.png"] (optional),
//    "conversations": [{"from": "human"|"user"|"system", "value": ...}, {"from": "gpt"|"assistant", "value": ...}, ...]}
// or the OpenAI form {"messages": [{"role": ..., "content": "text" | [parts]}]}, parts being
// {"type": "text", "text": ...}, {"type": "image", "image": "rel/path.png"} or
// {"type": "image_url", "image_url": {"url": "rel/path.png"}}; rendered with the text model's chat
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
//   - Images (model.type "vlm" only; the decoder refuses a conversation that has one): the `<image>`
//     placeholder in a user turn's text marks where an image goes, the k-th placeholder taking the
//     k-th image. In the parts form each image part is a placeholder at its place among the text
//     parts (parts are joined with nothing between them, as Qwen2-VL's template does). A conversation
//     with images and no placeholder gets LLaVA's rule: "<image>\n" per image in front of the first
//     user turn's text. Any other count of placeholders than images is refused. Each placeholder
//     becomes tokens_per_image(config) slots of image_token_id (the text around it is encoded piece
//     by piece, so the tokenizer need not know "<image>"); those slots never carry a label, and no
//     text token may take image_token_id (refused: it would read as an image slot to HF's LLaVA).
//     Several images per conversation are fine: the VLM splices image embeddings into the slots in
//     order, and a batch's images go through the tower in the order of their slots.
//   - Packing: conversations in file order fill rows greedily (the next one starts a new row when it
//     does not fit); a conversation longer than seq_len is cut to seq_len (counted, logged by the
//     caller), and when the cut would split an image's slots it moves back to that image's first slot
//     (the image and any later ones are dropped with their slots, never half of one kept); the tail
//     of a row is one padding document. Positions restart per document, attention stays inside it
//     (cu_seqlens), exactly like the token-file path. Row r of the data is a pure function of r, so
//     resume is exact.
//   - Trust: lines are checked at load (errors name file:line); an image path must stay inside the
//     JSONL's folder (models::confined_path: no absolute paths, no '..', no symlink out) and be a
//     regular file; remote or inline URLs (http:, data:, any scheme://) are refused. Images are
//     decoded when a batch is built (on the prefetch threads), resized to the tower's image_size and
//     normalised as the image-text path does (vlm_data.h); a file that does not decode is an error
//     naming the JSONL's file:line and the image.
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
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
  std::vector<std::string> images;  // confined paths, in the order of their <image> placeholders
  std::vector<ChatTurn> turns;      // every image's "<image>" placeholder is in a user turn's content
  std::string where;                // "file:line" of the line (errors at batch time name it)
};

// One parsed line; `where` ("file:line") starts every error. Image paths are resolved against `dir`.
Conversation parse_conversation(const nlohmann::json& line, const std::string& dir, const std::string& where);
// Every line of a conversation JSONL (blank lines skipped).
std::vector<Conversation> read_conversations(const std::string& jsonl_path);

// The rendered text (what apply_chat_template(messages, tokenize=False) returns).
std::string render_chat(const Conversation& c, ChatTemplate t);

struct ChatTokens {
  std::vector<int64_t> ids;
  std::vector<uint8_t> trained;       // 1 for assistant content and its end-of-turn token
  std::vector<int64_t> image_starts;  // first slot of each image's block of tokens_per_image slots, in order
};

// How an image appears in the token sequence: `tokens_per_image` slots holding `token_id`.
struct ChatImageTokens {
  int64_t token_id = -1;
  int64_t tokens_per_image = 0;
};

class ChatEncoder {
 public:
  // Refuses a tokenizer that lacks the template's special tokens, naming them. Without `image` a
  // conversation holding an image is refused.
  ChatEncoder(std::shared_ptr<const TextTokenizer> tokenizer, ChatTemplate t, const std::string& tokenizer_name,
              std::optional<ChatImageTokens> image = std::nullopt);
  ChatTokens encode(const Conversation& c) const;
  int64_t pad_id() const { return pad_id_; }

 private:
  std::shared_ptr<const TextTokenizer> tok_;
  ChatTemplate template_;
  std::optional<ChatImageTokens> image_;
  int64_t begin_ = -1, turn_start_ = -1, header_end_ = -1, turn_end_ = -1, pad_id_ = -1;
};

// Greedy packing of documents of `lengths` (each cut to seq_len) into rows of seq_len: the indices of
// each row's documents, in order.
std::vector<std::vector<int64_t>> pack_documents(const std::vector<int64_t>& lengths, int64_t seq_len);

// The VLM's side of chat data: image slots and the tower's input.
struct ChatVision {
  ChatImageTokens tokens;  // image_token_id, tokens_per_image(config) (vlm_data.h)
  int64_t image_size = 0;  // the tower's S: images are resized to S x S
  DType pixel_dtype = DType::F32;
};

class ChatData {
 public:
  // Reads, renders and tokenizes every conversation once; ids must be < vocab_size. Without
  // `vision` (a decoder) a conversation holding an image is refused.
  ChatData(const std::string& jsonl_path, std::shared_ptr<const TextTokenizer> tokenizer,
           const std::string& tokenizer_name, ChatTemplate t, int64_t seq_len, int64_t vocab_size,
           std::optional<ChatVision> vision = std::nullopt);
  int64_t conversations() const { return static_cast<int64_t>(docs_.size()); }
  int64_t rows() const { return static_cast<int64_t>(rows_.size()); }
  int64_t truncated() const { return truncated_; }
  int64_t images() const { return images_; }  // kept after truncation
  // Micro-batch `index`: rows (index * count + r) mod rows(), r < count. Arrays as TokenStream's:
  // input_ids, labels [count * seq_len] i64, positions, cu_seqlens. With `vision`, as the VLM's
  // (vlm_batch_from): input_ids, labels, pixel_values [n, 3, S, S] (the rows' n images in slot
  // order, n may be 0), image_positions [n * tokens_per_image] i64, positions, cu_seqlens, and
  // images_per_document (padding documents: 0). Thread-safe; decodes the images.
  HostBatch host_batch(uint64_t index, int64_t count) const;

 private:
  struct Doc {
    ChatTokens tokens;                // cut to seq_len
    std::vector<std::string> images;  // those whose slots survived the cut
    std::string where;
  };
  std::vector<Doc> docs_;
  std::vector<std::vector<int64_t>> rows_;
  std::optional<ChatVision> vision_;
  int64_t seq_len_, pad_id_, truncated_ = 0, images_ = 0;
};

}  // namespace kestrel::train
