#include "tasks.h"

#include <sstream>

#include "kestrel/models/decoder.h"
#include "kestrel/models/vlm.h"
#include "kestrel/runtime/memory.h"
#include "kestrel/train/token_data.h"
#include "kestrel/train/vlm_data.h"

namespace kestrel::train {
namespace {
using nlohmann::json;

// Words of a shapes caption "a <colour> <shape> at the <position...>".
struct CaptionParts {
  std::string colour, shape, position;
};
CaptionParts split_caption(const std::string& c) {
  CaptionParts p;
  std::istringstream is(c);
  std::string a, at, the;
  is >> a >> p.colour >> p.shape >> at >> the;
  std::getline(is, p.position);
  if (!p.position.empty() && p.position.front() == ' ') p.position.erase(0, 1);
  return p;
}

template <typename Config>
Config model_config(const json& cfg) {
  const std::string path = cfg["model"]["config_path"];
  return path.empty() ? Config::from_json(cfg["model"]["config"], "model.config") : Config::from_file(path);
}

class VlmTask final : public Task {
 public:
  VlmTask(const json& cfg, DType dtype, Device device) : data_cfg_(cfg["data"]) {
    models::VlmConfig mc = model_config<models::VlmConfig>(cfg);
    const std::string type = data_cfg_["type"];
    KESTREL_CHECK(type == "shapes" || type == "jsonl", "train", "data.type '", type,
                  "' does not fit model.type \"vlm\"; use \"shapes\" (embedded) or \"jsonl\" (image-text records)");
    if (type == "jsonl") {
      const std::string path = data_cfg_["train_files"];
      KESTREL_CHECK(!path.empty(), "train", "data.train_files must name the image-text JSONL file for data.type \"jsonl\"");
      jsonl_ = std::make_unique<ImageTextData>(path, mc.vision_config.image_size, mc.image_tokens_per_image(), device,
                                               dtype);
    } else {
      KESTREL_CHECK(data_cfg_["image_size"].get<int64_t>() == mc.vision_config.image_size, "train",
                    "data.image_size (", data_cfg_["image_size"].get<int64_t>(),
                    ") must equal the vision config's image_size (", mc.vision_config.image_size, ")");
    }
    {
      TagScope tag(MemoryTag::Parameter);
      model_ = std::make_unique<models::Vlm>(mc, dtype, device, cfg["train"]["seed"].get<uint64_t>());
    }
    ShapesConfig sc;
    sc.image_size = data_cfg_["image_size"];
    sc.seed = data_cfg_["seed"];
    sc.noise = data_cfg_["noise"];
    sc.shape_scale = data_cfg_["shape_scale"];
    data_ = std::make_unique<ShapesVlmData>(sc, mc.image_tokens_per_image(), device, dtype);
  }

  models::ParameterList& parameters() override { return model_->parameters(); }
  std::string name() const override { return "vlm"; }

  Tensor micro_batch_loss(uint64_t index, int64_t batch_size, autograd::RecomputePolicy policy,
                          int64_t& tokens) override {
    models::VlmBatch b;
    {
      MemoryLabelScope label("data");
      const uint64_t first = index * static_cast<uint64_t>(batch_size);
      b = jsonl_ ? jsonl_->batch(first, batch_size) : data_->batch(first, batch_size);
    }
    tokens = b.input_ids.numel();
    return model_->loss(b, policy);
  }

  EvalResult evaluate() override {
    if (jsonl_) return {};  // held-out captions are scored on the embedded shapes data only
    const int64_t n = data_cfg_["eval_samples"];
    const uint64_t offset = data_cfg_["eval_offset"];
    EvalResult r;
    const int64_t chunk = 50;
    int correct = 0, colour = 0, shape = 0, position = 0;
    for (int64_t first = 0; first < n; first += chunk) {
      int64_t count = std::min(chunk, n - first);
      std::vector<std::vector<int64_t>> prompts(static_cast<size_t>(count), data_->prompt());
      auto outs = model_->generate_greedy(data_->pixels(offset + first, count), prompts, 48, ByteTokenizer::kEos);
      for (int64_t i = 0; i < count; ++i) {
        std::string want = data_->dataset().sample(offset + first + i).caption;
        std::string got = data_->tokenizer().decode(outs[i]);
        CaptionParts a = split_caption(want), b = split_caption(got);
        correct += got == want;
        colour += a.colour == b.colour;
        shape += a.shape == b.shape;
        position += a.position == b.position;
        if (r.examples.size() < 5) r.examples.emplace_back(want, got);
      }
    }
    r.samples = n;
    r.caption_accuracy = n ? static_cast<double>(correct) / n : 0;
    r.colour_accuracy = n ? static_cast<double>(colour) / n : 0;
    r.shape_accuracy = n ? static_cast<double>(shape) / n : 0;
    r.position_accuracy = n ? static_cast<double>(position) / n : 0;
    return r;
  }

 private:
  json data_cfg_;
  std::unique_ptr<models::Vlm> model_;
  std::unique_ptr<ShapesVlmData> data_;
  std::unique_ptr<ImageTextData> jsonl_;
};

class DecoderTask final : public Task {
 public:
  DecoderTask(const json& cfg, DType dtype, Device device) : device_(device) {
    models::TextConfig tc = model_config<models::TextConfig>(cfg);
    const json& d = cfg["data"];
    KESTREL_CHECK(d["type"] == "tokens", "train", "data.type '", d["type"].get<std::string>(),
                  "' does not fit model.type \"decoder\"; use \"tokens\" (llm.c token files in data.train_files)");
    const std::string files = d["train_files"];
    KESTREL_CHECK(!files.empty(), "train", "data.train_files is empty: give llm.c token files (paths or globs)");
    seq_len_ = d["seq_len"];
    KESTREL_CHECK(seq_len_ > 0, "train", "data.seq_len must be positive, got ", seq_len_);
    stream_ = std::make_unique<TokenStream>(files, tc.vocab_size, d["doc_start_token"].get<int64_t>());
    TagScope tag(MemoryTag::Parameter);
    model_ = std::make_unique<models::Decoder>(tc, dtype, device, cfg["train"]["seed"].get<uint64_t>());
  }

  models::ParameterList& parameters() override { return model_->parameters(); }
  std::string name() const override { return "decoder"; }

  Tensor micro_batch_loss(uint64_t index, int64_t batch_size, autograd::RecomputePolicy policy,
                          int64_t& tokens) override {
    TokenBatch b;
    {
      MemoryLabelScope label("data");
      b = stream_->batch(index, batch_size, seq_len_, device_);
    }
    tokens = b.input_ids.numel();
    return model_->loss(model_->forward(model_->embed(b.input_ids), b.layout, policy), b.labels);
  }

  EvalResult evaluate() override { return {}; }

 private:
  Device device_;
  int64_t seq_len_ = 0;
  std::unique_ptr<TokenStream> stream_;
  std::unique_ptr<models::Decoder> model_;
};

}  // namespace

std::unique_ptr<Task> make_task(const json& cfg, DType dtype, Device device) {
  const std::string type = cfg["model"]["type"];
  if (type == "vlm") return std::make_unique<VlmTask>(cfg, dtype, device);
  if (type == "decoder") return std::make_unique<DecoderTask>(cfg, dtype, device);
  throw make_error("train", "model.type '", type, "' is unknown; use \"vlm\" or \"decoder\"");
}

}  // namespace kestrel::train
