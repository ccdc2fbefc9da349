// Where a tensor's bytes live: the host or one CUDA device.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

namespace kestrel {

enum class DeviceType : uint8_t { CPU, CUDA };

struct Device {
  DeviceType type = DeviceType::CPU;
  int index = 0;

  static constexpr Device cpu() { return {DeviceType::CPU, 0}; }
  static constexpr Device cuda(int i = 0) { return {DeviceType::CUDA, i}; }
  constexpr bool is_cpu() const { return type == DeviceType::CPU; }
  constexpr bool is_cuda() const { return type == DeviceType::CUDA; }
  constexpr bool operator==(const Device&) const = default;
  std::string str() const { return is_cpu() ? "cpu" : "cuda:" + std::to_string(index); }
};

// Parses "cpu", "cuda", "cuda:N", "gpu".
Device parse_device(const std::string& s);

// True when this build has CUDA and the process sees at least one device.
bool cuda_available();
int cuda_device_count();

// An opaque stream handle (cudaStream_t on CUDA; nullptr = the context's compute stream).
using StreamHandle = void*;

}  // namespace kestrel

template <>
struct std::hash<kestrel::Device> {
  size_t operator()(const kestrel::Device& d) const noexcept {
    return (static_cast<size_t>(d.type) << 16) ^ static_cast<size_t>(d.index);
  }
};
