// kestrel-grad: loads a Hugging Face model folder (config.json + safetensors: llama, mistral, qwen2, qwen3), runs
// forward + backward on the first tokens of an llm.c token file, and writes the loss and every
// parameter gradient (f32, as "grad.<HF name>") to a safetensors file. The way to debug a model
// and to compare Kestrel with another implementation (see tools/compare_hf.py).
// A LLaVA folder (config.json model_type "llava", kestrel/train/llava_folder.h) takes --inputs instead of
// --tokens: a safetensors file with input_ids [B, T] i64, pixel_values [N, 3, S, S] and labels [B, T] i64
// (transformers' convention, shifted inside; absent: input_ids with -100 at the image tokens). Its gradients are
// written under the folder's tensor names; parameters the loss does not reach (vision blocks past
// vision_feature_layer, post_layernorm) get zeros, listed on stdout (bench/vlm_parity_gpu.py).
#include <cstdio>
#include <limits>
#include <string>
#include <vector>

#include "kestrel/autograd/tape.h"
#include "kestrel/models/config.h"
#include "kestrel/models/decoder.h"
#include "kestrel/models/safetensors.h"
#include "kestrel/runtime/error.h"
#include "kestrel/runtime/parse_number.h"
#include "kestrel/train/llava_folder.h"
#include "kestrel/train/token_file.h"

using namespace kestrel;

namespace {

Tensor read_tensor(const models::SafetensorsFile& f, const std::string& name) {
  const models::SafetensorsEntry& e = f.get(name);
  return Tensor::from_blob(const_cast<std::byte*>(e.bytes.data()), Shape(e.shape.begin(), e.shape.end()), e.dtype,
                           Device::cpu())
      .clone();
}

// Loss and every gradient of a LLaVA folder on the inputs of `inputs_path`, written to `out`.
int run_llava(const std::string& model_dir, const std::string& inputs_path, Device dev, DType dtype,
              const std::string& out) {
  train::LlavaFolder f = train::load_llava_folder(model_dir, dtype, dev);
  const models::SafetensorsFile in = models::SafetensorsFile::open(inputs_path);
  // Every tensor of the inputs is used or refused: an attention mask that hides positions (left padding)
  // would give transformers another loss than this unmasked one.
  for (const auto& e : in.entries())
    KESTREL_CHECK(e.name == "input_ids" || e.name == "pixel_values" || e.name == "labels" || e.name == "attention_mask",
                  "kestrel-grad", inputs_path, " holds '", e.name, "', which kestrel-grad does not use (it reads "
                  "input_ids, pixel_values, labels and an all-ones attention_mask)");
  if (in.contains("attention_mask"))
    for (int64_t v : read_tensor(in, "attention_mask").to_int_vector())
      KESTREL_CHECK(v == 1, "kestrel-grad", inputs_path, ": attention_mask has a ", v, "; padded or masked "
                    "positions are not supported (give unpadded rows)");
  const Tensor ids = read_tensor(in, "input_ids");
  const Tensor pixels = read_tensor(in, "pixel_values");
  Tensor labels;
  if (in.contains("labels")) {
    labels = read_tensor(in, "labels");
  } else {  // transformers' usual training labels: the ids, no loss on image tokens
    std::vector<int64_t> l = ids.to_int_vector();
    for (int64_t& v : l)
      if (v == f.vlm->config().image_token_id) v = -100;
    labels = Tensor::from_vector(l, ids.shape());
  }
  const models::VlmBatch batch =
      train::vlm_batch_from_llava_inputs(ids, labels, pixels, f.vlm->config().image_token_id, dtype, dev);
  Tensor loss = f.vlm->loss(batch);
  autograd::backward(loss);
  std::vector<Tensor> keep;
  std::vector<models::SafetensorsWriteEntry> entries;
  keep.push_back(loss.to(Device::cpu()).to(DType::F32).contiguous().view({1}));
  entries.push_back({"loss", DType::F32, {1}, keep.back().data_ptr()});
  std::string no_grad;
  for (const auto& [llava, name] : f.names) {
    const Tensor& p = f.vlm->parameters().get(name);
    Tensor g = p.grad();
    if (!g.defined()) {
      no_grad += (no_grad.empty() ? "" : ", ") + llava;
      g = Tensor::zeros(p.shape());
    }
    keep.push_back(g.to(Device::cpu()).to(DType::F32).contiguous());
    entries.push_back({"grad." + llava, DType::F32, p.shape(), keep.back().data_ptr()});
  }
  models::write_safetensors(out, entries);
  std::printf("no gradient (written as zeros): %s\n", no_grad.empty() ? "none" : no_grad.c_str());
  std::printf("loss %.8f; %zu gradients written to %s\n", loss.item(), entries.size() - 1, out.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::string model_dir, tokens_path, inputs_path, out = "grads.safetensors", device = "cpu", dtype = "f32";
  int64_t seq_len = 64;
  bool seq_len_given = false;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto val = [&]() -> std::string {
      if (i + 1 >= argc) throw std::runtime_error(a + " needs a value");
      return argv[++i];
    };
    try {
      if (a == "--model") model_dir = val();
      else if (a == "--tokens") tokens_path = val();
      else if (a == "--inputs") inputs_path = val();
      else if (a == "--out") out = val();
      else if (a == "--device") device = val();
      else if (a == "--dtype") dtype = val();
      else if (a == "--seq-len") {
        seq_len = parse_integer(val(), "--seq-len", 1, std::numeric_limits<int32_t>::max());
        seq_len_given = true;
      }
      else {
        std::fprintf(stderr,
                     "usage: kestrel-grad --model DIR --tokens FILE [--seq-len N] [--device cpu|cuda] [--dtype f32|bf16] [--out FILE]\n"
                     "       kestrel-grad --model LLAVA_DIR --inputs FILE.safetensors [--device ...] [--dtype ...] [--out FILE]\n");
        return 2;
      }
    } catch (const std::exception& e) {
      std::fprintf(stderr, "kestrel-grad: %s\n", e.what());
      return 2;
    }
  }
  try {
    const bool llava = !model_dir.empty() &&
                       models::read_json_file(model_dir + "/config.json").value("model_type", std::string()) == "llava";
    if (llava) {
      KESTREL_CHECK(!inputs_path.empty() && tokens_path.empty(), "kestrel-grad",
                    "a LLaVA folder takes --inputs FILE.safetensors (input_ids, pixel_values, labels), not --tokens");
      KESTREL_CHECK(!seq_len_given, "kestrel-grad", "--seq-len is for --tokens; a LLaVA folder's --inputs give "
                    "their own lengths");
      return run_llava(model_dir, inputs_path, parse_device(device), parse_dtype(dtype), out);
    }
    if (model_dir.empty() || tokens_path.empty() || !inputs_path.empty()) {
      std::fprintf(stderr, "kestrel-grad: --model and --tokens are required (--inputs is for a LLaVA folder)\n");
      return 2;
    }
    models::TextConfig cfg = models::TextConfig::from_file(model_dir + "/config.json");
    Device dev = parse_device(device);
    models::Decoder model(cfg, parse_dtype(dtype), dev);
    models::load_safetensors(model.parameters(), model_dir, /*strict=*/true);
    train::TokenFile tf = train::TokenFile::open(tokens_path);
    tf.check_vocab(cfg.vocab_size);
    KESTREL_CHECK(tf.size() >= seq_len, "kestrel-grad", tokens_path, " has ", tf.size(), " tokens, need ", seq_len);
    std::vector<int64_t> ids(seq_len), labels(seq_len, -100);
    for (int64_t i = 0; i < seq_len; ++i) ids[i] = tf.at(i);
    for (int64_t i = 0; i + 1 < seq_len; ++i) labels[i] = ids[i + 1];
    Tensor id_t = Tensor::from_vector(ids, {seq_len}, DType::I64, dev);
    Tensor lab_t = Tensor::from_vector(labels, {seq_len}, DType::I64, dev);
    models::PackedBatch batch = models::PackedBatch::from_lengths({seq_len}, dev);
    Tensor loss = model.loss(model.forward(model.embed(id_t), batch), lab_t);
    autograd::backward(loss);
    std::vector<Tensor> keep;
    std::vector<models::SafetensorsWriteEntry> entries;
    keep.push_back(loss.to(Device::cpu()).to(DType::F32).contiguous().view({1}));
    entries.push_back({"loss", DType::F32, {1}, keep.back().data_ptr()});
    for (auto& [name, p] : model.parameters().items()) {
      KESTREL_CHECK(p->grad().defined(), "kestrel-grad", "parameter ", name, " got no gradient");
      keep.push_back(p->grad().to(Device::cpu()).to(DType::F32).contiguous());
      entries.push_back({"grad." + name, DType::F32, p->shape(), keep.back().data_ptr()});
    }
    models::write_safetensors(out, entries);
    std::printf("loss %.8f; %zu gradients written to %s\n", loss.item(), entries.size() - 1, out.c_str());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kestrel-grad: error: %s\n", e.what());
    return 1;
  }
}
