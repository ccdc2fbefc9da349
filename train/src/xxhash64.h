// Private: XXH64 (Yann Collet's xxHash, 64-bit variant), written from its specification, for the
// checksums in checkpoint manifests: fast (several GB/s on one core) and good at catching flipped
// bits and torn writes; not a cryptographic hash. Known-answer tests in tests/train/test_checkpoint.cpp.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace kestrel::train {

uint64_t xxhash64(const void* data, size_t n, uint64_t seed = 0);
// 16 lower-case hex digits.
std::string xxhash64_hex(uint64_t h);

}  // namespace kestrel::train
