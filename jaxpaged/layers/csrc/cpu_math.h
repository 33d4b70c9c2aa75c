// Scalar and small-vector helpers shared by the CPU attention kernel: bfloat16 <-> float32,
// and exp / tanh written branch-free so the loops calling them vectorize (no libm calls).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace jaxpaged_cpu {

// Sixteen float32 lanes as a GCC/Clang vector type: one AVX-512 register (two AVX2 ones
// elsewhere; the compiler lowers the arithmetic to whatever the target has). `may_alias` and
// 4-byte alignment let it load from and store to any float pointer.
typedef float v16 __attribute__((vector_size(64), aligned(4), may_alias));
constexpr int kLanes = 16;

inline v16 load16(const float* p) { return *reinterpret_cast<const v16*>(p); }
inline void store16(float* p, v16 x) { *reinterpret_cast<v16*>(p) = x; }

// Two 32-byte halves (AVX2 registers: 8 floats or 8 int32) as one 16-lane vector V.
template <typename V, typename Half>
inline V join_halves(const Half& lo, const Half& hi) {
  static_assert(sizeof(V) == 2 * sizeof(Half), "two halves make one vector");
  V v;
  std::memcpy(&v, &lo, sizeof lo);
  std::memcpy(reinterpret_cast<char*>(&v) + sizeof lo, &hi, sizeof hi);
  return v;
}

// IEEE half -> float (exact; no F16C needed).
inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
  float f;
  if (exponent == 0) {
    f = std::ldexp(static_cast<float>(mantissa), -24);    // zero or subnormal
    uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    u |= sign;
    std::memcpy(&f, &u, sizeof f);
    return f;
  }
  const uint32_t u = sign | (exponent == 31 ? 0x7f800000u | (mantissa << 13)
                                            : ((exponent + 112) << 23) | (mantissa << 13));
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Sixteen float32 values stored as float32 or as float16 (the packed matmul's scales: GGUF's
// own half-precision scales where they are exact in it, jaxpaged.layers.packed_layout).
struct Scales {
  const void* data;
  bool half;

  // Element i's line into L2 (any i: a prefetch never faults).
  void prefetch(int64_t i) const {
    __builtin_prefetch(static_cast<const char*>(data) + i * (half ? 2 : 4), 0, 2);
  }

  v16 at(int64_t i) const {
    if (!half) return load16(static_cast<const float*>(data) + i);
    const uint16_t* p = static_cast<const uint16_t*>(data) + i;
#if defined(__AVX512F__)
    const __m512 v = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    v16 out;
    std::memcpy(&out, &v, sizeof out);
    return out;
#elif defined(__F16C__)
    return join_halves<v16>(
        _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
        _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8))));
#else
    v16 out;
    for (int l = 0; l < kLanes; ++l) out[l] = half_to_float(p[l]);
    return out;
#endif
  }
};

inline float bf16_to_float(uint16_t x) {
  uint32_t u = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even (finite inputs)
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// An IEEE half-precision pool element (a type of its own: bfloat16 elements are uint16_t).
struct Half {
  uint16_t bits;
};

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const uint16_t* p, int64_t i) { return bf16_to_float(p[i]); }
#if defined(__F16C__)
inline float load(const Half* p, int64_t i) { return _cvtsh_ss(p[i].bits); }
#else
inline float load(const Half* p, int64_t i) { return half_to_float(p[i].bits); }
#endif
inline void store(float* p, int64_t i, float x) { p[i] = x; }
inline void store(uint16_t* p, int64_t i, float x) { p[i] = float_to_bf16(x); }
// Softmax weights meet the values in the pool's dtype (as the xla backend's dots do).
inline float round_weight(float p, const float*) { return p; }
inline float round_weight(float p, const uint16_t*) { return bf16_to_float(float_to_bf16(p)); }
// A float16 pool serves float32 queries: the weights stay float32 (the xla backend promotes
// the pool's values to float32 before its dot).
inline float round_weight(float p, const Half*) { return p; }

// exp(x) for x <= 0 (arguments below -87 give ~0): x = n ln2 + r, |r| <= ln2 / 2, 2^n built
// in the exponent bits and e^r by its degree-6 Taylor polynomial (relative error < 2e-7).
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  float n = std::nearbyint(x * 1.44269504088896341f);
  float r = std::fma(n, -0.693145751953125f, x);
  r = std::fma(n, -1.428606765330187045e-06f, r);
  float p = 1.0f / 720;
  p = std::fma(p, r, 1.0f / 120);
  p = std::fma(p, r, 1.0f / 24);
  p = std::fma(p, r, 1.0f / 6);
  p = std::fma(p, r, 0.5f);
  p = std::fma(p, r, 1.0f);
  p = std::fma(p, r, 1.0f);
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// Soft-capping cap * tanh(x / cap), with tanh(y) = sign(y) (1 - e) / (1 + e), e = e^(-2|y|)
// (absolute error ~1e-7 times cap).
inline float soft_cap_score(float x, float cap) {
  const float e = exp_nonpositive(-2.0f * std::fabs(x / cap));
  return std::copysign(cap * (1.0f - e) / (1.0f + e), x);
}

}  // namespace jaxpaged_cpu
