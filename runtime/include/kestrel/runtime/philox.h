// Philox4x32-10 counter-based generator (Salmon et al., SC'11), usable in host and device code.
//
// Stream definition (identical on CPU and CUDA): for a draw of n values with generator state
// (seed, offset), element i takes word (i % 4) of philox(key = seed, counter = {offset + i / 4,
// 0, 0, 0}... high words carry the upper bits of the 64-bit block index). The state's offset then
// advances by ceil(n / 4) blocks. Uniform floats use the top 24 bits: (w >> 8) * 2^-24 in [0, 1).
// Normals pair elements (2j, 2j+1) through Box-Muller on uniforms in (0, 1].
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define KESTREL_HD __host__ __device__ __forceinline__
#else
#define KESTREL_HD inline
#endif

namespace kestrel {

struct Philox4 {
  uint32_t v[4];
};

KESTREL_HD uint32_t philox_mulhilo(uint32_t a, uint32_t b, uint32_t* hi) {
  uint64_t p = static_cast<uint64_t>(a) * static_cast<uint64_t>(b);
  *hi = static_cast<uint32_t>(p >> 32);
  return static_cast<uint32_t>(p);
}

// The full generator: 128-bit counter, 64-bit key.
KESTREL_HD Philox4 philox4x32_10(Philox4 ctr, uint32_t k0, uint32_t k1) {
  uint32_t c0 = ctr.v[0], c1 = ctr.v[1], c2 = ctr.v[2], c3 = ctr.v[3];
  for (int r = 0; r < 10; ++r) {
    uint32_t hi0, hi1;
    uint32_t lo0 = philox_mulhilo(0xD2511F53u, c0, &hi0);
    uint32_t lo1 = philox_mulhilo(0xCD9E8D57u, c2, &hi1);
    uint32_t n0 = hi1 ^ c1 ^ k0, n1 = lo1, n2 = hi0 ^ c3 ^ k1, n3 = lo0;
    c0 = n0; c1 = n1; c2 = n2; c3 = n3;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return Philox4{{c0, c1, c2, c3}};
}

// Kestrel's use: key = seed, counter = {block (low), block (high), 0, 0}.
KESTREL_HD Philox4 philox4x32_10(uint64_t key64, uint64_t block) {
  Philox4 ctr{{static_cast<uint32_t>(block), static_cast<uint32_t>(block >> 32), 0u, 0u}};
  return philox4x32_10(ctr, static_cast<uint32_t>(key64), static_cast<uint32_t>(key64 >> 32));
}

// The i-th 32-bit word of the stream starting at block `offset`.
KESTREL_HD uint32_t philox_word(uint64_t seed, uint64_t offset, uint64_t i) {
  Philox4 r = philox4x32_10(seed, offset + i / 4);
  return r.v[i % 4];
}

KESTREL_HD float philox_uniform(uint64_t seed, uint64_t offset, uint64_t i) {
  return static_cast<float>(philox_word(seed, offset, i) >> 8) * (1.0f / 16777216.0f);
}

}  // namespace kestrel
