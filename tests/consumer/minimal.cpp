// The minimal program of README.md's "Embedding Kestrel" section, verbatim: check_package.sh compiles
// it with nothing but `pkg-config --cflags --libs kestrel` and runs it, so the README example and the
// .pc file are both checked on every CI run.
#include <kestrel/kestrel.h>
#include <cstdio>

using namespace kestrel;

int main() {
  try {
    Device dev = cuda_available() ? Device::cuda(0) : Device::cpu();
    Tensor x = normal({256, 16}, 0, 1, DType::F32, dev), y = normal({256, 4}, 0, 1, DType::F32, dev);
    Tensor w1, w2;
    {
      TagScope tag(MemoryTag::Parameter);  // every byte is accounted to a tag
      w1 = normal({16, 32}, 0, 0.2, DType::F32, dev).set_requires_grad(true);
      w2 = normal({32, 4}, 0, 0.2, DType::F32, dev).set_requires_grad(true);
    }
    models::ParameterList params;
    params.add("w1", &w1);
    params.add("w2", &w2);
    train::AdamW opt(params, AdamWOptions{.lr = 1e-2});
    for (int step = 0; step < 50; ++step) {
      Tensor loss = mean(square(sub(matmul(tanh(matmul(x, w1)), w2), y)));
      autograd::backward(loss);  // gradients accumulate into w.grad()
      opt.step(1e-2);
      params.zero_grad();
      if (step % 10 == 0) std::printf("step %d loss %.4f\n", step, loss.item());
    }
    std::fputs(memory_report(dev).c_str(), stdout);  // per-tag current/peak, budget, counters
  } catch (const Error& e) {  // "[matmul] inner dimensions differ: ..."; the library never exits
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}
