// Pieces the CUDA benchmarks (bench/cuda/*.cu) share: a device-side random bf16 fill and the
// CUDA-event timing loop (manual time). Included by .cu files only (it defines a kernel).
#pragma once

#include <benchmark/benchmark.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <functional>

#include "kestrel/cuda/check.h"

namespace kestrel::bench {

// Deterministic pseudo-random bf16 bits in [-2, 2), hashed from (index, seed) on the device: no host
// transfer, and the same values on every run. Launch with any grid (grid-stride loop).
static __global__ void fill_random_bf16(uint16_t* x, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    const float f = (static_cast<float>(h & 0xffffu) / 65536.f - 0.5f) * 4.f;
    uint32_t bits;
    memcpy(&bits, &f, 4);
    x[i] = static_cast<uint16_t>(bits >> 16);
  }
}

// Runs fn `warmups` times untimed (plans, allocator, module load), then once per benchmark iteration
// between two CUDA events recorded on `stream`, and reports each iteration's event time (register the
// benchmark with UseManualTime()). Returns the mean seconds per call, for the caller's counters.
inline double time_with_events(benchmark::State& state, const std::function<void()>& fn, cudaStream_t stream,
                               int warmups = 1) {
  cudaEvent_t start, stop;
  KESTREL_CUDA_CHECK(cudaEventCreate(&start));
  KESTREL_CUDA_CHECK(cudaEventCreate(&stop));
  for (int i = 0; i < warmups; ++i) fn();
  KESTREL_CUDA_CHECK(cudaStreamSynchronize(stream));
  double total_ms = 0;
  for (auto _ : state) {
    KESTREL_CUDA_CHECK(cudaEventRecord(start, stream));
    fn();
    KESTREL_CUDA_CHECK(cudaEventRecord(stop, stream));
    KESTREL_CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    KESTREL_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    state.SetIterationTime(ms * 1e-3);
    total_ms += ms;
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return total_ms * 1e-3 / static_cast<double>(state.iterations());
}

}  // namespace kestrel::bench
