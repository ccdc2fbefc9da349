// The tokenize path: text documents -> an llm.c token file for the decoder task
// (`kestrel-train tokenize`). Inputs: `.jsonl` files hold one document per line ({"text": "..."});
// any other file holds one document per non-empty line. Each document is written after a separator
// token (llm.c's convention: <|endoftext|> before every document), so data.doc_start_token = the
// separator id packs one document per attention span. The file is uint16 when every id of the
// vocabulary fits, else uint32.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kestrel/train/token_file.h"
#include "kestrel/train/tokenizer.h"

namespace kestrel::train {

struct TokenizeResult {
  int64_t documents = 0;
  int64_t tokens = 0;           // written, separators included
  int64_t separator_id = -1;
  TokenFormat format = TokenFormat::U16;
};

// `separator`: the separator token's text; "" picks "<|endoftext|>", else "<eos>", whichever the
// vocabulary has (an error when it has neither).
TokenizeResult tokenize_to_token_file(const TextTokenizer& tokenizer, const std::vector<std::string>& inputs,
                                      const std::string& output, const std::string& separator = "");

}  // namespace kestrel::train
