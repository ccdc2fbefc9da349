// kestrel-grad: loads a Hugging Face model folder (config.json + safetensors: llama, mistral, qwen2, qwen3), runs
// forward + backward on the first tokens of an llm.c token file, and writes the loss and every
// parameter gradient (f32, as "grad.<HF name>") to a safetensors file. The way to debug a model
// and to compare Kestrel with another implementation (see tools/compare_hf.py).
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
#include "kestrel/train/token_file.h"

using namespace kestrel;

int main(int argc, char** argv) {
  std::string model_dir, tokens_path, out = "grads.safetensors", device = "cpu", dtype = "f32";
  int64_t seq_len = 64;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto val = [&]() -> std::string {
      if (i + 1 >= argc) throw std::runtime_error(a + " needs a value");
      return argv[++i];
    };
    try {
      if (a == "--model") model_dir = val();
      else if (a == "--tokens") tokens_path = val();
      else if (a == "--out") out = val();
      else if (a == "--device") device = val();
      else if (a == "--dtype") dtype = val();
      else if (a == "--seq-len") seq_len = parse_integer(val(), "--seq-len", 1, std::numeric_limits<int32_t>::max());
      else {
        std::fprintf(stderr,
                     "usage: kestrel-grad --model DIR --tokens FILE [--seq-len N] [--device cpu|cuda] [--dtype f32|bf16] [--out FILE]\n");
        return 2;
      }
    } catch (const std::exception& e) {
      std::fprintf(stderr, "kestrel-grad: %s\n", e.what());
      return 2;
    }
  }
  if (model_dir.empty() || tokens_path.empty()) {
    std::fprintf(stderr, "kestrel-grad: --model and --tokens are required\n");
    return 2;
  }
  try {
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
