// The dropout decision of one attention weight, shared by the forward and backward.
#pragma once

#include <cstdint>

namespace attnlab {

// Dropout decision of one weight, a pure function of (seed, flat index) so that
// the backward regenerates the forward's pattern whatever the tiling.
static inline bool dropout_keeps(uint64_t seed, uint64_t index, double p) {
  uint64_t z = seed ^ (index * 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return static_cast<double>(z >> 40) * (1.0 / 16777216.0) >= p;  // 24-bit uniform
}

}  // namespace attnlab
