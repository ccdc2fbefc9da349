// The embedding smoke test: a program built against the installed Kestrel package trains a two-layer
// network and a tiny Llama decoder for a few AdamW steps through the public API, then runs the
// config-driven Trainer in-process on a tiny VLM — on the CPU, and on the first GPU too when one is
// visible (with the application's own CUDA stream and a memory budget) — printing the losses and the
// memory statistics. Exit 1 when a loss does not fall, 2 on a
// kestrel::Error, so CI catches a broken package, a broken header set or a broken training path.
#include <kestrel/kestrel.h>

#include <atomic>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include <unistd.h>

#if CONSUMER_OWNS_CUDA_STREAM
#include <cuda_runtime.h>
#endif

using namespace kestrel;

namespace {

std::atomic<int> g_log_lines{0};

struct Losses {
  double first = 0, last = 0;
};

bool fell(const char* what, Device device, const Losses& l) {
  bool ok = std::isfinite(l.last) && l.last < 0.9 * l.first;
  std::printf("%-8s on %-6s loss %.4f -> %.4f  %s\n", what, device.str().c_str(), l.first, l.last,
              ok ? "ok" : "DID NOT FALL");
  return ok;
}

// Two-layer tanh network fit to a random teacher, full batch, AdamW over a ParameterList.
Losses train_mlp(Device device, int steps) {
  Generator gen(7);
  const int64_t n = 256, d_in = 16, d_hidden = 32, d_out = 4;
  Tensor x = normal({n, d_in}, 0, 1, DType::F32, device, gen);
  Tensor y = tanh(matmul(x, normal({d_in, d_out}, 0, 0.5, DType::F32, device, gen)));  // [n, d_out]
  Tensor w1, w2;
  models::ParameterList params;
  {
    TagScope tag(MemoryTag::Parameter);
    w1 = normal({d_in, d_hidden}, 0, 0.2, DType::F32, device, gen).set_requires_grad(true);
    w2 = normal({d_hidden, d_out}, 0, 0.2, DType::F32, device, gen).set_requires_grad(true);
  }
  params.add("w1", &w1);
  params.add("w2", &w2);
  train::AdamW opt(params, AdamWOptions{.lr = 1e-2, .weight_decay = 0.0});
  Losses l;
  for (int step = 0; step < steps; ++step) {
    Tensor loss;
    {
      TagScope tag(MemoryTag::Activation);
      loss = mean(square(sub(matmul(tanh(matmul(x, w1)), w2), y)));
    }
    {
      TagScope tag(MemoryTag::Gradient);
      autograd::backward(loss);
    }
    {
      TagScope tag(MemoryTag::OptimizerState);
      opt.step(1e-2);
    }
    params.zero_grad();
    double v = loss.item();
    if (step == 0) l.first = v;
    l.last = v;
  }
  return l;
}

// A 2-layer Llama decoder memorising two packed random documents (next-token loss), AdamW.
Losses train_decoder(Device device, DType dtype, int steps) {
  models::TextConfig c = models::TextConfig::defaults_for("llama");
  c.vocab_size = 64;
  c.hidden_size = 32;
  c.intermediate_size = 48;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 8;
  c.max_position_embeddings = 64;
  std::unique_ptr<models::Decoder> model;
  {
    TagScope tag(MemoryTag::Parameter);
    model = std::make_unique<models::Decoder>(c, dtype, device, /*seed=*/11);
  }
  const std::vector<int64_t> lengths = {24, 16};
  Generator gen(3);
  Tensor ids_cpu = randint({40}, c.vocab_size, DType::I64, Device::cpu(), gen);  // [T]
  std::vector<int64_t> labels(40, -100);                                        // next token per document
  for (int64_t start = 0; int64_t len : lengths) {
    for (int64_t i = 0; i + 1 < len; ++i) labels[start + i] = ids_cpu.data<int64_t>()[start + i + 1];
    start += len;
  }
  Tensor ids = ids_cpu.to(device);
  Tensor target = Tensor::from_vector(labels, {40}, DType::I64, device);
  models::PackedBatch batch = models::PackedBatch::from_lengths(lengths, device);
  // The decoder's AdamW keeps its state in host memory (the embedding API of optimizer.offload=host).
  train::AdamW opt(model->parameters(), AdamWOptions{.lr = 1e-2, .weight_decay = 0.0},
                   train::OptimizerPlacement{.offload = train::OptimizerOffload::Host});
  Losses l;
  for (int step = 0; step < steps; ++step) {
    Tensor loss;
    {
      TagScope tag(MemoryTag::Activation);
      loss = model->loss(model->forward(model->embed(ids), batch), target);
    }
    {
      TagScope tag(MemoryTag::Gradient);
      autograd::backward(loss);
    }
    {
      TagScope tag(MemoryTag::OptimizerState);
      opt.step(1e-2);
    }
    model->parameters().zero_grad();
    double v = loss.item();
    if (step == 0) l.first = v;
    l.last = v;
  }
  return l;
}

// The config-driven trainer loop in-process: a tiny VLM on the shapes data for a few steps, with the
// caller's device and memory budget in the config and its log lines routed to the app's logger.
Losses run_trainer(Device device, const std::string& out_dir) {
  nlohmann::json text = {{"model_type", "qwen2"}, {"vocab_size", 260}, {"hidden_size", 32},
                         {"intermediate_size", 64}, {"num_hidden_layers", 1}, {"num_attention_heads", 4},
                         {"num_key_value_heads", 2}, {"max_position_embeddings", 128}, {"tie_word_embeddings", true}};
  nlohmann::json vision = {{"model_type", "siglip_vision_model"}, {"hidden_size", 16}, {"intermediate_size", 32},
                           {"num_hidden_layers", 1}, {"num_attention_heads", 2}, {"num_channels", 3},
                           {"image_size", 16}, {"patch_size", 4}};
  nlohmann::json user = {
      {"model", {{"type", "vlm"},
                 {"config", {{"model_type", "kestrel_vlm"}, {"image_token_id", 259}, {"pixel_shuffle_factor", 2},
                             {"projector_hidden_size", 32}, {"vision_config", vision}, {"text_config", text}}}}},
      {"data", {{"type", "shapes"}, {"image_size", 16}, {"seed", 3}}},
      {"train", {{"steps", 8}, {"batch_size", 4}, {"lr", 1e-2}, {"min_lr", 1e-3}, {"warmup_steps", 0}}},
      {"device", device.str()},
      {"memory_budget", device.is_cuda() ? "2GiB" : ""},
      {"log_every", 4},
      {"out_dir", out_dir}};
  train::Trainer trainer(train::resolve_train_config(user, "consumer"));
  trainer.set_log_callback([](const std::string& line) { log_message(LogLevel::Info, "train", line); });
  train::TrainSummary sum = trainer.run();
  return {sum.first_loss, sum.last_loss};
}

bool run_on(Device device, const std::string& tmp) {
  memory_trace(device).reset_peaks();
  bool ok = fell("mlp", device, train_mlp(device, 40));
  ok = fell("decoder", device, train_decoder(device, device.is_cuda() ? DType::BF16 : DType::F32, 30)) && ok;
  ok = fell("trainer", device, run_trainer(device, tmp + "/trainer_" + (device.is_cuda() ? "cuda" : "cpu"))) && ok;
  synchronize(device);
  MemorySnapshot s = memory_stats(device);
  std::printf("memory stats %s: peak in use %lld B, parameters peak %lld B, optimizer state peak %lld B\n",
              device.str().c_str(), static_cast<long long>(s.peak_in_use),
              static_cast<long long>(s.tags[static_cast<int>(MemoryTag::Parameter)].peak),
              static_cast<long long>(s.tags[static_cast<int>(MemoryTag::OptimizerState)].peak));
  std::fputs(memory_report(device).c_str(), stdout);
  return ok;
}

}  // namespace

int main() {
  // Route the library's messages into the application's logger.
  set_log_callback([](LogLevel level, std::string_view component, std::string_view message) {
    ++g_log_lines;
    std::printf("app-log %s [%.*s] %.*s\n", std::string(log_level_name(level)).c_str(),
                static_cast<int>(component.size()), component.data(), static_cast<int>(message.size()),
                message.data());
  });
  try {
    log_to(LogLevel::Info, "consumer", "CUDA devices visible: ", cuda_device_count());
    // Errors are exceptions naming the op; the library never exits the process.
    try {
      matmul(Tensor::zeros({2, 3}), Tensor::zeros({4, 5}));
      std::printf("expected a kestrel::Error for mismatched matmul shapes\n");
      return 1;
    } catch (const Error& e) {
      std::printf("caught kestrel::Error: %s\n", e.what());
    }

    const std::string tmp = (std::filesystem::temp_directory_path() / ("kestrel_consumer_" + std::to_string(::getpid()))).string();
    bool ok = run_on(Device::cpu(), tmp);
    if (cuda_available()) {
      Device gpu = Device::cuda(0);
      set_memory_budget(gpu, parse_bytes("4GiB"));
#if CONSUMER_OWNS_CUDA_STREAM
      cudaStream_t stream = nullptr;
      if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess) {
        std::printf("cudaStreamCreate failed\n");
        return 1;
      }
      {
        StreamScope on_app_stream(gpu, static_cast<StreamHandle>(stream));
        ok = run_on(gpu, tmp) && ok;
      }
      cudaStreamSynchronize(stream);
      cudaStreamDestroy(stream);
#else
      ok = run_on(gpu, tmp) && ok;
#endif
    } else {
      std::printf("no CUDA device: GPU part skipped\n");
    }
    std::filesystem::remove_all(tmp);
    std::printf("log callback received %d line(s)\n", g_log_lines.load());
    if (g_log_lines.load() == 0) ok = false;
    std::printf("%s\n", ok ? "consumer: all losses fell" : "consumer: FAILED");
    return ok ? 0 : 1;
  } catch (const Error& e) {
    std::fprintf(stderr, "kestrel::Error: %s\n", e.what());
    return 2;
  }
}
