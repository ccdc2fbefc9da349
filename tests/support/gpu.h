// GPU test helpers: skip cleanly when no CUDA device is present.
#pragma once

#include <gtest/gtest.h>

namespace kestrel::testing {
// True when the process sees at least one CUDA device (always false in a CPU-only build).
bool gpu_available();
}  // namespace kestrel::testing

#define KESTREL_REQUIRE_GPU()                                      \
  do {                                                             \
    if (!::kestrel::testing::gpu_available()) GTEST_SKIP() << "no CUDA device"; \
  } while (0)
