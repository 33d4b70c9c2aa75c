// The packed matmul's integer path on CPUs with AVX-512 VNNI and VBMI (Intel Ice Lake and
// later, AMD Zen 4 and later): the weights' integers meet the activations in int8 dot
// products (vpdpbusd: 64 multiply-adds of unsigned by signed bytes into 16 int32 lanes),
// llama.cpp's approach for its CPU backend (ggml-cpu's quantized dot products with per-block
// scales), here with the activations kept to ~16 bits instead of 8.
//
// Activations, split. Row r's group g (the weight's G inputs) has step e = amax / (127 * 2^16)
// (amax = max |x| over the group), and x / e rounded to an integer T = 2^16 h + 2^8 m + l, the
// balanced base-256 digits h in [-127, 127] and m, l in [-128, 127]: a 24-bit fixed-point
// number per group, |x - e T| <= e / 2 = amax / 2^24.6, float32's own precision at amax (a
// single int8, llama.cpp's Q8_0 activations, errs by amax / 254; two digits were far above
// float32's error on SmolLM2's logits: docs/measurements.md, "Packed matmul kernel"). Each weight vector meets h, m and l in one
// vpdpbusd each, and per group the three int32 sums (|.| < 2^21) are scaled once:
//   y += (scale * e) * (2^16 H + (2^8 M + L)) + (min + c scale) * xsum,
//   H = sum_h - bias * sum(h) (likewise M, L), the parentheses in int32, then float32,
// (xsum: the group's float sum of x): the integers meet the split activations centred, as
// q - c, so that the activations' rounding meets weights of the size of W itself, and the
// offset meets the exact activations. 4-bit q in [0, 15]: bias = c = 8; 8-bit q, stored
// signed, are read as q + 128 (vpdpbusd multiplies unsigned weights by signed activations):
// bias 128, c = 0.
//
// The weights stay in the layout every path reads (packed_linear.py): 64 bytes of blocks
// hold 4 rows of 16 features (bytes [j][l]); one vpermb turns them into 16 lanes of 4 bytes
// (lane l: feature l's bytes j0..j0+3), the dword lanes vpdpbusd sums. For 4 bits each byte
// holds inputs 2j (low nibble) and 2j + 1 (high), so the low nibbles of a load are inputs
// k0, k0+2, k0+4, k0+6 and the high ones k0+1, ..., k0+7; the split activations are stored
// in that order ("quads": 4 activations that meet one dword of weights).
#pragma once

#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__) && defined(__AVX512BW__)
#define JAXPAGED_PACKED_VNNI 1

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "cpu_math.h"

namespace jaxpaged_cpu {

// An array of n elements left uninitialized: split_row writes every element before any is
// read (zero-filling the split of every call was ~2% of a 16-row decode step's samples).
template <typename T>
class Uninitialized {
 public:
  explicit Uninitialized(int64_t n = 0) : data_(n > 0 ? new T[n] : nullptr) {}
  T* data() { return data_.get(); }
  const T* data() const { return data_.get(); }
  T& operator[](int64_t i) { return data_[i]; }
  const T& operator[](int64_t i) const { return data_[i]; }

 private:
  std::unique_ptr<T[]> data_;
};

// One call's activations, split per weight group (see the header comment).
struct SplitRows {
  int64_t k = 0, group = 0;
  Uninitialized<int32_t> quads;  // [M][K / 4][3]: per quad its 4 h, 4 m and 4 l bytes
  Uninitialized<float> step;     // [M][K / G]: e
  Uninitialized<int32_t> sums;   // [M][K / G][2]: the group's sums of h and of 2^8 m + l
};

// Whether weights of this shape take the integer path: G a multiple of 8 (4-bit: whole 64-byte
// loads of 8 inputs) or of 4 (8-bit), and at most 32 (int32 range above).
inline bool vnni_shape(int64_t group, bool four_bit) {
  return group <= 32 && group % (four_bit ? 8 : 4) == 0;
}

// Input index (within 16) of byte o of the 48 that 16 split inputs fill: 4 quads of 12 bytes
// (4 h, 4 m, 4 l), in the order of 4-bit (nibble-paired) or 8-bit (consecutive) weights.
inline int64_t quad_input(int64_t o, bool four_bit) {
  const int64_t quad = o / 12, b = o % 4;
  return four_bit ? (quad / 2) * 8 + (quad % 2) + 2 * b : 4 * quad + b;
}

// One row's split where the group is a multiple of 16 inputs, 16 at a time: the scalar
// split's arithmetic on 16 lanes (round to nearest even, the same clamp and digits), the 48
// bytes of 4 quads placed by one vpermb. Equal bit for bit to the scalar split (tested).
inline void split_row_16(const float* xr, int64_t k, int64_t group, bool four_bit,
                         int8_t* out, float* step, int32_t* sums) {
  alignas(64) uint8_t idx[64] = {};
  for (int64_t o = 0; o < 48; ++o) {
    idx[o] = static_cast<uint8_t>(16 * ((o % 12) / 4) + quad_input(o, four_bit));
  }
  const __m512i place = _mm512_load_si512(idx);
  const __m512i limit = _mm512_set1_epi32(127 * 65536), half = _mm512_set1_epi32(128);
  const __m512i low_byte = _mm512_set1_epi32(255);
  for (int64_t g = 0; g < k / group; ++g) {
    const float* xg = xr + g * group;
    __m512 amax = _mm512_setzero_ps();
    for (int64_t i = 0; i < group; i += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_loadu_ps(xg + i)));
    const float e = _mm512_reduce_max_ps(amax) / (127.0f * 65536.0f);
    const __m512 inv = _mm512_set1_ps(e > 0.0f ? 1.0f / e : 0.0f);
    __m512i sum_h = _mm512_setzero_si512(), sum_ml = _mm512_setzero_si512();
    for (int64_t i = 0; i < group; i += 16) {
      __m512i t = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xg + i), inv));
      t = _mm512_max_epi32(_mm512_min_epi32(t, limit), _mm512_sub_epi32(_mm512_setzero_si512(), limit));
      const __m512i l = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(t, half), low_byte), half);
      t = _mm512_srai_epi32(_mm512_sub_epi32(t, l), 8);
      const __m512i mid = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(t, half), low_byte), half);
      const __m512i h = _mm512_srai_epi32(_mm512_sub_epi32(t, mid), 8);
      sum_h = _mm512_add_epi32(sum_h, h);
      sum_ml = _mm512_add_epi32(sum_ml, _mm512_add_epi32(_mm512_slli_epi32(mid, 8), l));
      __m512i bytes = _mm512_castsi128_si512(_mm512_cvtepi32_epi8(h));
      bytes = _mm512_inserti32x4(bytes, _mm512_cvtepi32_epi8(mid), 1);
      bytes = _mm512_inserti32x4(bytes, _mm512_cvtepi32_epi8(l), 2);
      _mm512_mask_storeu_epi8(out + (g * group + i) * 3, 0xFFFFFFFFFFFFull,
                              _mm512_permutexvar_epi8(place, bytes));
    }
    step[g] = e;
    sums[2 * g] = _mm512_reduce_add_epi32(sum_h);
    sums[2 * g + 1] = _mm512_reduce_add_epi32(sum_ml);
  }
}

// Room for the split of m rows of k inputs in groups of `group` (filled by split_row).
inline SplitRows split_storage(int64_t m, int64_t k, int64_t group) {
  SplitRows s;
  s.k = k;
  s.group = group;
  s.quads = Uninitialized<int32_t>(m * (k / 4) * 3);
  s.step = Uninitialized<float>(m * (k / group));
  s.sums = Uninitialized<int32_t>(m * (k / group) * 2);
  return s;
}

// Splits row r (xr: its k inputs) into `s` (split_storage), quads in the order of 4-bit
// (nibble-paired) or 8-bit (consecutive) weights. Rows are independent: any thread may
// split any row.
inline void split_row(const float* xr, int64_t r, bool four_bit, SplitRows& s) {
  const int64_t k = s.k, group = s.group, groups = k / group;
  int8_t* out = reinterpret_cast<int8_t*>(s.quads.data() + r * (k / 4) * 3);
  if (group % 16 == 0) {
    split_row_16(xr, k, group, four_bit, out, s.step.data() + r * groups,
                 s.sums.data() + r * groups * 2);
    return;
  }
  std::vector<int8_t> digits(3 * k);  // [3][k]: h, m, l
  for (int64_t g = 0; g < groups; ++g) {
    float amax = 0.0f;
    for (int64_t i = g * group; i < (g + 1) * group; ++i) amax = std::max(amax, std::fabs(xr[i]));
    const float e = amax / (127.0f * 65536.0f);
    const float inv = e > 0.0f ? 1.0f / e : 0.0f;
    int32_t* sums = s.sums.data() + (r * groups + g) * 2;
    sums[0] = sums[1] = 0;
    for (int64_t i = g * group; i < (g + 1) * group; ++i) {
      int32_t t = static_cast<int32_t>(std::nearbyint(xr[i] * inv));
      t = std::clamp(t, -127 * 65536, 127 * 65536);
      for (int d = 2; d >= 0; --d) {         // l, then m, then h: t = 256 t' + digit
        const int32_t digit = d == 0 ? t : ((t + 128) & 255) - 128;
        digits[d * k + i] = static_cast<int8_t>(digit);
        sums[d == 0 ? 0 : 1] += d == 1 ? 256 * digit : digit;
        t = (t - digit) / 256;
      }
    }
    s.step[r * groups + g] = e;
  }
  for (int64_t q = 0; q < k / 4; ++q) {
    for (int b = 0; b < 4; ++b) {
      // 4 bits: quad 2o is inputs 8o + {0, 2, 4, 6}, quad 2o + 1 is 8o + {1, 3, 5, 7}.
      const int64_t i = (q / 4) * 16 + quad_input((q % 4) * 12 + b, four_bit);
      for (int d = 0; d < 3; ++d) out[q * 12 + 4 * d + b] = digits[d * k + i];
    }
  }
}

// acc += w (unsigned bytes) . the 4 signed bytes at p, broadcast to every lane: vpdpbusd with
// an embedded-broadcast memory operand (GCC 12 otherwise emits a vpbroadcastd per call).
inline __m512i dpbusd_broadcast(__m512i acc, __m512i w, const int32_t* p) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*p));
  return acc;
}

// vpermb indices: output byte 4 l + j <- input byte 16 j + l (4 rows of 16 lanes -> 16 lanes
// of 4 bytes).
inline __m512i lane_transpose() {
  alignas(64) uint8_t idx[64];
  for (int o = 0; o < 64; ++o) idx[o] = static_cast<uint8_t>((o % 4) * 16 + o / 4);
  return _mm512_load_si512(idx);
}

// How far ahead of its loads a block of fewer than 4 rows fetches each feature vector's
// weights into L2, in bytes of that vector's blocks, and its scales and mins, in groups. A
// work item reads a few columns of a few KiB each (a feature vector's blocks over K), too
// short for the hardware prefetcher to get ahead: at one row the loads waited on memory
// (perf annotate). Blocks of 4 rows do 4 times the arithmetic per byte and wait on it, not
// on memory; they fetch nothing ahead.
constexpr int64_t kWeightsAhead = 1024;
constexpr int64_t kScalesAhead = 4;

// Rows [r0, r0 + RB) x feature vectors [v0, v0 + NB) of y = x . W^T, x split in `s`.
// Bits 4: blocks uint8 [N/16, K/2, 16]; 8: int8 [N/16, K, 16]. y row stride ldy, first
// column col0 (as PackedArgs).
template <int Bits, int RB, int NB>
void vnni_block(const uint8_t* blocks, const Scales& scale, const Scales& min, const SplitRows& s,
                const float* xsum, float* y, int64_t ldy, int64_t col0, int64_t r0, int64_t v0) {
  // What the integers read minus their centre: 4-bit q - 8 in [-8, 7]; 8-bit (q + 128) - 128.
  constexpr int32_t kBias = Bits == 4 ? 8 : 128;
  const int64_t k = s.k, group = s.group, groups = k / group;
  const int64_t column = k * Bits / 8 * 16;        // bytes of one feature vector's blocks
  const __m512i perm = lane_transpose();
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 acc[NB][RB];
  for (int j = 0; j < NB; ++j)
    for (int r = 0; r < RB; ++r) acc[j][r] = _mm512_setzero_ps();
  const int32_t* quads[RB];
  for (int r = 0; r < RB; ++r) quads[r] = s.quads.data() + (r0 + r) * (k / 4) * 3;
  for (int64_t g = 0; g < groups; ++g) {
    for (int j = 0; RB < 4 && j < NB; ++j) {  // the scales and mins kScalesAhead groups on
      scale.prefetch(((v0 + j) * groups + g + kScalesAhead) * 16);
      min.prefetch(((v0 + j) * groups + g + kScalesAhead) * 16);
    }
    __m512i sum[NB][RB][3];                   // per digit: h, m, l
    for (int j = 0; j < NB; ++j)
      for (int r = 0; r < RB; ++r)
        for (int d = 0; d < 3; ++d) sum[j][r][d] = _mm512_setzero_si512();
    if constexpr (Bits == 4) {
      for (int64_t k0 = g * group; k0 < (g + 1) * group; k0 += 8) {
#pragma GCC unroll 4
        for (int j = 0; j < NB; ++j) {
          const uint8_t* at = blocks + (v0 + j) * column + k0 / 2 * 16;
          if constexpr (RB < 4) {
            _mm_prefetch(reinterpret_cast<const char*>(at + kWeightsAhead), _MM_HINT_T1);
          }
          const __m512i raw = _mm512_loadu_si512(at);
          const __m512i w = _mm512_permutexvar_epi8(perm, raw);
          const __m512i even = _mm512_and_si512(w, nibble);
          const __m512i odd = _mm512_and_si512(_mm512_srli_epi16(w, 4), nibble);
#pragma GCC unroll 8
          for (int r = 0; r < RB; ++r) {
            const int32_t* qd = quads[r] + k0 / 4 * 3;   // quads k0/4 (even), k0/4 + 1 (odd)
#pragma GCC unroll 3
            for (int d = 0; d < 3; ++d) {
              sum[j][r][d] = dpbusd_broadcast(sum[j][r][d], even, qd + d);
              sum[j][r][d] = dpbusd_broadcast(sum[j][r][d], odd, qd + 3 + d);
            }
          }
        }
      }
    } else {
      for (int64_t k0 = g * group; k0 < (g + 1) * group; k0 += 4) {
#pragma GCC unroll 4
        for (int j = 0; j < NB; ++j) {
          const uint8_t* at = blocks + (v0 + j) * column + k0 * 16;
          if constexpr (RB < 4) {
            _mm_prefetch(reinterpret_cast<const char*>(at + kWeightsAhead), _MM_HINT_T1);
          }
          const __m512i raw = _mm512_loadu_si512(at);
          const __m512i w = _mm512_xor_si512(_mm512_permutexvar_epi8(perm, raw), flip);
#pragma GCC unroll 8
          for (int r = 0; r < RB; ++r) {
            const int32_t* qd = quads[r] + k0 / 4 * 3;
#pragma GCC unroll 3
            for (int d = 0; d < 3; ++d) {
              sum[j][r][d] = dpbusd_broadcast(sum[j][r][d], w, qd + d);
            }
          }
        }
      }
    }
    for (int j = 0; j < NB; ++j) {
      const __m512 sc = scale.at(((v0 + j) * groups + g) * 16);
      // The offset of the centred integers: min + 8 scale for 4 bits (q - 8), min for 8.
      const __m512 mn = _mm512_fmadd_ps(sc, _mm512_set1_ps(Bits == 4 ? 8.0f : 0.0f),
                                        min.at(((v0 + j) * groups + g) * 16));
      for (int r = 0; r < RB; ++r) {
        const int64_t rg = (r0 + r) * groups + g;
        // H = sum_h - bias * sum(h) and 2^8 M + L (|.| < 2^29 for G <= 32) in int32, then
        // 2^16 H + (2^8 M + L) in float32.
        const int32_t* digit_sums = s.sums.data() + rg * 2;
        const __m512i high =
            _mm512_sub_epi32(sum[j][r][0], _mm512_set1_epi32(kBias * digit_sums[0]));
        const __m512i low = _mm512_sub_epi32(
            _mm512_add_epi32(_mm512_slli_epi32(sum[j][r][1], 8), sum[j][r][2]),
            _mm512_set1_epi32(kBias * digit_sums[1]));
        const __m512 total = _mm512_fmadd_ps(_mm512_cvtepi32_ps(high), _mm512_set1_ps(65536.0f),
                                             _mm512_cvtepi32_ps(low));
        const __m512 se = _mm512_mul_ps(sc, _mm512_set1_ps(s.step[rg]));
        acc[j][r] = _mm512_fmadd_ps(se, total, acc[j][r]);
        acc[j][r] = _mm512_fmadd_ps(mn, _mm512_set1_ps(xsum[rg]), acc[j][r]);
      }
    }
  }
  for (int j = 0; j < NB; ++j)
    for (int r = 0; r < RB; ++r) {
      _mm512_storeu_ps(y + (r0 + r) * ldy + (v0 + j) * 16 - col0, acc[j][r]);
    }
}

// Feature vectors [v, v_end) of rows [r0, r0 + RB): NB vectors a block, halving for the rest.
template <int Bits, int RB, int NB>
void vnni_vectors(const uint8_t* blocks, const Scales& scale, const Scales& min,
                  const SplitRows& s, const float* xsum, float* y, int64_t ldy, int64_t col0,
                  int64_t r0, int64_t v, int64_t v_end) {
  for (; v + NB <= v_end; v += NB) {
    vnni_block<Bits, RB, NB>(blocks, scale, min, s, xsum, y, ldy, col0, r0, v);
  }
  if constexpr (NB > 1) {
    vnni_vectors<Bits, RB, NB / 2>(blocks, scale, min, s, xsum, y, ldy, col0, r0, v, v_end);
  }
}

// Every row [0, m) of feature vectors [v0, v_end): 4 rows at a time with 1 vector a block,
// then 2 rows with 2, a last single row with 4 (accumulators: 4 per vector and row, within 32
// registers); 4 rows a block were faster than 2, and 3 rows with 2 vectors spill
// (docs/measurements.md, "Packed matmul kernel").
template <int Bits>
void vnni_rows(const uint8_t* blocks, const Scales& scale, const Scales& min, const SplitRows& s,
               const float* xsum, float* y, int64_t ldy, int64_t col0, int64_t m, int64_t v0,
               int64_t v_end) {
  int64_t r0 = 0;
  for (; r0 + 4 <= m; r0 += 4) {
    vnni_vectors<Bits, 4, 1>(blocks, scale, min, s, xsum, y, ldy, col0, r0, v0, v_end);
  }
  for (; r0 + 2 <= m; r0 += 2) {
    vnni_vectors<Bits, 2, 2>(blocks, scale, min, s, xsum, y, ldy, col0, r0, v0, v_end);
  }
  if (r0 < m) vnni_vectors<Bits, 1, 4>(blocks, scale, min, s, xsum, y, ldy, col0, r0, v0, v_end);
}

}  // namespace jaxpaged_cpu

#else

namespace jaxpaged_cpu {
struct SplitRows {};  // never made: the float paths serve every call
}  // namespace jaxpaged_cpu

#endif
