// Numbers parsed strictly (issue 18 item 5): each test is the input that used to be taken wrongly.
#include <gtest/gtest.h>

#include "kestrel/runtime/error.h"
#include "kestrel/runtime/memory_budget.h"
#include "kestrel/runtime/parse_number.h"
#include "kestrel/train/bpe_tokenizer.h"
#include "kestrel/train/train_config.h"
#include "kestrel/train/trainer.h"
#include "trainer_fixtures.h"
#include "support/errors.h"

namespace kestrel {
namespace {
using nlohmann::json;

using kestrel::testing::error_of;

// kestrel-grad --seq-len 1e12 ran with 1 (std::stoll stops at 'e'); kestrel-mem --steps abc aborted
// with an uncaught std::invalid_argument.
TEST(ParseNumber, IntegersAreWholeDecimalNumbersInRange) {
  EXPECT_EQ(parse_integer("42", "--steps", 1, 100), 42);
  EXPECT_EQ(parse_integer("-1", "x", -1, 5), -1);
  for (const char* bad : {"1e12", "abc", "", "2.5", " 3", "3 ", "+3", "0x10", "99999999999999999999"})
    EXPECT_THROW(parse_integer(bad, "--seq-len", 1), Error) << bad;
  std::string m = error_of([] { parse_integer("1e12", "--seq-len", 1, 2147483647); });
  EXPECT_NE(m.find("--seq-len"), std::string::npos) << m;
  EXPECT_NE(m.find("'1e12'"), std::string::npos) << m;
  EXPECT_NE(m.find("[1, 2147483647]"), std::string::npos) << m;
  EXPECT_THROW(parse_integer("0", "--steps", 1), Error);
  EXPECT_NE(error_of([] { parse_integer("99999999999999999999", "n"); }).find("out of range"), std::string::npos);
}

TEST(ParseNumber, SizesAreStrict) {
  EXPECT_EQ(parse_size("40GiB", "--memory-budget"), int64_t{40} << 30);
  EXPECT_EQ(parse_size("1.5 KiB", "--memory-budget"), 1536);
  for (const char* bad : {"abc", "1.2.3GiB", "-1GiB", "5 parsecs", "1e30TiB", ""})
    EXPECT_THROW(parse_size(bad, "--memory-budget"), Error) << bad;
  EXPECT_NE(error_of([] { parse_size("abc", "--memory-budget"); }).find("--memory-budget"), std::string::npos);
}

// Fractional and negative values for integer config keys were accepted (truncated or wrapped).
TEST(ParseNumber, IntegerConfigKeysTakeIntegers) {
  std::string m = error_of([] { train::resolve_train_config(json{{"train", {{"batch_size", 2.5}}}}, "run.json"); });
  EXPECT_NE(m.find("train.batch_size"), std::string::npos) << m;
  EXPECT_NE(m.find("2.5"), std::string::npos) << m;
  EXPECT_THROW(train::resolve_train_config(json{{"train", {{"steps", -3}}}}, "run.json"), Error);
  EXPECT_THROW(train::resolve_train_config(json{{"threads", 1e10}}, "run.json"), Error);
  EXPECT_THROW(train::resolve_train_config(json{{"data", {{"doc_start_token", -2}}}}, "run.json"), Error);
  // A float with no fractional part is that integer; -1 is the "none" of doc_start_token.
  json c = train::resolve_train_config(json{{"train", {{"steps", 1e3}}}, {"data", {{"doc_start_token", -1}}}}, "x");
  EXPECT_TRUE(c["train"]["steps"].is_number_integer());
  EXPECT_EQ(c["train"]["steps"].get<int64_t>(), 1000);
  json d = train::default_train_config();
  EXPECT_THROW(train::apply_override(d, "train.grad_accum=1.5"), Error);
  EXPECT_THROW(train::apply_override(d, "keep_checkpoints=-1"), Error);
  train::apply_override(d, "train.seed=12345678901");
  EXPECT_EQ(d["train"]["seed"].get<int64_t>(), 12345678901);
}

// --memory-budget abc was accepted on the CPU (the budget only applies to CUDA devices).
TEST(ParseNumber, MemoryBudgetIsCheckedOnTheCpuToo) {
  json c = train::testing::tiny_vlm_run(train::testing::fresh_temp_dir("kestrel_numbers", "budget"), {{"steps", 1}});
  c["memory_budget"] = "abc";
  std::string m = error_of([&] { train::Trainer t(c); });
  EXPECT_NE(m.find("memory_budget"), std::string::npos) << m;
}

// A wrongly typed field of a tokenizer.json reached the user as a raw JSON-library type_error that
// named neither the file nor the field.
TEST(ParseNumber, TokenizerJsonTypeErrorsNameTheFile) {
  json tok = {{"model", {{"type", "BPE"}, {"vocab", {{"a", 0}}}, {"merges", json::array()}}},
              {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}}},
              {"added_tokens", {{{"id", "seven"}, {"content", "<eot>"}}}}};
  std::string m = error_of([&] { train::BpeTokenizer::from_json(tok, "tok.json"); });
  EXPECT_NE(m.find("tok.json"), std::string::npos) << m;
  EXPECT_NE(m.find("added_tokens"), std::string::npos) << m;
}

}  // namespace
}  // namespace kestrel
