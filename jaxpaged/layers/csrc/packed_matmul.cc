// float32 y = x . W^T with W kept packed in 4 or 8 bits per weight (GGUF projections, as
// jaxpaged.layers.packed_linear lays them out), as an XLA FFI custom call.
//
// Inputs: x [M, K] float32 rows, of which the first `rows` ([] int32, clamped to [0, M]) are
// computed and the rest written as zeros (a bucketed step's padding); blocks, the weight's integers in lanes of 16 output features:
//   4-bit: uint8 [N/16, K/2, 16], byte [b, j, l] = q[16b + l, 2j] | q[16b + l, 2j + 1] << 4;
//   8-bit: int8  [N/16, K, 16],   [b, k, l] = q[16b + l, k];
// scale and min, float32 [N/16, K/G, 16]: the weight is W[n, k] = scale * q + min of n's
// group k / G (G is K over scale's middle dimension: 32, or 16 for Q6_K). Output y [M, N].
//
// For every GGUF block type jaxpaged packs, scale * q is exact in float32 (see
// packed_linear.py), so fma(scale, q, min) is the weight gguf's own dequantization computes,
// bit for bit, and the result equals a float32 matmul with the dequantized weight up to the
// order of the sum over k (in order here, one multiply-add per term).
//
// A register block holds NB vectors of 16 output features for RB rows: each step k dequantizes
// the NB weight vectors once (zero/sign extend, convert, one multiply-add with the group's
// scale and min) and adds them, times the RB broadcast activations x[r, k], into the NB x RB
// accumulators. The weight is read once per RB rows, as stored (0.5 or 1 byte a weight plus
// 8 bytes of scale and min per group and feature): at one row a step reads about a fifth of
// the float32 weight's bytes (4-bit). Interleaving output rows so that one vector load serves
// 16 outputs is the layout of llama.cpp's repacked CPU kernels (ggml-cpu/repack.cpp), here
// with float, not int8, arithmetic, so the activations are not rounded.
//
// Work items are chunks of kChunkVectors vectors of output features (work_items.h).

#pragma GCC optimize("fp-contract=fast")

#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "cpu_math.h"
#include "work_items.h"

namespace ffi = xla::ffi;

namespace jaxpaged_cpu {
namespace {

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
  vi16 v;
  std::memcpy(&v, &lo, sizeof lo);
  std::memcpy(reinterpret_cast<char*>(&v) + sizeof lo, &hi, sizeof hi);
  return v;
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
constexpr int kMaxRows = 4;

struct PackedArgs {
  const float* x;       // [M, K]
  const void* q;        // 4-bit: uint8 [N/16, K/2, 16]; 8-bit: int8 [N/16, K, 16]
  const float* scale;   // [N/16, K/G, 16]
  const float* min;     // [N/16, K/G, 16]
  float* y;             // [M, N]
  int64_t m, k, n, group;
};

inline v16 to_float(vi16 v) { return __builtin_convertvector(v, v16); }

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
        if constexpr (Bits == 4) {
          const vi16 both = widen16<false>(q[j] + k / 2 * kLanes);
          w0 = to_float(both & 15);
          w1 = to_float(both >> 4);
        } else {
          w0 = to_float(widen16<true>(q[j] + k * kLanes));
          w1 = to_float(widen16<true>(q[j] + (k + 1) * kLanes));
        }
#pragma GCC unroll 4
        for (int r = 0; r < RB; ++r) {
          even[j][r] += w0 * x[r][k];
          odd[j][r] += w1 * x[r][k + 1];
        }
      }
    }
    for (int j = 0; j < NB; ++j) {
      const v16 s = load16(a.scale + ((v0 + j) * groups + g) * kLanes);
      const v16 mn = load16(a.min + ((v0 + j) * groups + g) * kLanes);
      for (int r = 0; r < RB; ++r) {
        acc[j][r] += s * (even[j][r] + odd[j][r]);
        acc[j][r] += mn * xsum[(r0 + r) * groups + g];
      }
    }
  }
  for (int j = 0; j < NB; ++j)
    for (int r = 0; r < RB; ++r) store16(a.y + (r0 + r) * a.n + (v0 + j) * kLanes, acc[j][r]);
}

// Feature vectors [v, v_end) of rows [r0, r0 + RB): NB vectors a register block, NB halving
// for the last few.
template <int Bits, int RB, int NB>
void vectors(const PackedArgs& a, const float* xsum, int64_t r0, int64_t v, int64_t v_end) {
  for (; v + NB <= v_end; v += NB) block<Bits, RB, NB>(a, xsum, r0, v);
  if constexpr (NB > 1) vectors<Bits, RB, NB / 2>(a, xsum, r0, v, v_end);
}

// Work item `item`: feature vectors [item * kChunkVectors, +kChunkVectors) of every row,
// kMaxRows rows at a time (one row: four vectors a block; more: two).
template <int Bits>
void packed_item(const PackedArgs& a, const float* xsum, int64_t item) {
  const int64_t v0 = item * kChunkVectors;
  const int64_t v_end = std::min(a.n / kLanes, v0 + kChunkVectors);
  for (int64_t r0 = 0; r0 < a.m; r0 += kMaxRows) {
    switch (std::min<int64_t>(kMaxRows, a.m - r0)) {
      case 4: vectors<Bits, 4, 2>(a, xsum, r0, v0, v_end); break;
      case 3: vectors<Bits, 3, 2>(a, xsum, r0, v0, v_end); break;
      case 2: vectors<Bits, 2, 2>(a, xsum, r0, v0, v_end); break;
      default: vectors<Bits, 1, 4>(a, xsum, r0, v0, v_end); break;
    }
  }
}

template <int Bits>
void launch(ffi::ThreadPool& pool, const PackedArgs& a) {
  const int64_t groups = a.k / a.group;
  auto xsum = std::make_shared<std::vector<float>>(a.m * groups);
  for (int64_t r = 0; r < a.m; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      float total = 0.0f;
      for (int64_t k = g * a.group; k < (g + 1) * a.group; ++k) total += a.x[r * a.k + k];
      (*xsum)[r * groups + g] = total;
    }
  }
  run_items(pool, (a.n / kLanes + kChunkVectors - 1) / kChunkVectors, [a, xsum] {
    return [a, xsum](int64_t i) { packed_item<Bits>(a, xsum->data(), i); };
  });
}

ffi::Error PackedMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                            ffi::Buffer<ffi::S32> rows, ffi::AnyBuffer q,
                            ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::F32> min,
                            ffi::Result<ffi::Buffer<ffi::F32>> y) {
  auto xd = x.dimensions(), qd = q.dimensions(), sd = scale.dimensions(),
       yd = y->dimensions();
  if (xd.size() != 2 || qd.size() != 3 || sd.size() != 3 || yd.size() != 2 ||
      min.dimensions().size() != 3) {
    return ffi::Error::InvalidArgument(
        "expected x [M, K], blocks [N/16, K or K/2, 16], scale and min [N/16, K/G, 16], "
        "y [M, N]");
  }
  const bool four_bit = q.element_type() == ffi::DataType::U8;
  if (!four_bit && q.element_type() != ffi::DataType::S8) {
    return ffi::Error::InvalidArgument("blocks must be uint8 (4-bit) or int8 (8-bit)");
  }
  const int64_t m = xd[0], k = xd[1], n = yd[1], vectors = qd[0];
  if (yd[0] != m || n != vectors * kLanes || qd[2] != kLanes || sd[2] != kLanes ||
      sd[0] != vectors || sd[1] == 0 || k % sd[1] != 0 || qd[1] != (four_bit ? k / 2 : k) ||
      !std::equal(sd.begin(), sd.end(), min.dimensions().begin())) {
    return ffi::Error::InvalidArgument("inconsistent packed matmul shapes");
  }
  if (rows.element_count() != 1) return ffi::Error::InvalidArgument("rows must be a scalar");
  const int64_t valid = std::clamp<int64_t>(rows.typed_data()[0], 0, m);
  std::fill(y->typed_data() + valid * n, y->typed_data() + m * n, 0.0f);
  const PackedArgs a{x.typed_data(), q.untyped_data(), scale.typed_data(), min.typed_data(),
                     y->typed_data(), valid, k, n, k / sd[1]};
  if (four_bit && a.group % 2 != 0) {
    return ffi::Error::InvalidArgument("4-bit groups must hold an even number of weights");
  }
  if (valid == 0 || n == 0) return ffi::Error::Success();
  if (four_bit) {
    launch<4>(pool, a);
  } else {
    launch<8>(pool, a);
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxpaged_cpu

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpagedPackedMatmul, jaxpaged_cpu::PackedMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
