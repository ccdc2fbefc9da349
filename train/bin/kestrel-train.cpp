// kestrel-train --config run.json [--set key=value ...] [--resume latest|DIR] [--allow-config-change]
//               [--overwrite-out-dir] [--print-config] [--memory-budget 40GiB] [--eval-only]
//               [--nproc-per-node N]
// kestrel-train tokenize --tokenizer byte|tokenizer.json --output out.bin [--separator TOKEN] FILE...
// kestrel-train export --config run.json [--weights DIR] --out DIR [--format kestrel|llava] [--logits-in F --logits-out F]
// Translates every kestrel::Error into a message and a non-zero exit code.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include "kestrel/models/config.h"
#include "kestrel/runtime/error.h"
#include "kestrel/runtime/memory_budget.h"
#include "kestrel/runtime/memory_trace.h"
#include "kestrel/runtime/communicator.h"
#include "kestrel/runtime/local_launch.h"
#include "kestrel/runtime/rendezvous.h"
#include "kestrel/runtime/parse_number.h"
#include "kestrel/runtime/device.h"
#include "kestrel/train/memory_profile.h"
#include "kestrel/models/safetensors.h"
#include "kestrel/train/tokenize_text.h"
#include "kestrel/train/vlm_export.h"
#include "kestrel/train/tokenizer.h"
#include "kestrel/train/run_config.h"
#include "kestrel/train/train_config.h"
#include "kestrel/train/trainer.h"

using namespace kestrel;

namespace {
void usage(FILE* f) {
  std::fprintf(f,
               "usage: kestrel-train --config run.json [options]\n"
               "  --config FILE          run configuration (JSON); see configs/quickstart_vlm.json\n"
               "  --set KEY=VALUE        override a config key (dotted path, value as JSON or text); repeatable\n"
               "  --memory-budget SIZE   device memory budget, e.g. 40GiB (same as --set memory_budget=SIZE)\n"
               "  --resume latest|DIR    continue from the newest intact checkpoint in out_dir, or from DIR\n"
               "                         (verified against its manifest; refused when made with a config\n"
               "                         that changes the run's maths or data)\n"
               "  --allow-config-change  resume although the checkpoint's config differs (logged)\n"
               "  --overwrite-out-dir    start a new run in an out_dir that holds another run's checkpoints,\n"
               "                         deleting them (without it such a start is refused)\n"
               "  --print-config         print the resolved configuration and exit\n"
               "  --eval-only            evaluate (greedy captions; a decoder's held-out loss) without training\n"
               "  --nproc-per-node N     start N processes of this command on this host, one per GPU (RANK,\n"
               "                         WORLD_SIZE, LOCAL_RANK, MASTER_ADDR=127.0.0.1, a free MASTER_PORT), wait\n"
               "                         for them, and end them all when one fails (its exit code and message)\n"
               "  --help                 this text\n"
               "The config's on_cpu / on_cuda objects ({\"train.steps\": 600, ...}) apply on that device;\n"
               "--set wins over them.\n"
               "Several GPUs: one process per GPU started by torchrun or srun (RANK, WORLD_SIZE, LOCAL_RANK,\n"
               "MASTER_ADDR, MASTER_PORT or SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID); distributed.* keys.\n"
               "\n"
               "usage: kestrel-train export --config run.json [--set k=v ...] [--weights CHECKPOINT_OR_FOLDER]\n"
               "                            --out DIR [--format kestrel|llava] [--logits-in IN --logits-out OUT]\n"
               "  writes the run's VLM (towers from model.vision_from / text_from, model.init_from, then --weights)\n"
               "  as one folder: \"kestrel\" (config.json + model.safetensors; continue with model.config_path and\n"
               "  model.init_from) or \"llava\" (LlavaForConditionalGeneration for transformers); --logits-in reads\n"
               "  input_ids [T] i64 and pixel_values [B,3,S,S] from a .safetensors, --logits-out writes the logits\n"
               "  [T, V] f32 (bench/vlm_export_check.py compares them with transformers).\n"
               "usage: kestrel-train tokenize --tokenizer byte|tokenizer.json --output out.bin [--separator TOKEN] FILE...\n"
               "  text -> llm.c token file for data.type \"tokens\" (uint16 when the vocabulary fits, else uint32).\n"
               "  FILE: .jsonl (one {\"text\": ...} document per line) or text (one document per line).\n"
               "  Each document follows the separator token (default <|endoftext|>, else <eos>); set\n"
               "  data.doc_start_token to the id it prints.\n");
}

int tokenize_main(int argc, char** argv) {
  std::string tokenizer = "byte", output, separator;
  std::vector<std::string> inputs;
  for (int i = 2; i < argc; ++i) {
    std::string a = argv[i];
    auto need = [&]() -> std::string {
      if (i + 1 >= argc) throw make_error("tokenize", a, " needs a value");
      return argv[++i];
    };
    if (a == "--tokenizer") tokenizer = need();
    else if (a == "--output") output = need();
    else if (a == "--separator") separator = need();
    else if (a == "--help" || a == "-h") {
      usage(stdout);
      return 0;
    } else if (!a.empty() && a[0] == '-') {
      throw make_error("tokenize", "unknown argument '", a, "'");
    } else {
      inputs.push_back(a);
    }
  }
  KESTREL_CHECK(!output.empty(), "tokenize", "--output is required");
  auto tok = train::load_text_tokenizer(tokenizer);
  train::TokenizeResult r = train::tokenize_to_token_file(*tok, inputs, output, separator);
  std::printf("%s: %lld documents, %lld tokens (%s, vocabulary %lld); document separator id %lld "
              "(data.doc_start_token)\n",
              output.c_str(), static_cast<long long>(r.documents), static_cast<long long>(r.tokens),
              r.format == train::TokenFormat::U16 ? "uint16" : "uint32", static_cast<long long>(tok->vocab_size()),
              static_cast<long long>(r.separator_id));
  return 0;
}
}  // namespace

// kestrel-train export: the run's VLM (its config, towers, init_from, then --weights) as one folder.
int export_main(int argc, char** argv) {
  std::string config_path, weights, out, format = "kestrel", logits_in, logits_out;
  std::vector<std::string> sets;
  for (int i = 2; i < argc; ++i) {
    std::string a = argv[i];
    auto need = [&]() -> std::string {
      if (i + 1 >= argc) throw make_error("export", a, " needs a value");
      return argv[++i];
    };
    if (a == "--config") config_path = need();
    else if (a == "--set") sets.push_back(need());
    else if (a == "--weights") weights = need();
    else if (a == "--out") out = need();
    else if (a == "--format") format = need();
    else if (a == "--logits-in") logits_in = need();
    else if (a == "--logits-out") logits_out = need();
    else if (a == "--help" || a == "-h") {
      usage(stdout);
      return 0;
    } else {
      throw make_error("export", "unknown argument '", a, "'");
    }
  }
  KESTREL_CHECK(!config_path.empty(), "export", "--config is required (the run's config; its model section)");
  KESTREL_CHECK(!out.empty() || !logits_out.empty(), "export", "--out DIR (or --logits-out FILE) is required");
  KESTREL_CHECK(logits_in.empty() == logits_out.empty(), "export", "--logits-in and --logits-out go together");
  nlohmann::json cfg = train::resolve_train_config(models::read_json_file(config_path, "config"), config_path);
  train::apply_device_overrides(cfg, /*on_cuda=*/false, sets);
  std::unique_ptr<models::Vlm> vlm = train::build_vlm_for_export(cfg, weights);
  if (!out.empty()) {
    train::export_vlm(*vlm, out, format);
    std::printf("exported %s (%s layout, %.2fM parameters)\n", out.c_str(), format.c_str(),
                static_cast<double>(vlm->parameters().numel()) / 1e6);
  }
  if (!logits_out.empty()) {
    // The fixed input of bench/vlm_export_check.py: input_ids [T] i64, pixel_values [B, 3, S, S] f32.
    models::SafetensorsReader in = models::SafetensorsReader::open(logits_in);
    auto take = [&](const char* name) {
      const models::SafetensorsEntry& e = in.get(name);
      Shape shape(e.shape.begin(), e.shape.end());
      return Tensor::from_blob(const_cast<std::byte*>(e.bytes.data()), shape, e.dtype, Device::cpu()).clone();
    };
    Tensor logits = train::vlm_logits(*vlm, take("input_ids"), take("pixel_values").to(DType::F32)).contiguous();
    models::write_safetensors(logits_out, {{"logits", DType::F32, std::vector<int64_t>(logits.shape().begin(),
                                                                                     logits.shape().end()),
                                            logits.data_ptr()}});
    std::printf("logits %s -> %s\n", logits.str().c_str(), logits_out.c_str());
  }
  return 0;
}

// --nproc-per-node N > 1: N children of this binary with the same arguments but this one, one per
// GPU over NCCL. There is no backend across processes on the CPU (the in-process one joins threads
// of one process), so a CPU run, a library without NCCL or too few GPUs is refused before any start.
int launch_node(int nproc, const nlohmann::json& cfg, int argc, char** argv) {
  const LaunchEnv env = launch_env_from_process();
  KESTREL_CHECK(env.world_size == 1, "launch", "--nproc-per-node inside a launched process (rank ", env.rank, " of ",
                env.world_size, " from ", env.source, "): use one launcher");
  KESTREL_CHECK(cfg["distributed"]["backend"] != "none", "launch", "--nproc-per-node ", nproc,
                " with distributed.backend \"none\": the processes would not talk to each other");
  const Device dev = train::RunConfig::resolve_device(cfg);
  KESTREL_CHECK(dev.is_cuda(), "launch", "--nproc-per-node ", nproc, " runs one process per GPU over NCCL, and the "
                "device is ", dev.str(), ": there is no CPU backend across processes (data parallelism on the CPU "
                "runs only in-process, as the tests' thread ranks). Run without --nproc-per-node on the CPU");
  KESTREL_CHECK(nccl_available(), "launch", "--nproc-per-node ", nproc, " needs NCCL, and this library was built "
                "without it (KESTREL_NCCL=OFF or no NCCL found at configure time)");
  KESTREL_CHECK(cuda_device_count() >= nproc, "launch", "--nproc-per-node ", nproc, " but this host has ",
                cuda_device_count(), " CUDA device(s)");
  LocalLaunchOptions o;
  o.program = std::filesystem::read_symlink("/proc/self/exe").string();
  o.nproc = nproc;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--nproc-per-node") {
      ++i;
      continue;
    }
    if (a.rfind("--nproc-per-node=", 0) == 0) continue;
    o.args.push_back(a);
  }
  std::printf("kestrel-train: starting %d processes (ranks 0-%d, one per GPU)\n", nproc, nproc - 1);
  std::fflush(stdout);
  // A signal to the launcher names no failed rank but is no success (exit 128 + the signal).
  const LaunchReport rep = launch_report(launch_local_workers(o), nproc);
  if (!rep.message.empty()) std::fprintf(stderr, "%s\n", rep.message.c_str());
  return rep.exit_status;
}

int main(int argc, char** argv) {
  if (argc >= 2 && std::strcmp(argv[1], "export") == 0) {
    try {
      return export_main(argc, argv);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "kestrel-train export: error: %s\n", e.what());
      return 1;
    }
  }
  if (argc >= 2 && std::strcmp(argv[1], "tokenize") == 0) {
    try {
      return tokenize_main(argc, argv);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "kestrel-train tokenize: error: %s\n", e.what());
      return 1;
    }
  }
  std::string config_path, resume;
  std::vector<std::string> sets;
  bool print_config = false, eval_only = false;
  train::ResumeOptions resume_options;
  bool overwrite_out_dir = false;
  int nproc = 1;  // --nproc-per-node
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto need = [&](const char* what) -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "kestrel-train: %s needs a value\n", what);
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--help" || a == "-h") {
      usage(stdout);
      return 0;
    } else if (a == "--config") {
      config_path = need("--config");
    } else if (a == "--set") {
      sets.push_back(need("--set"));
    } else if (a == "--memory-budget") {
      const std::string v = need("--memory-budget");
      try {
        parse_size(v, "--memory-budget");  // refused here on any device, not only where it applies
      } catch (const Error& e) {
        std::fprintf(stderr, "kestrel-train: error: %s\n", e.what());
        return 2;
      }
      sets.push_back("memory_budget=" + v);
    } else if (a == "--resume") {
      resume = need("--resume");
    } else if (a == "--allow-config-change") {
      resume_options.allow_config_change = true;
    } else if (a == "--overwrite-out-dir") {
      overwrite_out_dir = true;
    } else if (a == "--print-config") {
      print_config = true;
    } else if (a == "--nproc-per-node" || a.rfind("--nproc-per-node=", 0) == 0) {
      const std::string v = a == "--nproc-per-node" ? need("--nproc-per-node") : a.substr(17);
      try {
        nproc = static_cast<int>(parse_integer(v, "--nproc-per-node", 1, 4096, "launch"));
      } catch (const Error& e) {
        std::fprintf(stderr, "kestrel-train: error: %s\n", e.what());
        return 2;
      }
    } else if (a == "--eval-only") {
      eval_only = true;
    } else {
      std::fprintf(stderr, "kestrel-train: unknown argument '%s'\n", a.c_str());
      usage(stderr);
      return 2;
    }
  }
  if (config_path.empty()) {
    std::fprintf(stderr, "kestrel-train: --config is required\n");
    usage(stderr);
    return 2;
  }
  try {
    nlohmann::json user = models::read_json_file(config_path, "config");
    nlohmann::json cfg = train::resolve_train_config(user, config_path);
    for (const std::string& s : sets) train::apply_override(cfg, s);
    {
      // The device's on_cpu / on_cuda settings, then --set again (the command line wins).
      const bool on_cuda = train::RunConfig::resolve_device(cfg).is_cuda();
      for (const std::string& o : train::apply_device_overrides(cfg, on_cuda, sets))
        if (!print_config) std::printf("%s: %s\n", on_cuda ? "on_cuda" : "on_cpu", o.c_str());
    }
    {
      // A multi-process launch (torchrun / Slurm variables, read once here): one GPU per process,
      // cuda:LOCAL_RANK where the config leaves the device to "auto" or says "cuda".
      const LaunchEnv launch = launch_env_from_process();
      const std::string d = cfg["device"];
      if (launch.world_size > 1 && (d == "auto" || d == "cuda"))
        cfg["device"] = "cuda:" + std::to_string(launch.local_rank);
    }
    if (print_config) {
      std::printf("%s\n", cfg.dump(2).c_str());
      return 0;
    }
    if (nproc > 1) return launch_node(nproc, cfg, argc, argv);
    // Building the model and resuming can run out of the budget too: log their allocations so the
    // report of such a failure has the same files as one inside a step.
    const Device dev = train::RunConfig::resolve(cfg).device;
    MemoryTrace& trace = memory_trace(dev);
    trace.clear_events();
    const MemorySnapshot start = trace.snapshot();
    trace.set_event_logging(true, 1u << 21);
    std::optional<train::Trainer> built;
    const std::string out_dir = cfg["out_dir"];
    try {
      train::run_with_memory_report(
          [&] {
            built.emplace(cfg);
            built->set_overwrite_out_dir(overwrite_out_dir);
            built->resume(resume, resume_options);
          },
          out_dir, dev, start, nullptr, {{"source", "kestrel-train OutOfBudget while building the model or resuming"}});
    } catch (const OutOfBudget& e) {
      trace.set_event_logging(false);
      std::fprintf(stderr, "kestrel-train: out of the memory budget before the first step:\n%s\nmemory report: "
                   "%s/memory_report.json, profile: %s/memory.html\n", e.what(), out_dir.c_str(), out_dir.c_str());
      return 3;
    }
    trace.set_event_logging(false);
    train::Trainer& trainer = *built;
    const bool rank0 = launch_env_from_process().rank == 0;
    if (!eval_only) {
      train::TrainSummary s = trainer.run();
      if (rank0) {
      std::printf("trained %lld steps in %.1f s: loss %.4f -> %.4f (%.1f%% of start)\n", static_cast<long long>(s.steps),
                  s.seconds, s.first_loss, s.last_loss, s.first_loss > 0 ? 100.0 * s.last_loss / s.first_loss : 0.0);
      std::printf("memory report: %s\n", s.memory_report_path.c_str());
      }
    }
    if (!rank0) return 0;
    train::EvalResult e = trainer.evaluate();
    if (e.samples > 0) std::printf("held-out captions: %.1f%% exactly right (colour %.1f%%, shape %.1f%%, position %.1f%%) over %lld images\n",
                100 * e.caption_accuracy, 100 * e.colour_accuracy, 100 * e.shape_accuracy, 100 * e.position_accuracy,
                static_cast<long long>(e.samples));
    if (e.tokens > 0) std::printf("held-out loss: %.4f (perplexity %.3f) over %lld tokens of data.eval_files\n", e.loss,
                                  std::exp(e.loss), static_cast<long long>(e.tokens));
    for (auto& [want, got] : e.examples) std::printf("  expected: %-34s generated: %s\n", want.c_str(), got.c_str());
    return 0;
  } catch (const OutOfBudget& e) {
    std::fprintf(stderr, "kestrel-train: out of the memory budget:\n%s\n", e.what());
    return 3;
  } catch (const Error& e) {
    std::fprintf(stderr, "kestrel-train: error: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kestrel-train: error: %s\n", e.what());
    return 1;
  }
}
