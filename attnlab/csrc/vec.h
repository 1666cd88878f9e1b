// The vector layer: one generic vector type, the maths every kernel does on it, and the
// one way code is compiled for each instruction set and chosen at load.
//
// ATTNLAB_PER_ISA marks a function compiled once per level below and picked when the
// library loads (the compiler's target_clones: an ifunc resolved at load from the CPU's
// features), so one cached build is safe on any machine and still uses the widest
// vectors of the one it runs on (-march=native would not be):
//   x86-64:  arch=x86-64-v4 (AVX-512), arch=x86-64-v3 (AVX2 + FMA + F16C), default (SSE2);
//   aarch64: NEON is the baseline there, so "default" is already vectorised; a level
//            with SVE would be one more name in the list (target_clones("sve", "default")).
// Code written with the f8 type below and the helpers (all always_inline, so they are
// compiled into each clone) becomes AVX-512, AVX2 or SSE code in the matching clone.
// Hand-written intrinsics (tile_gemm.h's AVX-512 kernel, the bf16 and int8 dot products of
// dot_bf16.h and int8_product.h) carry their level's target and run only where
// cpu_level() says the CPU has it: the same levels, one detection.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define ATTNLAB_X86 1
#define ATTNLAB_PER_ISA \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define ATTNLAB_PER_ISA
#endif

// Helpers taking or returning vectors must inline into each clone: called out of line,
// the baseline copy would pass them in memory while an AVX clone passes them in registers.
#define ATTNLAB_INLINE static inline __attribute__((always_inline))

namespace attnlab {

// The instruction-set levels, as ATTNLAB_PER_ISA names them, and one beyond them for
// hand-written intrinsics: Avx512Dot, AVX-512 with the bf16 and int8 dot products
// (avx512_bf16's vdpbf16ps, avx512_vnni's vpdpbusd: Zen 4 and later, Cooper Lake,
// Sapphire Rapids). Each level includes the ones below it: compare with >=.
enum class Level : int { Base = 0, Avx2 = 1, Avx512 = 2, Avx512Dot = 3 };

// The level of this CPU, detected once.
inline Level cpu_level() {
#if defined(ATTNLAB_X86)
  static const Level level =
      !__builtin_cpu_supports("x86-64-v4")
          ? (__builtin_cpu_supports("x86-64-v3") ? Level::Avx2 : Level::Base)
      : __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512vnni")
          ? Level::Avx512Dot
          : Level::Avx512;
  return level;
#else
  return Level::Base;
#endif
}

// A weight streamed once per decoded token is fetched a few lines ahead with the
// non-temporal hint (prefetchnta on x86, a streaming prefetch on Arm), so that it passes
// through the caches without evicting what the rest of the token needs (the caches, the
// row, the Python and torch code between the products). Measured on the one-row bf16
// loop (dot_bf16.h), SmolLM-135M's shape, one Zen 4 core, interleaved in one process:
// 1.10-1.18x tokens/s at 128-320 bytes ahead, 0.95x at 768; neutral at two threads. The
// float32 loops (row_product.h) and the int8 loop (its bands and their scales) were 9-13%
// (128-256 bytes ahead) and 4-26% (0-512) slower with it, so they go without.
constexpr int64_t STREAM_AHEAD_BYTES = 256;

ATTNLAB_INLINE void stream_hint(const void* p) {
  __builtin_prefetch(static_cast<const char*>(p) + STREAM_AHEAD_BYTES, 0, 0);
}

// The next two lines of [at, end) fetched into L2 (prefetcht1 on x86), at advanced past
// them: what a product reads next (the next band or group of a weight), fetched a little
// at a time while it multiplies what it holds in cache, so that the read from memory and
// the products overlap (tile_bf16.h's panels, int8_product.h's groups of a prompt).
ATTNLAB_INLINE void fetch_ahead(const char*& at, const char* end) {
  const std::ptrdiff_t left = end - at;  // (at never steps past end: no pointer beyond it)
  if (left > 0) {
    __builtin_prefetch(at, 0, 2);
    if (left > 64) __builtin_prefetch(at + 64, 0, 2);
    at += left > 128 ? 128 : left;
  }
}

// Eight floats as one value (GCC/Clang vector extensions): one ymm in the AVX clones,
// two xmm in the baseline one. Sixteen, for streaming loops: one zmm with AVX-512.
typedef float f8 __attribute__((vector_size(32)));
typedef int32_t i8 __attribute__((vector_size(32)));
typedef float f16v __attribute__((vector_size(64)));
typedef int32_t i16v __attribute__((vector_size(64)));

ATTNLAB_INLINE f8 load8(const float* p) {
  f8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
ATTNLAB_INLINE void store8(float* p, f8 v) { std::memcpy(p, &v, sizeof(v)); }
ATTNLAB_INLINE f8 splat8(float x) { return f8{} + x; }
// The last n < 8 values of a row padded with `fill`.
ATTNLAB_INLINE f8 load_tail(const float* p, int64_t n, float fill) {
  float buf[8];
  for (int j = 0; j < 8; ++j) buf[j] = j < n ? p[j] : fill;
  return load8(buf);
}
ATTNLAB_INLINE float sum8(f8 v) {
  float t = 0.0f;
  for (int j = 0; j < 8; ++j) t += v[j];
  return t;
}

ATTNLAB_INLINE f16v load16(const float* p) {
  f16v v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
ATTNLAB_INLINE void store16(float* p, f16v v) { std::memcpy(p, &v, sizeof(v)); }
// The two halves of v added: eight partial sums.
ATTNLAB_INLINE f8 fold16(f16v v) {
  f8 lo, hi;
  std::memcpy(&lo, &v, sizeof(lo));
  std::memcpy(&hi, reinterpret_cast<const char*>(&v) + sizeof(lo), sizeof(hi));
  return lo + hi;
}
ATTNLAB_INLINE float sum16(f16v v) {
  float t = 0.0f;
  for (int j = 0; j < 16; ++j) t += v[j];
  return t;
}

// e^x to about 1 ulp (Cephes expf) for a vector V of floats (I: its int32 vector):
// e^x = 2^n e^r with |r| <= ln2/2, branch-free so the loops vectorise without
// -ffast-math. Exactly 0 below -87.33 and for -inf, so masked scores give weights of
// exactly zero.
template <typename V, typename I>
ATTNLAB_INLINE V exp_v(V x) {
  const V lo = V{} + -87.33654f, hi = V{} + 88.0f;
  V xc = x < lo ? lo : x;
  xc = xc > hi ? hi : xc;
  const V magic = V{} + 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const V n = (xc * 1.44269504088896341f + magic) - magic;
  V r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  V y = V{} + 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  const I bits = (__builtin_convertvector(n, I) + 127) << 23;
  const V e = y * (V)bits;  // a vector cast reinterprets the bits: 2^n
  return x < lo ? V{} : e;
}
ATTNLAB_INLINE f8 exp8(f8 x) { return exp_v<f8, i8>(x); }
ATTNLAB_INLINE f16v exp16(f16v x) { return exp_v<f16v, i16v>(x); }

// tanh as a rational function (Eigen's float tanh: odd degree-13 over even degree-6
// polynomial, a few ulp): no exp, one division, exact in relative terms near 0 where
// (e^2x - 1) / (e^2x + 1) cancels. |x| beyond 7.9 gives +-1 in float; NaN stays NaN.
template <typename V>
ATTNLAB_INLINE V tanh_v(V x) {
  const V lim = V{} + 7.90531110763549805f;
  V xc = x > lim ? lim : x;
  xc = xc < -lim ? -lim : xc;
  const V x2 = xc * xc;
  V p = V{} + -2.76076847742355e-16f;
  p = p * x2 + 2.00018790482477e-13f;
  p = p * x2 + -8.60467152213735e-11f;
  p = p * x2 + 5.12229709037114e-08f;
  p = p * x2 + 1.48572235717979e-05f;
  p = p * x2 + 6.37261928875436e-04f;
  p = p * x2 + 4.89352455891786e-03f;
  V q = V{} + 1.19825839466702e-06f;
  q = q * x2 + 1.18534705686654e-04f;
  q = q * x2 + 2.26843463243900e-03f;
  q = q * x2 + 4.89352518554385e-03f;
  return p * xc / q;
}
ATTNLAB_INLINE f8 tanh8(f8 x) { return tanh_v(x); }
ATTNLAB_INLINE f16v tanh16(f16v x) { return tanh_v(x); }

// silu(x) = x / (1 + e^-x); 0 below -87, where exp_v stops at e^88 instead of overflowing
// (which gave silu(-3e38) = -1.8); NaN stays NaN.
template <typename V, typename I>
ATTNLAB_INLINE V silu_v(V x) {
  const V g = x / (1.0f + exp_v<V, I>(-x));
  return x < -87.0f ? V{} : g;
}
ATTNLAB_INLINE f8 silu8(f8 x) { return silu_v<f8, i8>(x); }

// GELU's tanh approximation, torch's gelu(approximate="tanh"): x/2 (1 + tanh(u)),
// u = sqrt(2/pi) (x + 0.044715 x^3), written as x / (1 + e^(-2u)) (the same number, since
// 1 + tanh(u) = 2 / (1 + e^(-2u))), so that the negative side keeps its relative accuracy
// instead of cancelling in 1 + tanh (tanh_v stops short of -1: that gave -1.4e-6 at
// x = -12 and -3.6e31 at x = -3e38). Past |x| = 10 it is x (x > 0) or 0, to float
// precision and for the infinities; NaN stays NaN.
template <typename V, typename I>
ATTNLAB_INLINE V gelu_tanh_v(V x) {
  const V u = 0.7978845608028654f * (x + 0.044715f * x * x * x);
  const V g = x / (1.0f + exp_v<V, I>(-2.0f * u));
  const V ax = x < 0.0f ? -x : x;
  return ax > 10.0f ? (x > 0.0f ? x : V{}) : g;
}
ATTNLAB_INLINE f8 gelu_tanh8(f8 x) { return gelu_tanh_v<f8, i8>(x); }

}  // namespace attnlab
