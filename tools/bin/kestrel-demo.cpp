// kestrel-demo: a small autograd demo — a two-layer MLP fit to a random teacher network with
// SGD — printing the loss curve and writing a per-tag memory report. It stands in for the
// quickstart until the trainer exists.
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>

#include "kestrel/autograd/grad_mode.h"
#include "kestrel/autograd/tape.h"
#include "kestrel/ops/elementwise.h"
#include "kestrel/ops/matmul.h"
#include "kestrel/ops/reduce.h"
#include "kestrel/runtime/memory_trace.h"
#include "kestrel/runtime/random.h"

using namespace kestrel;

int main(int argc, char** argv) {
  std::string out_dir = ".";
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--out") == 0 && i + 1 < argc) {
      out_dir = argv[++i];
    } else {
      std::fprintf(stderr, "usage: kestrel-demo [--out DIR]\n");
      return 2;
    }
  }
  try {
    Generator gen(1234);
    const int64_t n = 512, d_in = 32, d_hidden = 64, d_out = 8;
    Tensor x = normal({n, d_in}, 0, 1, DType::F32, Device::cpu(), gen);
    Tensor teacher = normal({d_in, d_out}, 0, 0.5, DType::F32, Device::cpu(), gen);
    Tensor y = tanh(matmul(x, teacher));
    Tensor w1, w2;
    {
      TagScope params(MemoryTag::Parameter);
      w1 = normal({d_in, d_hidden}, 0, 0.2, DType::F32, Device::cpu(), gen).set_requires_grad(true);
      w2 = normal({d_hidden, d_out}, 0, 0.2, DType::F32, Device::cpu(), gen).set_requires_grad(true);
    }
    memory_trace(Device::cpu()).reset_peaks();
    double first = 0, last = 0;
    for (int step = 0; step <= 300; ++step) {
      Tensor loss;
      {
        TagScope act(MemoryTag::Activation);
        loss = mean(square(sub(matmul(tanh(matmul(x, w1)), w2), y)));
      }
      {
        TagScope g(MemoryTag::Gradient);
        autograd::backward(loss);
      }
      {
        autograd::NoGradGuard no_grad;
        for (Tensor* w : {&w1, &w2}) {
          w->copy_(sub(*w, scale(w->grad(), 0.5)));
          w->zero_grad();
        }
      }
      last = loss.item();
      if (step == 0) first = last;
      if (step % 50 == 0) std::printf("step %4d  loss %.6f\n", step, last);
    }
    std::printf("loss fell from %.4f to %.4f (%.1f%% of start)\n", first, last, 100.0 * last / first);
    auto snap = memory_trace(Device::cpu()).snapshot();
    std::string path = out_dir + "/memory_report.txt";
    std::ofstream f(path);
    f << "tag peak_bytes\n";
    for (int t = 0; t < kNumMemoryTags; ++t)
      f << tag_name(static_cast<MemoryTag>(t)) << " " << snap.tags[t].peak << "\n";
    std::printf("memory report: %s (peak in use %lld bytes)\n", path.c_str(), static_cast<long long>(snap.peak_in_use));
    return 0;
  } catch (const Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
