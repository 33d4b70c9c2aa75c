// The packed matmul's float paths (packed_matmul.cc): the weights' integers widened to
// float32 and multiplied by the activations as they are, by register blocks of a few rows
// (the integer path) or, from kPanelMinRows rows on, over a dequantized panel. Every CPU
// takes them; CPUs with AVX-512 VNNI take packed_vnni.h's int8 path below kInt8MaxRows rows.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "cpu_math.h"

namespace jaxpaged_cpu {

typedef int32_t vi16 __attribute__((vector_size(64), aligned(4), may_alias));

// 16 bytes -> 16 int32, zero- or sign-extended (GCC's __builtin_convertvector does this one
// lane at a time, so the x86 extensions are spelled out; other targets take the loop).
template <bool Signed>
inline vi16 widen16(const uint8_t* p) {
#if defined(__AVX512F__)
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m512i w = Signed ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b);
  vi16 v;
  std::memcpy(&v, &w, sizeof v);
  return v;
#elif defined(__AVX2__)
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256i lo = Signed ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b);
  const __m128i high = _mm_unpackhi_epi64(b, b);
  const __m256i hi = Signed ? _mm256_cvtepi8_epi32(high) : _mm256_cvtepu8_epi32(high);
  return join_halves<vi16>(lo, hi);
#else
  vi16 v;
  for (int i = 0; i < kLanes; ++i) {
    v[i] = Signed ? static_cast<int32_t>(static_cast<int8_t>(p[i])) : static_cast<int32_t>(p[i]);
  }
  return v;
#endif
}

// Output vectors (of 16 features) per work item, and the most rows one register block covers.
constexpr int64_t kChunkVectors = 4;
constexpr int64_t kSplitChunkVectors = 2;
constexpr int kMaxRows = 4;

// One weight and where its products go: y[r * ldy + f - col0] for feature f of row r.
struct PackedArgs {
  const float* x;       // [M, K]
  const void* q;        // 4-bit: uint8 [N/16, K/2, 16]; 8-bit: int8 [N/16, K, 16]
  Scales scale;         // [N/16, K/G, 16], float32 or float16
  Scales min;           // [N/16, K/G, 16], float32 or float16
  float* y;
  int64_t m, k, n, group, ldy, col0;
  bool four_bit;
};

inline v16 to_float(vi16 v) { return __builtin_convertvector(v, v16); }

// The integers of inputs k and k + 1 (k even) of one vector of 16 features, as floats.
template <int Bits>
inline void integers(const uint8_t* q, int64_t k, v16& w0, v16& w1) {
  if constexpr (Bits == 4) {
    const vi16 both = widen16<false>(q + k / 2 * kLanes);
    w0 = to_float(both & 15);
    w1 = to_float(both >> 4);
  } else {
    w0 = to_float(widen16<true>(q + k * kLanes));
    w1 = to_float(widen16<true>(q + (k + 1) * kLanes));
  }
}

// Rows [r0, r0 + RB) x features [16 v0, 16 (v0 + NB)) of y. Per group g the integers meet
// the activations first, sum_k q[n, k] x[r, k] in `part` (two partial sums, of even and odd
// k, so that the chains of dependent multiply-adds are short), and the group's scale and
// offset once: acc += scale * part + min * xsum[r, g] (xsum: the group's sum of x[r, k]).
template <int Bits, int RB, int NB>
void block(const PackedArgs& a, const float* xsum, int64_t r0, int64_t v0) {
  v16 acc[NB][RB];
  for (int j = 0; j < NB; ++j)
    for (int r = 0; r < RB; ++r) acc[j][r] = v16{};
  const float* x[RB];
  for (int r = 0; r < RB; ++r) x[r] = a.x + (r0 + r) * a.k;
  const int64_t groups = a.k / a.group;
  const uint8_t* q[NB];
  for (int j = 0; j < NB; ++j) {
    q[j] = static_cast<const uint8_t*>(a.q) + (v0 + j) * (a.k * Bits / 8) * kLanes;
  }
  for (int64_t g = 0; g < groups; ++g) {
    v16 even[NB][RB], odd[NB][RB];
    for (int j = 0; j < NB; ++j)
      for (int r = 0; r < RB; ++r) even[j][r] = odd[j][r] = v16{};
    for (int64_t k = g * a.group; k < (g + 1) * a.group; k += 2) {
#pragma GCC unroll 4
      for (int j = 0; j < NB; ++j) {
        v16 w0, w1;
        integers<Bits>(q[j], k, w0, w1);
#pragma GCC unroll 4
        for (int r = 0; r < RB; ++r) {
          even[j][r] += w0 * x[r][k];
          odd[j][r] += w1 * x[r][k + 1];
        }
      }
    }
    for (int j = 0; j < NB; ++j) {
      const v16 s = a.scale.at(((v0 + j) * groups + g) * kLanes);
      const v16 mn = a.min.at(((v0 + j) * groups + g) * kLanes);
      for (int r = 0; r < RB; ++r) {
        acc[j][r] += s * (even[j][r] + odd[j][r]);
        acc[j][r] += mn * xsum[(r0 + r) * groups + g];
      }
    }
  }
  for (int j = 0; j < NB; ++j)
    for (int r = 0; r < RB; ++r) {
      store16(a.y + (r0 + r) * a.ldy + (v0 + j) * kLanes - a.col0, acc[j][r]);
    }
}

// Feature vectors [v, v_end) of rows [r0, r0 + RB): NB vectors a register block, NB halving
// for the last few.
template <int Bits, int RB, int NB>
void vectors(const PackedArgs& a, const float* xsum, int64_t r0, int64_t v, int64_t v_end) {
  for (; v + NB <= v_end; v += NB) block<Bits, RB, NB>(a, xsum, r0, v);
  if constexpr (NB > 1) vectors<Bits, RB, NB / 2>(a, xsum, r0, v, v_end);
}

// Many rows (kPanelMinRows or more): the chunk's weights, kPanelDepth inputs at a time,
// dequantized once, scale * q + min (the exact weights), into a float32 panel
// [depth][width] (width = the chunk's features; 32 KiB, in L1), then a float register-blocked
// matmul of every RB rows over it, accumulating in y: each panel vector feeds RB
// multiply-adds, where the integer path above re-widens the weights for every RB rows. (From
// 8 rows the panel was faster than the integer path, and 128 inputs a panel faster than 64:
// docs/measurements.md, "Packed matmul kernel".)
constexpr int64_t kPanelMinRows = 8;
constexpr int64_t kPanelRows = 6;
constexpr int64_t kPanelDepth = 128;

template <int Bits>
void dequantize_panel(const PackedArgs& a, int64_t v0, int64_t v_end, int64_t k0, int64_t k1,
                      float* panel) {
  const int64_t groups = a.k / a.group, width = (v_end - v0) * kLanes;
  for (int64_t v = v0; v < v_end; ++v) {
    const uint8_t* q = static_cast<const uint8_t*>(a.q) + v * (a.k * Bits / 8) * kLanes;
    float* column = panel + (v - v0) * kLanes - k0 * width;
    for (int64_t g = k0 / a.group; g < k1 / a.group; ++g) {
      const v16 s = a.scale.at((v * groups + g) * kLanes);
      const v16 mn = a.min.at((v * groups + g) * kLanes);
      for (int64_t k = g * a.group; k < (g + 1) * a.group; k += 2) {
        v16 w0, w1;
        integers<Bits>(q, k, w0, w1);
        store16(column + k * width, w0 * s + mn);
        store16(column + (k + 1) * width, w1 * s + mn);
      }
    }
  }
}

// Rows [r0, r0 + RB) x panel vectors [j0, j0 + NB) (features 16 (v0 + j0) on), inputs
// [k0, k1): y += x . panel (y = on the first panel).
template <int RB, int NB>
void panel_block(const PackedArgs& a, const float* panel, int64_t width, int64_t r0,
                 int64_t v0, int64_t j0, int64_t k0, int64_t k1) {
  float* y[RB];
  for (int r = 0; r < RB; ++r) y[r] = a.y + (r0 + r) * a.ldy + (v0 + j0) * kLanes - a.col0;
  v16 acc[NB][RB];
  for (int j = 0; j < NB; ++j)
    for (int r = 0; r < RB; ++r) acc[j][r] = k0 == 0 ? v16{} : load16(y[r] + j * kLanes);
  const float* x[RB];
  for (int r = 0; r < RB; ++r) x[r] = a.x + (r0 + r) * a.k;
  for (int64_t k = k0; k < k1; ++k) {
    v16 w[NB];
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) w[j] = load16(panel + (k - k0) * width + (j0 + j) * kLanes);
#pragma GCC unroll 8
    for (int r = 0; r < RB; ++r) {
#pragma GCC unroll 4
      for (int j = 0; j < NB; ++j) acc[j][r] += w[j] * x[r][k];
    }
  }
  for (int j = 0; j < NB; ++j)
    for (int r = 0; r < RB; ++r) store16(y[r] + j * kLanes, acc[j][r]);
}

template <int RB, int NB>
void panel_vectors(const PackedArgs& a, const float* panel, int64_t vectors, int64_t r0,
                   int64_t v0, int64_t k0, int64_t k1, int64_t j = 0) {
  for (; j + NB <= vectors; j += NB) {
    panel_block<RB, NB>(a, panel, vectors * kLanes, r0, v0, j, k0, k1);
  }
  if constexpr (NB > 1) panel_vectors<RB, NB / 2>(a, panel, vectors, r0, v0, k0, k1, j);
}

template <int Bits>
void panel_item(const PackedArgs& a, int64_t v0, int64_t v_end) {
  const int64_t vectors = v_end - v0;
  const int64_t depth = std::max(kPanelDepth / a.group, int64_t{1}) * a.group;
  alignas(64) float panel[kPanelDepth * kChunkVectors * kLanes];
  for (int64_t k0 = 0; k0 < a.k; k0 += depth) {
    const int64_t k1 = std::min(a.k, k0 + depth);
    dequantize_panel<Bits>(a, v0, v_end, k0, k1, panel);
    for (int64_t r0 = 0; r0 < a.m; r0 += kPanelRows) {
      switch (std::min<int64_t>(kPanelRows, a.m - r0)) {
        case 6: panel_vectors<6, 4>(a, panel, vectors, r0, v0, k0, k1); break;
        case 5: panel_vectors<5, 4>(a, panel, vectors, r0, v0, k0, k1); break;
        case 4: panel_vectors<4, 4>(a, panel, vectors, r0, v0, k0, k1); break;
        case 3: panel_vectors<3, 4>(a, panel, vectors, r0, v0, k0, k1); break;
        case 2: panel_vectors<2, 4>(a, panel, vectors, r0, v0, k0, k1); break;
        default: panel_vectors<1, 4>(a, panel, vectors, r0, v0, k0, k1); break;
      }
    }
  }
}

// Feature vectors [v0, v_end) of every row: by the integer path, kMaxRows rows at a time
// (one row: four vectors a block; more: two), or from kPanelMinRows rows on by the panel.
template <int Bits>
void packed_item(const PackedArgs& a, const float* xsum, int64_t v0, int64_t v_end) {
  if (a.m >= kPanelMinRows) {
    panel_item<Bits>(a, v0, v_end);
    return;
  }
  for (int64_t r0 = 0; r0 < a.m; r0 += kMaxRows) {
    switch (std::min<int64_t>(kMaxRows, a.m - r0)) {
      case 4: vectors<Bits, 4, 2>(a, xsum, r0, v0, v_end); break;
      case 3: vectors<Bits, 3, 2>(a, xsum, r0, v0, v_end); break;
      case 2: vectors<Bits, 2, 2>(a, xsum, r0, v0, v_end); break;
      default: vectors<Bits, 1, 4>(a, xsum, r0, v0, v_end); break;
    }
  }
}

}  // namespace jaxpaged_cpu
