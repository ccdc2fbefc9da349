// kestrel-train --config run.json [--set key=value ...] [--resume latest|DIR] [--print-config]
//               [--memory-budget 40GiB] [--eval-only]
// Translates every kestrel::Error into a message and a non-zero exit code.
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "kestrel/models/config.h"
#include "kestrel/runtime/error.h"
#include "kestrel/runtime/memory_budget.h"
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
               "  --resume latest|DIR    continue from the newest checkpoint in out_dir, or from DIR\n"
               "  --print-config         print the resolved configuration and exit\n"
               "  --eval-only            evaluate (greedy captions) without training\n"
               "  --help                 this text\n");
}
}  // namespace

int main(int argc, char** argv) {
  std::string config_path, resume;
  std::vector<std::string> sets;
  bool print_config = false, eval_only = false;
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
      sets.push_back("memory_budget=" + need("--memory-budget"));
    } else if (a == "--resume") {
      resume = need("--resume");
    } else if (a == "--print-config") {
      print_config = true;
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
    if (print_config) {
      std::printf("%s\n", cfg.dump(2).c_str());
      return 0;
    }
    train::Trainer trainer(cfg);
    trainer.resume(resume);
    if (!eval_only) {
      train::TrainSummary s = trainer.run();
      std::printf("trained %lld steps in %.1f s: loss %.4f -> %.4f (%.1f%% of start)\n", static_cast<long long>(s.steps),
                  s.seconds, s.first_loss, s.last_loss, s.first_loss > 0 ? 100.0 * s.last_loss / s.first_loss : 0.0);
      std::printf("memory report: %s\n", s.memory_report_path.c_str());
    }
    train::EvalResult e = trainer.evaluate();
    if (e.samples > 0) std::printf("held-out captions: %.1f%% exactly right (colour %.1f%%, shape %.1f%%, position %.1f%%) over %lld images\n",
                100 * e.caption_accuracy, 100 * e.colour_accuracy, 100 * e.shape_accuracy, 100 * e.position_accuracy,
                static_cast<long long>(e.samples));
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
