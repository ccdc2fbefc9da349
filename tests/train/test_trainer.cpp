// The trainer: exact resume, a falling loss, atomic checkpoints, and config errors.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "kestrel/models/config.h"
#include "kestrel/models/decoder.h"
#include "kestrel/train/train_config.h"
#include "kestrel/train/image_io.h"
#include "kestrel/train/shapes_dataset.h"
#include "kestrel/train/token_data.h"
#include "kestrel/train/vlm_data.h"
#include "kestrel/train/token_file.h"
#include "kestrel/train/trainer.h"
#include "train/src/checkpoint_io.h"
#include "support/errors.h"
#include "trainer_fixtures.h"

namespace kestrel::train {
namespace {
namespace fs = std::filesystem;
using nlohmann::json;

json tiny_run(const std::string& out_dir, int64_t steps) {
  return testing::tiny_vlm_run(out_dir, {{"steps", steps}, {"batch_size", 4}});
}
std::vector<double> losses(const std::string& out_dir) { return testing::metric_losses(out_dir); }
std::string trainer_tmp(const std::string& n) { return testing::fresh_temp_dir("kestrel_trainer", n); }

TEST(Trainer, ResumeIsExact) {
  std::string a = trainer_tmp("straight"), b = trainer_tmp("resumed");
  {
    Trainer t(tiny_run(a, 20));
    t.set_log_callback([](const std::string&) {});
    t.run();
  }
  // Run b checkpoints at 10 and 20; cutting it back to step 10 (checkpoint and metrics) stands for
  // a run of 10 steps, which is then resumed for the last 10.
  {
    json c = tiny_run(b, 20);
    c["checkpoint_every"] = 10;
    Trainer t(c);
    t.set_log_callback([](const std::string&) {});
    t.run();
  }
  std::vector<double> full = losses(a);
  ASSERT_EQ(full.size(), 20u);
  fs::remove_all(fs::path(b) / "checkpoints" / "step_00000020");
  {
    std::vector<double> first = losses(b);
    std::ofstream f(b + "/metrics.jsonl", std::ios::trunc);
    for (int i = 0; i < 10; ++i) f << json{{"loss", first[i]}}.dump() << "\n";
  }
  {
    Trainer t(tiny_run(b, 20));
    t.set_log_callback([](const std::string&) {});
    t.resume("latest");
    t.run();
  }
  std::vector<double> resumed = losses(b);
  ASSERT_EQ(resumed.size(), 20u);
  for (int i = 0; i < 20; ++i) EXPECT_EQ(full[i], resumed[i]) << "step " << i + 1;
  EXPECT_LT(full.back(), 0.8 * full.front());  // and it learns
  fs::remove_all(a);
  fs::remove_all(b);
}

TEST(Trainer, HalfWrittenCheckpointIsIgnored) {
  std::string d = trainer_tmp("atomic");
  fs::create_directories(fs::path(d) / "checkpoints" / ".step_00000005.tmp");
  fs::create_directories(fs::path(d) / "checkpoints" / "step_00000003");  // no trainer_state.json
  EXPECT_EQ(latest_checkpoint(d), "");
  Trainer t(tiny_run(d, 2));
  EXPECT_THROW(t.resume("latest"), Error);
  fs::remove_all(d);
}

TEST(TrainConfig, ErrorsNameTheKey) {
  try {
    resolve_train_config(json{{"train", {{"stepz", 3}}}}, "run.json");
    ADD_FAILURE();
  } catch (const Error& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("train.stepz"), std::string::npos) << m;
    EXPECT_NE(m.find("steps"), std::string::npos) << m;  // lists the valid keys
  }
  EXPECT_THROW(resolve_train_config(json{{"train", {{"steps", "many"}}}}, "run.json"), Error);
  json c = default_train_config();
  apply_override(c, "train.lr=0.5");
  EXPECT_EQ(c["train"]["lr"].get<double>(), 0.5);
  apply_override(c, "model.config.text_config.hidden_size=64");
  EXPECT_EQ(c["model"]["config"]["text_config"]["hidden_size"].get<int>(), 64);
  EXPECT_THROW(apply_override(c, "train.nope=1"), Error);
  EXPECT_THROW(apply_override(c, "justakey"), Error);
  json bad = tiny_run(trainer_tmp("bad"), 1);
  bad["model"]["config"]["text_config"]["num_attention_heads"] = 3;
  EXPECT_THROW(Trainer t(bad), Error);
}

}  // namespace
}  // namespace kestrel::train

namespace kestrel::train {
namespace {

// Documents "<0> a a+1 a+2 ..." (a from the document index): predictable after the first token.
std::string write_token_docs(const std::string& dir, int64_t vocab, int docs, TokenFormat fmt) {
  fs::create_directories(dir);
  std::vector<uint32_t> toks;
  for (int d = 0; d < docs; ++d) {
    toks.push_back(0);
    uint32_t a = 1 + static_cast<uint32_t>((d * 7) % (vocab - 12));
    int len = 5 + d % 9;
    for (int i = 0; i < len; ++i) toks.push_back(a + static_cast<uint32_t>(i));
  }
  std::string path = dir + "/train_000.bin";
  write_token_file(path, toks, fmt);
  return path;
}

json decoder_run(const std::string& out_dir, const std::string& files, int64_t steps) {
  json text = {{"model_type", "llama"}, {"vocab_size", 48}, {"hidden_size", 32}, {"intermediate_size", 64},
               {"num_hidden_layers", 2}, {"num_attention_heads", 4}, {"num_key_value_heads", 2}};
  json user = {{"model", {{"type", "decoder"}, {"config", text}}},
               {"data", {{"type", "tokens"}, {"train_files", files}, {"seq_len", 32}, {"doc_start_token", 0}}},
               {"train", {{"steps", steps}, {"batch_size", 4}, {"lr", 1e-2}, {"warmup_steps", 2}}},
               {"device", "cpu"},
               {"log_every", 1000},
               {"out_dir", out_dir}};
  return resolve_train_config(user, "test");
}

TEST(TokenStream, PacksDocumentsAtTheSeparator) {
  std::string dir = trainer_tmp("stream");
  std::string f = write_token_docs(dir, 48, 40, TokenFormat::U32);
  TokenStream s(f, 48, 0);
  TokenBatch b = s.batch(0, 2, 16, Device::cpu());
  std::vector<int64_t> ids = b.input_ids.to_int_vector(), labels = b.labels.to_int_vector();
  std::vector<int64_t> pos = b.layout.positions.to_int_vector(), cu = b.layout.cu_seqlens.to_int_vector();
  std::vector<int64_t> stream = s.read(0, 33);
  for (int i = 0; i < 16; ++i) {
    EXPECT_EQ(ids[i], stream[i]);
    EXPECT_EQ(labels[i], stream[i + 1]);  // next token, also across the row end
    if (ids[i] == 0) EXPECT_EQ(pos[i], 0);  // documents restart at the separator
    if (i > 0 && ids[i] != 0) EXPECT_EQ(pos[i], pos[i - 1] + 1);
  }
  EXPECT_EQ(pos[16], 0);  // rows never continue a document
  EXPECT_EQ(cu.back(), 32);
  fs::remove_all(dir);
}

TEST(Trainer, DecoderOnTokenFilesLearns) {
  std::string dir = trainer_tmp("decoder");
  std::string f = write_token_docs(dir + "/data", 48, 400, TokenFormat::U16);
  Trainer t(decoder_run(dir, dir + "/data/train_*.bin", 40));
  t.set_log_callback([](const std::string&) {});
  TrainSummary s = t.run();
  EXPECT_LT(s.last_loss, 0.5 * s.first_loss) << s.first_loss << " -> " << s.last_loss;
  fs::remove_all(dir);
}

// Held-out loss of a decoder (data.eval_files): equal to the mean next-token loss of the same sequences
// computed through the model directly, lower after training, logged to eval.jsonl every eval_every
// steps, and invisible to training (the losses with and without evaluation are the same bits).
TEST(Trainer, DecoderHeldOutLossOnEvalFiles) {
  std::string dir = trainer_tmp("heldout");
  write_token_docs(dir + "/data", 48, 400, TokenFormat::U16);
  fs::create_directories(dir + "/eval");
  {  // held-out documents: other starting ids and lengths than the training file's
    std::vector<uint32_t> toks;
    for (int d = 0; d < 60; ++d) {
      toks.push_back(0);
      const uint32_t a = 2 + static_cast<uint32_t>((d * 11) % 30);
      for (int i = 0; i < 4 + d % 7; ++i) toks.push_back(a + static_cast<uint32_t>(i));
    }
    write_token_file(dir + "/eval/heldout.bin", toks, TokenFormat::U32);
  }
  json cfg = decoder_run(dir + "/with", dir + "/data/train_*.bin", 20);
  cfg["data"]["eval_files"] = dir + "/eval/heldout.bin";
  cfg["data"]["eval_samples"] = 5;
  cfg["eval_every"] = 10;

  // Before training: the same number from a decoder built with the run's seed, sequence by sequence.
  double before = 0;
  {
    Trainer t(cfg);
    t.set_log_callback([](const std::string&) {});
    EvalResult e = t.evaluate();
    ASSERT_EQ(e.tokens, 5 * 32);
    models::TextConfig tc = models::TextConfig::from_json(cfg["model"]["config"]);
    models::Decoder ref(tc, DType::F32, Device::cpu(), cfg["train"]["seed"].get<uint64_t>());
    TokenStream heldout(dir + "/eval/heldout.bin", 48, 0);
    double sum = 0;
    for (uint64_t i = 0; i < 5; ++i) {
      TokenBatch b = heldout.batch(i, 1, 32, Device::cpu());
      sum += ref.loss(ref.forward(ref.embed(b.input_ids), b.layout), b.labels).item();
    }
    EXPECT_NEAR(e.loss, sum / 5, 1e-6 * std::abs(sum / 5));
    EXPECT_GT(e.loss, 2.0);  // about ln 48 at initialisation
    before = e.loss;
  }
  Trainer t(cfg);
  t.set_log_callback([](const std::string&) {});
  t.run();
  EvalResult after = t.evaluate();
  EXPECT_LT(after.loss, 0.6 * before) << before << " -> " << after.loss;
  std::ifstream f(dir + "/with/eval.jsonl");
  std::vector<int64_t> steps;
  for (std::string line; std::getline(f, line);) {
    json row = json::parse(line);
    steps.push_back(row["step"].get<int64_t>());
    EXPECT_EQ(row["eval_tokens"].get<int64_t>(), 160);
  }
  EXPECT_EQ(steps, (std::vector<int64_t>{10, 20}));  // eval_every, then the evaluate() above at the end

  json plain = decoder_run(dir + "/without", dir + "/data/train_*.bin", 20);
  {
    Trainer p(plain);
    p.set_log_callback([](const std::string&) {});
    p.run();
  }
  EXPECT_EQ(losses(dir + "/with"), losses(dir + "/without"));

  json no_files = plain;
  no_files["eval_every"] = 5;
  kestrel::testing::expect_has(kestrel::testing::error_of([&] { Trainer t(no_files); }), {"data.eval_files"});
  json too_many = cfg;
  too_many["data"]["eval_samples"] = 1000;
  kestrel::testing::expect_has(kestrel::testing::error_of([&] { Trainer t(too_many); }), {"data.eval_samples"});
  json missing = cfg;
  missing["data"]["eval_files"] = dir + "/eval/none_*.bin";
  kestrel::testing::expect_has(kestrel::testing::error_of([&] { Trainer t(missing); }), {"data.eval_files"});
  json samples = plain;
  samples["sample_every"] = 5;
  kestrel::testing::expect_has(kestrel::testing::error_of([&] { Trainer t(samples); }), {"sample_every"});
  fs::remove_all(dir);
}

TEST(Trainer, TokenDataErrorsNameTheProblem) {
  std::string dir = trainer_tmp("tokerr");
  std::string f = write_token_docs(dir, 64, 50, TokenFormat::U16);  // ids up to ~63 >= vocab 48
  std::string m = kestrel::testing::error_of([&] { Trainer t(decoder_run(dir + "/out", f, 1)); });
  EXPECT_NE(m.find("vocab"), std::string::npos) << m;
  EXPECT_NE(m.find("position"), std::string::npos) << m;
  m = kestrel::testing::error_of([&] { Trainer t(decoder_run(dir + "/out", dir + "/nothing_*.bin", 1)); });
  EXPECT_NE(m.find("nothing_"), std::string::npos) << m;
  {
    std::ofstream bad(dir + "/bad.bin", std::ios::binary);
    bad << "not a token file";
  }
  m = kestrel::testing::error_of([&] { Trainer t(decoder_run(dir + "/out", dir + "/bad.bin", 1)); });
  EXPECT_NE(m.find("bad.bin"), std::string::npos) << m;
  json wrong = decoder_run(dir + "/out", f, 1);
  wrong["data"]["type"] = "shapes";
  kestrel::testing::expect_has(kestrel::testing::error_of([&] { Trainer t(wrong); }), {"data.type"});
  fs::remove_all(dir);
}

}  // namespace
}  // namespace kestrel::train

namespace kestrel::train {
namespace {

// Writes `n` shapes images as PPM files with a JSONL index; returns the JSONL path.
std::string write_image_text(const std::string& dir, int n, int64_t size) {
  fs::create_directories(dir + "/img");
  ShapesConfig sc;
  sc.image_size = size;
  sc.seed = 3;
  ShapesDataset d(sc);
  std::ofstream f(dir + "/train.jsonl");
  for (int i = 0; i < n; ++i) {
    ShapeSample s = d.sample(static_cast<uint64_t>(i));
    std::string name = "img/" + std::to_string(i) + ".ppm";
    write_ppm(dir + "/" + name, s.pixels, size, size);
    f << json{{"image", name}, {"text", s.caption}}.dump() << "\n";
  }
  return dir + "/train.jsonl";
}

TEST(ImageText, JsonlRecordsTrainTheVlm) {
  std::string dir = trainer_tmp("jsonl");
  std::string path = write_image_text(dir, 24, 20);  // 20 px images, resized to the tower's 16
  json cfg = tiny_run(dir + "/out", 15);
  cfg["data"]["type"] = "jsonl";
  cfg["data"]["train_files"] = path;
  Trainer t(cfg);
  t.set_log_callback([](const std::string&) {});
  TrainSummary s = t.run();
  EXPECT_LT(s.last_loss, 0.8 * s.first_loss);
  // The batch carries the record's caption and the resized image.
  ImageTextData data(path, 16, 4, Device::cpu(), DType::F32);
  EXPECT_EQ(data.size(), 24);
  models::VlmBatch b = data.batch(22, 3);  // wraps around to records 22, 23, 0
  EXPECT_EQ(b.pixel_values.shape(), (Shape{3, 3, 16, 16}));
  EXPECT_EQ(b.layout.cu_seqlens.to_int_vector().size(), 4u);
  fs::remove_all(dir);
}

TEST(ImageText, ErrorsNameFileAndLine) {
  std::string dir = trainer_tmp("jsonl_err");
  std::string path = write_image_text(dir, 2, 16);
  {
    std::ofstream f(path, std::ios::app);
    f << "{\"image\": \"img/missing.ppm\", \"text\": \"x\"}\n";
  }
  try {
    ImageTextData d(path, 16, 4, Device::cpu(), DType::F32);
    ADD_FAILURE();
  } catch (const Error& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("train.jsonl:3"), std::string::npos) << m;
    EXPECT_NE(m.find("missing.ppm"), std::string::npos) << m;
  }
  {
    std::ofstream f(path, std::ios::trunc);
    f << "{\"image\": 1}\n";
  }
  EXPECT_THROW(ImageTextData(path, 16, 4, Device::cpu(), DType::F32), Error);
  fs::remove_all(dir);
}

// Image paths stay inside the JSONL's folder (as chat data's do): absolute paths, '..', a symlink out and
// URLs are refused naming the line.
TEST(ImageText, ImagePathsStayInsideTheDataFolder) {
  std::string dir = trainer_tmp("jsonl_confined");
  std::string path = write_image_text(dir, 1, 16);
  const std::string outside = trainer_tmp("jsonl_outside");
  fs::create_directories(outside);
  write_ppm(outside + "/x.ppm", std::vector<uint8_t>(16 * 16 * 3, 7), 16, 16);
  fs::create_symlink(outside + "/x.ppm", dir + "/img/link.ppm");
  const std::vector<std::pair<std::string, std::string>> cases = {
      {outside + "/x.ppm", "absolute path"},
      {"../jsonl_outside/x.ppm", "climbs out of its folder"},
      {"img/link.ppm", "outside its folder"},
      {"http://example.com/a.png", "is a URL"},
      {"data:image/png;base64,AAAA", "is a URL"}};
  for (const auto& [image, why] : cases) {
    std::ofstream(path, std::ios::trunc) << json{{"image", image}, {"text", "x"}}.dump() << "\n";
    const std::string m = kestrel::testing::error_of([&] { ImageTextData d(path, 16, 4, Device::cpu(), DType::F32); });
    EXPECT_NE(m.find("train.jsonl:1"), std::string::npos) << image << ": " << m;
    EXPECT_NE(m.find(why), std::string::npos) << image << ": " << m;
  }
  fs::remove_all(dir);
  fs::remove_all(outside);
}

// A VLM on image-text or chat data has no held-out captions: evaluation and samples would do nothing, and
// byte-token captions would ignore a text tokenizer; both are refused by name.
TEST(ImageText, SettingsThatWouldDoNothingAreRefused) {
  std::string dir = trainer_tmp("jsonl_noeval");
  std::string path = write_image_text(dir, 2, 16);
  json cfg = tiny_run(dir + "/out", 2);
  cfg["data"]["type"] = "jsonl";
  cfg["data"]["train_files"] = path;
  for (const char* key : {"eval_every", "sample_every"}) {
    json c = cfg;
    c[key] = 5;
    const std::string m = kestrel::testing::error_of([&] { Trainer t(c); });
    EXPECT_NE(m.find(key), std::string::npos) << m;
    EXPECT_NE(m.find("set it to 0"), std::string::npos) << m;
  }
  json c = cfg;
  c["data"]["tokenizer"] = "some/tokenizer.json";
  const std::string m = kestrel::testing::error_of([&] { Trainer t(c); });
  EXPECT_NE(m.find("data.tokenizer"), std::string::npos) << m;
  fs::remove_all(dir);
}

TEST(ImageText, NearestResizeSamplesPixelCentres) {
  Image img;
  img.width = 4;
  img.height = 2;
  for (int i = 0; i < 8; ++i) img.pixels.insert(img.pixels.end(), {uint8_t(i), uint8_t(10 + i), uint8_t(20 + i)});
  std::vector<uint8_t> r = resize_nearest(img, 2);
  ASSERT_EQ(r.size(), 12u);
  // Output pixel centres map to source x = (2x + 1) * 4 / 4 = 1, 3 and rows 0, 1.
  EXPECT_EQ(r[0], 1);      // (0, 0) <- source (0, 1), red
  EXPECT_EQ(r[3], 3);      // (0, 1) <- source (0, 3)
  EXPECT_EQ(r[6], 5);      // (1, 0) <- source (1, 1)
  EXPECT_EQ(r[11], 27);    // (1, 1) <- source (1, 3), blue
}

}  // namespace
}  // namespace kestrel::train
