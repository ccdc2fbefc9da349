// A small fork-join pool for CPU kernels: parallel_for splits [begin, end) into chunks of at
// least `grain` and runs them on the pool's threads plus the caller. Nested calls run inline.
#pragma once

#include <cstdint>
#include <functional>

namespace kestrel {

int num_cpu_threads();
void set_num_cpu_threads(int n);  // 0 = default_cpu_threads(): KESTREL_NUM_THREADS, else the hardware's
void parallel_for(int64_t begin, int64_t end, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);

}  // namespace kestrel
