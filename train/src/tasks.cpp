#include "tasks.h"

#include <sstream>

#include "kestrel/autograd/grad_mode.h"
#include "kestrel/models/decoder.h"
#include "kestrel/models/vlm.h"
#include "kestrel/ops/elementwise.h"
#include "kestrel/ops/reduce.h"
#include "kestrel/runtime/memory.h"
#include "kestrel/train/bpe_tokenizer.h"
#include "kestrel/train/chat_data.h"
#include "kestrel/train/token_data.h"
#include "kestrel/train/vlm_data.h"
#include "kestrel/runtime/log.h"
#include "vlm_init.h"

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
  VlmTask(const json& cfg, DType dtype, Device device) : data_cfg_(cfg["data"]), dtype_(dtype) {
    models::VlmConfig mc = resolve_vlm_config(cfg);  // towers' configs from model.vision_from / text_from
    const std::string type = data_cfg_["type"];
    // data.image_tiling (image_tiling.h): tiles + thumbnail per picture, cut on the prefetch threads.
    const ImageTiling tiling = image_tiling_from_config(data_cfg_);
    KESTREL_CHECK(!tiling.enabled() || type != "chat", "train", "data.image_tiling (max_tiles ", tiling.max_tiles,
                  ") is not wired for data.type \"chat\" (its images become one tile each); use \"jsonl\" or "
                  "\"shapes\" data, or max_tiles 1");
    KESTREL_CHECK(type == "shapes" || type == "jsonl" || type == "chat", "train", "data.type '", type,
                  "' does not fit model.type \"vlm\"; use \"shapes\" (embedded), \"jsonl\" (image-text records) or "
                  "\"chat\" (conversation JSONL, images at <image>)");
    // Held-out captions are scored on the shapes data only: evaluation and samples on other data would
    // be settings that do nothing.
    KESTREL_CHECK(data_cfg_["eval_files"].get<std::string>().empty(), "train", "data.eval_files (held-out token "
                  "files) applies to model.type \"decoder\" on \"tokens\" data; a VLM is evaluated on the shapes "
                  "data's held-out captions. Remove it");
    for (const char* key : {"eval_every", "sample_every"})
      KESTREL_CHECK(type == "shapes" || cfg[key].get<int64_t>() == 0, "train", key, " is ", cfg[key].get<int64_t>(),
                    " but data.type \"", type, "\" has no held-out captions to evaluate (only \"shapes\" does); "
                    "set it to 0");
    // Captions and shapes data are byte tokens; a text tokenizer would be silently ignored.
    KESTREL_CHECK(type == "chat" || data_cfg_["tokenizer"].get<std::string>() == "byte", "train", "data.tokenizer '",
                  data_cfg_["tokenizer"].get<std::string>(), "' is not used by data.type \"", type,
                  "\" (its captions are byte tokens); remove it, or use data.type \"chat\" with a tokenizer");
    if (type == "jsonl") {
      const std::string path = data_cfg_["train_files"];
      KESTREL_CHECK(!path.empty(), "train", "data.train_files must name the image-text JSONL file for data.type \"jsonl\"");
      jsonl_ = std::make_unique<ImageTextData>(path, mc.vision_config.image_size, tokens_per_image(mc), device, dtype,
                                               tiling);
    } else if (type == "chat") {
      const std::string path = data_cfg_["train_files"], tok = data_cfg_["tokenizer"];
      KESTREL_CHECK(!path.empty(), "train", "data.train_files must name the conversation JSONL file for data.type \"chat\"");
      const int64_t seq_len = data_cfg_["seq_len"];
      ChatVision vision{{mc.image_token_id, tokens_per_image(mc)}, mc.vision_config.image_size, dtype};
      chat_ = std::make_unique<ChatData>(path, load_text_tokenizer(tok), tok,
                                         chat_template_from(data_cfg_["chat_template"], mc.text_config.model_type),
                                         seq_len, mc.text_config.vocab_size, vision);
      log_message(LogLevel::Info, "train", "chat data: " + std::to_string(chat_->conversations()) +
                                               " conversations with " + std::to_string(chat_->images()) +
                                               " images in " + std::to_string(chat_->rows()) + " rows of " +
                                               std::to_string(seq_len) + " tokens, " +
                                               std::to_string(chat_->truncated()) + " cut to seq_len");
    } else if (!tiling.enabled()) {  // tiled shapes pictures may be any size (cut into the tower's tiles)
      KESTREL_CHECK(data_cfg_["image_size"].get<int64_t>() == mc.vision_config.image_size, "train",
                    "data.image_size (", data_cfg_["image_size"].get<int64_t>(),
                    ") must equal the vision config's image_size (", mc.vision_config.image_size, ")");
    }
    {
      TagScope tag(MemoryTag::Parameter);
      model_ = std::make_unique<models::Vlm>(mc, dtype, device, cfg["train"]["seed"].get<uint64_t>());
    }
    load_pretrained_towers(*model_, cfg, [](const std::string& line) { log_message(LogLevel::Info, "train", line); });
    ShapesConfig sc;
    sc.image_size = data_cfg_["image_size"];
    sc.seed = data_cfg_["seed"];
    sc.noise = data_cfg_["noise"];
    sc.shape_scale = data_cfg_["shape_scale"];
    KESTREL_CHECK(sc.image_size > 0, "train", "data.image_size must be positive, got ", sc.image_size);
    // The shapes data also scores held-out captions; it is tiled as the training data is when that is shapes.
    data_ = type == "shapes" ? std::make_unique<ShapesVlmData>(sc, tokens_per_image(mc), device, dtype, tiling,
                                                               mc.vision_config.image_size)
                             : std::make_unique<ShapesVlmData>(sc, tokens_per_image(mc), device, dtype);
  }

  models::ParameterList& parameters() override { return model_->parameters(); }
  std::string name() const override { return "vlm"; }
  models::Decoder* decoder() override { return &model_->decoder(); }
  void set_deterministic(bool on) override { model_->set_deterministic(on); }

  HostBatch prepare(uint64_t index, int64_t batch_size) const override {
    if (chat_) return chat_->host_batch(index, batch_size);
    const uint64_t first = index * static_cast<uint64_t>(batch_size);
    return jsonl_ ? jsonl_->host_batch(first, batch_size) : data_->host_batch(first, batch_size);
  }

  Tensor loss(const HostBatch& b, const std::vector<Tensor>& arrays, autograd::RecomputePolicy policy,
              const Tensor& loss_grad) override {
    models::VlmBatch vb = vlm_batch_from(b, arrays, dtype_);
    CrossEntropyOptions ce;
    ce.known_grad = loss_grad;
    if (vb.image_positions.numel() > 0) return model_->loss(vb, policy, ce);
    // No image in the batch (text-only conversations): the tower still runs, on one blank image whose
    // embeddings enter the sequence times 0 where the splice would be (after the embedding, before
    // the decoder). The loss is the text-only loss exactly, and every parameter gets its (zero)
    // gradient in the same order as in a batch with images, so data-parallel ranks reduce the same
    // buckets whatever their batches hold (as LLaVA trainers do with a dummy image).
    const models::Decoder& dec = model_->decoder();
    Tensor embeds = dec.embed(vb.input_ids);
    const int64_t S = model_->config().vision_config.image_size;
    Tensor img = model_->image_embeddings(Tensor::zeros({1, 3, S, S}, dtype_, vb.input_ids.device()), policy);
    embeds = add(embeds, scale(mean(img), 0.0));
    return dec.loss(dec.forward(embeds, vb.layout, policy), vb.labels, ce);
  }

  std::vector<std::pair<std::string, std::string>> samples(int64_t count) override {
    if (jsonl_ || chat_ || count <= 0) return {};
    return evaluate_range(std::min<int64_t>(count, 50)).examples;
  }

  EvalResult evaluate() override {
    if (jsonl_ || chat_) return {};  // held-out captions are scored on the embedded shapes data only
    return evaluate_range(data_cfg_["eval_samples"].get<int64_t>());
  }

 private:
  // Greedy captions of held-out records eval_offset + [0, n), scored; the first 5 kept as examples.
  EvalResult evaluate_range(int64_t n) {
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

  json data_cfg_;
  DType dtype_;
  std::unique_ptr<models::Vlm> model_;
  std::unique_ptr<ShapesVlmData> data_;
  std::unique_ptr<ImageTextData> jsonl_;
  std::unique_ptr<ChatData> chat_;
};

class DecoderTask final : public Task {
 public:
  DecoderTask(const json& cfg, DType dtype, Device device) : device_(device) {
    for (const char* k : {"vision_from", "text_from"})
      KESTREL_CHECK(cfg["model"].value(k, std::string()).empty(), "train", "model.", k, " applies to model.type "
                    "\"vlm\"; a decoder starts from a folder with model.config_path = DIR/config.json and "
                    "model.init_from = DIR");
    models::TextConfig tc = model_config<models::TextConfig>(cfg);
    const json& d = cfg["data"];
    const std::string type = d["type"];
    KESTREL_CHECK(!image_tiling_from_config(d).enabled(), "train", "data.image_tiling applies to model.type \"vlm\" "
                  "(a decoder has no images); leave max_tiles at 1");
    KESTREL_CHECK(type == "tokens" || type == "chat", "train", "data.type '", type,
                  "' does not fit model.type \"decoder\"; use \"tokens\" (llm.c token files in data.train_files) "
                  "or \"chat\" (conversation JSONL)");
    const std::string files = d["train_files"];
    seq_len_ = d["seq_len"];
    KESTREL_CHECK(seq_len_ > 0, "train", "data.seq_len must be positive, got ", seq_len_);
    if (type == "chat") {
      KESTREL_CHECK(!files.empty(), "train", "data.train_files is empty: give the conversation JSONL file");
      const std::string tok = d["tokenizer"];
      chat_ = std::make_unique<ChatData>(files, load_text_tokenizer(tok), tok,
                                         chat_template_from(d["chat_template"], tc.model_type), seq_len_,
                                         tc.vocab_size);
      log_message(LogLevel::Info, "train", "chat data: " + std::to_string(chat_->conversations()) +
                                               " conversations in " + std::to_string(chat_->rows()) + " rows of " +
                                               std::to_string(seq_len_) + " tokens, " +
                                               std::to_string(chat_->truncated()) + " cut to seq_len");
    } else {
      KESTREL_CHECK(!files.empty(), "train", "data.train_files is empty: give llm.c token files (paths or globs)");
      stream_ = std::make_unique<TokenStream>(files, tc.vocab_size, d["doc_start_token"].get<int64_t>());
    }
    // Held-out tokens: data.eval_files, read by evaluate() (every eval_every steps and at the end).
    const std::string eval_files = d["eval_files"];
    const int64_t eval_every = cfg["eval_every"];
    KESTREL_CHECK(eval_files.empty() || type == "tokens", "train", "data.eval_files applies to data.type \"tokens\"; "
                  "chat data has no held-out evaluation. Remove it");
    KESTREL_CHECK(eval_every == 0 || !eval_files.empty(), "train", "eval_every is ", eval_every,
                  " but a decoder is evaluated on held-out token files: set data.eval_files (llm.c token files "
                  "kept out of data.train_files, e.g. from kestrel-train tokenize) or set eval_every to 0");
    KESTREL_CHECK(cfg["sample_every"].get<int64_t>() == 0, "train", "sample_every is ",
                  cfg["sample_every"].get<int64_t>(), " but a decoder run has no samples to generate; set it to 0");
    if (!eval_files.empty()) {
      eval_samples_ = d["eval_samples"];
      KESTREL_CHECK(eval_samples_ > 0, "train", "data.eval_samples must be positive with data.eval_files, got ",
                    eval_samples_);
      try {
        eval_ = std::make_unique<TokenStream>(eval_files, tc.vocab_size, d["doc_start_token"].get<int64_t>());
      } catch (const Error& e) {
        throw make_error("train", "data.eval_files: ", e.what());
      }
      // Sequences wrap at the end of the stream: more than it holds would count tokens twice.
      const int64_t need = eval_samples_ * seq_len_ + 1;
      KESTREL_CHECK(eval_->size() >= need, "train", "data.eval_files holds ", eval_->size(), " tokens but data.eval_samples ",
                    eval_samples_, " sequences of data.seq_len ", seq_len_, " need ", need,
                    "; lower data.eval_samples or add held-out tokens");
    }
    if (const std::string tok = d["tokenizer"]; type == "tokens" && !tok.empty() && tok != "byte") {
      // The token files should come from this tokenizer (kestrel-train tokenize); its ids must fit the model.
      const int64_t v = load_text_tokenizer(tok)->vocab_size();
      KESTREL_CHECK(v <= tc.vocab_size, "train", "data.tokenizer '", tok, "' has ", v,
                    " ids but the model's vocab_size is ", tc.vocab_size);
    }
    TagScope tag(MemoryTag::Parameter);
    model_ = std::make_unique<models::Decoder>(tc, dtype, device, cfg["train"]["seed"].get<uint64_t>());
  }

  models::ParameterList& parameters() override { return model_->parameters(); }
  std::string name() const override { return "decoder"; }
  models::Decoder* decoder() override { return model_.get(); }

  HostBatch prepare(uint64_t index, int64_t batch_size) const override {
    return chat_ ? chat_->host_batch(index, batch_size) : stream_->host_batch(index, batch_size, seq_len_);
  }

  Tensor loss(const HostBatch& hb, const std::vector<Tensor>& arrays, autograd::RecomputePolicy policy,
              const Tensor& loss_grad) override {
    TokenBatch b = token_batch_from(hb, arrays);
    CrossEntropyOptions ce;
    ce.known_grad = loss_grad;
    return model_->loss(model_->forward(model_->embed(b.input_ids), b.layout, policy), b.labels, ce);
  }

  // The mean next-token loss over the first eval_samples sequences of the held-out stream, one
  // sequence per forward (no tape: evaluation holds no activations for a backward).
  EvalResult evaluate() override {
    EvalResult r;
    if (!eval_) return r;
    autograd::NoGradGuard no_grad;
    double total = 0;
    for (int64_t i = 0; i < eval_samples_; ++i) {
      HostBatch hb = eval_->host_batch(static_cast<uint64_t>(i), 1, seq_len_);
      TokenBatch b = token_batch_from(hb, arrays_to_device(hb, device_));
      Tensor loss = model_->loss(model_->forward(model_->embed(b.input_ids), b.layout, autograd::RecomputePolicy::None),
                                 b.labels);
      total += loss.item() * static_cast<double>(hb.tokens);  // every token of a token stream is labelled
      r.tokens += hb.tokens;
    }
    r.loss = total / static_cast<double>(r.tokens);
    return r;
  }

 private:
  Device device_;
  int64_t seq_len_ = 0;
  std::unique_ptr<TokenStream> eval_;
  int64_t eval_samples_ = 0;
  std::unique_ptr<TokenStream> stream_;
  std::unique_ptr<ChatData> chat_;
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
