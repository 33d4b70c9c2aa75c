// float32 y_p = x . W_p^T for P weights W_p kept packed in 4 or 8 bits per weight (GGUF
// projections, as jaxpaged.layers.packed_linear lays them out), as one XLA FFI custom call,
// with what a decoder layer does around its projections folded in (each would otherwise be
// an XLA operation of its own, each a fixed cost on XLA:CPU at one row: docs/measurements.md,
// "Packed matmul kernel"):
//   norm      x is first RMS-normalized, x * rsqrt(mean(x^2) + eps) * norm (transformers'
//             LlamaRMSNorm in float32), when `norm` has K elements (none when it is empty);
//   residual  y_0 += residual, when `residual` is [M, N_0] (P = 1);
//   gated     one output silu(y_0) * y_1 (a SwiGLU feed-forward's gate and up, P = 2);
//   rope      the first rope_outputs outputs (a layer's q and k) rotated by RoPE at
//             `positions` [M] int32 with frequencies `inv_freq` [D/2] float32, per head of D.
//
// Inputs: x [M, K] float32 rows, of which the first `rows` ([] int32, clamped to [0, M]) are
// computed and the rest written as zeros (a bucketed step's padding); norm, residual,
// positions and inv_freq (each empty where its operation is not wanted); then per weight
// (remaining arguments, three each) blocks, the weight's integers in lanes of 16 output features:
//   4-bit: uint8 [N/16, K/2, 16], byte [b, j, l] = q[16b + l, 2j] | q[16b + l, 2j + 1] << 4;
//   8-bit: int8  [N/16, K, 16],   [b, k, l] = q[16b + l, k];
// scale and min, float32 or float16 (both alike) [N/16, K/G, 16]: the weight is
// W[n, k] = scale * q + min of n's group k / G (G is K over scale's middle dimension: 32, or 16
// for Q6_K). Outputs y_p [M, N_p] (one output [M, N_0] when gated). Any of the three arrays
// of a weight, and the norm, may instead be stacked over the decoder's layers ([L, ...]):
// the call reads its row `layer` (attribute) in place (jaxpaged.layers.layer_stack: a step
// with one argument per stack instead of one per layer).
//
// On CPUs with AVX-512 VNNI and VBMI, calls of fewer than kInt8MaxRows rows multiply the
// integers by the activations split into three bytes in int8 dot products (packed_vnni.h),
// unless the attribute int8 is 0 (then the float paths serve, as on other CPUs).
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
// Work items are chunks of output feature vectors of one weight (of the gate and the up
// weight together when gated), over every weight (work_items.h): kChunkVectors vectors, or
// kSplitChunkVectors on the int8 path at several rows. Before them, prepare_rows readies
// each row (norm, group sums, split) over the same pool.

#pragma GCC optimize("fp-contract=fast")

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <vector>

#include "cpu_math.h"
#include "packed_float.h"
#include "packed_vnni.h"
#include "work_items.h"

namespace ffi = xla::ffi;

namespace jaxpaged_cpu {
namespace {

// Feature vectors [v0, v_end) of weight `a` for every row into its destination: by int8 dot
// products where `split` holds the split activations (packed_vnni.h), else in float32.
void project_chunk(const PackedArgs& a, const float* xsum, const SplitRows* split, int64_t v0,
                   int64_t v_end) {
#ifdef JAXPAGED_PACKED_VNNI
  if (split != nullptr) {
    const auto* q = static_cast<const uint8_t*>(a.q);
    if (a.four_bit) {
      vnni_rows<4>(q, a.scale, a.min, *split, xsum, a.y, a.ldy, a.col0, a.m, v0, v_end);
    } else {
      vnni_rows<8>(q, a.scale, a.min, *split, xsum, a.y, a.ldy, a.col0, a.m, v0, v_end);
    }
    return;
  }
#endif
  if (a.four_bit) {
    packed_item<4>(a, xsum, v0, v_end);
  } else {
    packed_item<8>(a, xsum, v0, v_end);
  }
}

// Per group of G inputs, the sum of one row's x over it (sums: K/G floats).
void group_sums_row(const float* x, int64_t k, int64_t group, float* sums) {
  for (int64_t g = 0; g < k / group; ++g) {
    const float* xg = x + g * group;
    float total = 0.0f;
#pragma omp simd reduction(+ : total)
    for (int64_t i = 0; i < group; ++i) total += xg[i];
    sums[g] = total;
  }
}

// One row of x * rsqrt(mean(x^2) + eps) * weight (float32) into out.
void rms_normalize_row(const float* x, int64_t k, const float* weight, float eps, float* out) {
  float square = 0.0f;
  for (int64_t i = 0; i < k; ++i) square += x[i] * x[i];
  const float inv = 1.0f / std::sqrt(square / static_cast<float>(k) + eps);
  for (int64_t i = 0; i < k; ++i) out[i] = weight[i] * (x[i] * inv);
}

// silu(y) u = y sigmoid(y) u, the sigmoid from exp(-|y|) (cpu_math.h's branch-free exp, which
// never overflows here): the loop over a chunk's features vectorizes, where std::exp was a
// libm call per value (at 16 rows, SmolLM2's 30 feed-forwards made 737k calls a step).
inline float silu_times(float y, float u) {
  const float e = exp_nonpositive(-std::fabs(y));
  return y * ((y >= 0.0f ? 1.0f : e) / (1.0f + e)) * u;
}

struct Call {
  std::vector<PackedArgs> weights;
  std::vector<std::shared_ptr<std::vector<float>>> xsums;  // per weight [M, K/G] (shared
                                                           // by weights of one group size)
  std::vector<int64_t> chunk;              // per weight: output vectors a work item
  std::vector<std::shared_ptr<SplitRows>> splits;  // per weight; null: the float paths
  std::vector<int64_t> first_item;         // weight p's items start here (P + 1 entries)
  const float* residual = nullptr;         // [M, N_0]
  bool gated = false;
};

// Work item i: a chunk of one weight (gated: of the gate, then the same chunk of the up
// weight into `scratch`, and their silu product into the output).
void run_item(const Call& c, int64_t i, std::vector<float>& scratch) {
  const int64_t p = std::upper_bound(c.first_item.begin(), c.first_item.end(), i) -
                    c.first_item.begin() - 1;
  const PackedArgs& a = c.weights[p];
  const int64_t v0 = (i - c.first_item[p]) * c.chunk[p];
  const int64_t v_end = std::min(a.n / kLanes, v0 + c.chunk[p]);
  project_chunk(a, c.xsums[p]->data(), c.splits[p].get(), v0, v_end);
  const int64_t f0 = v0 * kLanes, f1 = v_end * kLanes;
  if (c.gated) {
    PackedArgs up = c.weights[1];
    up.y = scratch.data();
    up.ldy = kChunkVectors * kLanes;
    up.col0 = f0;
    project_chunk(up, c.xsums[1]->data(), c.splits[1].get(), v0, v_end);
    for (int64_t r = 0; r < a.m; ++r) {
      float* y = a.y + r * a.ldy + f0;
      const float* u = scratch.data() + r * up.ldy;
#pragma omp simd
      for (int64_t f = 0; f < f1 - f0; ++f) y[f] = silu_times(y[f], u[f]);
    }
  } else if (c.residual != nullptr) {
    for (int64_t r = 0; r < a.m; ++r) {
      for (int64_t f = f0; f < f1; ++f) a.y[r * a.ldy + f] += c.residual[r * a.n + f];
    }
  }
}

// Calls of fewer rows than this take the int8 path where the CPU has it: below it the int8
// path was faster than the float panel, and at 128 rows the panel's one multiply-add per
// weight and row caught up with three dot products per 4 (docs/measurements.md, "Packed
// matmul kernel").
constexpr int64_t kInt8MaxRows = 128;

// Room for the split activations of a weight of groups of `group` inputs (shared with an
// earlier weight of the same call that needs the same; filled by prepare_rows), or null
// where the float paths serve.
std::shared_ptr<SplitRows> split_for(const Call& c, int64_t m, int64_t k, int64_t group,
                                     bool four_bit) {
#ifdef JAXPAGED_PACKED_VNNI
  if (m >= kInt8MaxRows || !vnni_shape(group, four_bit)) return nullptr;
  for (size_t p = 0; p < c.splits.size(); ++p) {
    if (c.splits[p] && c.weights[p].group == group && c.weights[p].four_bit == four_bit) {
      return c.splits[p];
    }
  }
  return std::make_shared<SplitRows>(split_storage(m, k, group));
#else
  return nullptr;
#endif
}

// Room for the group sums of a weight of groups of `group` inputs (shared with an earlier
// weight of the same call that has the same groups; filled by prepare_rows).
std::shared_ptr<std::vector<float>> xsums_for(const Call& c, int64_t m, int64_t k,
                                              int64_t group) {
  for (size_t p = 0; p < c.xsums.size(); ++p) {
    if (c.weights[p].group == group) return c.xsums[p];
  }
  return std::make_shared<std::vector<float>>(m * (k / group));
}

// Rows from this many on prepare in parallel (below, a handoff costs more than the rows).
constexpr int64_t kParallelPrepareRows = 4;

// What the call's weights read of each row, before any product: the row RMS-normalized (into
// `normalized`, when `norm` is set), its group sums and its split (once per distinct group
// and layout). Rows are independent, so from kParallelPrepareRows rows on they are spread
// over the pool (the split alone was ~1.2 ms of one core a step at 16 rows for SmolLM2,
// docs/measurements.md, "Packed matmul kernel").
void prepare_rows(ffi::ThreadPool& pool, const std::shared_ptr<Call>& shared, const float* x,
                  const float* norm, float eps, float* normalized, int64_t m, int64_t k) {
  auto row = [shared, x, norm, eps, normalized, k](int64_t r) {
    const Call& c = *shared;
    const float* xr = x + r * k;
    if (norm != nullptr) {
      rms_normalize_row(xr, k, norm, eps, normalized + r * k);
      xr = normalized + r * k;
    }
    for (size_t p = 0; p < c.weights.size(); ++p) {      // each shared array once
      if (std::find(c.xsums.begin(), c.xsums.begin() + p, c.xsums[p]) == c.xsums.begin() + p) {
        const int64_t groups = k / c.weights[p].group;
        group_sums_row(xr, k, c.weights[p].group, c.xsums[p]->data() + r * groups);
      }
#ifdef JAXPAGED_PACKED_VNNI
      if (c.splits[p] &&
          std::find(c.splits.begin(), c.splits.begin() + p, c.splits[p]) == c.splits.begin() + p) {
        split_row(xr, r, c.weights[p].four_bit, *c.splits[p]);
      }
#endif
    }
  };
  if (m < kParallelPrepareRows) {
    for (int64_t r = 0; r < m; ++r) row(r);
    return;
  }
  run_items(pool, m, [row] { return row; });
}

// The angles of rows [0, m) for RoPE: cos and sin [m, half] of float(position) * inv_freq[i]
// (float32, as jaxpaged.layers.rotary.apply_rope). Every layer of a step rotates at the same
// positions with the same frequencies, so the last call's angles are kept (per thread) and
// reused when both are equal: one step computes them once, not once a layer (2 * m * half
// libm calls each: ~1k at 16 rows for SmolLM2).
struct RopeAngles {
  std::vector<int32_t> positions;
  std::vector<float> inv_freq, cos, sin;

  static const RopeAngles& of(int64_t m, const int32_t* positions, const float* inv_freq,
                              int64_t half) {
    thread_local RopeAngles last;
    if (static_cast<int64_t>(last.positions.size()) != m ||
        static_cast<int64_t>(last.inv_freq.size()) != half ||
        !std::equal(positions, positions + m, last.positions.begin()) ||
        !std::equal(inv_freq, inv_freq + half, last.inv_freq.begin())) {
      last.positions.assign(positions, positions + m);
      last.inv_freq.assign(inv_freq, inv_freq + half);
      last.cos.resize(m * half);
      last.sin.resize(m * half);
      for (int64_t r = 0; r < m; ++r) {
        for (int64_t i = 0; i < half; ++i) {
          const float angle = static_cast<float>(positions[r]) * inv_freq[i];
          last.cos[r * half + i] = std::cos(angle);
          last.sin[r * half + i] = std::sin(angle);
        }
      }
    }
    return last;
  }
};

// Rotary position embedding of rows [0, m) of y [m, n], in place: each whole head of D = 2
// half features (features [hD, (h + 1) D)) rotated as transformers' rotate-half Llama does,
// y1' = y1 cos - y2 sin, y2' = y2 cos + y1 sin, for the pair (i, i + D/2).
void rotate(float* y, int64_t m, int64_t n, const RopeAngles& angles, int64_t half) {
  for (int64_t r = 0; r < m; ++r) {
    const float* cos = angles.cos.data() + r * half;
    const float* sin = angles.sin.data() + r * half;
    for (int64_t h = 0; h + 2 * half <= n; h += 2 * half) {
      float* a = y + r * n + h;
      for (int64_t i = 0; i < half; ++i) {
        const float x1 = a[i], x2 = a[i + half];
        a[i] = x1 * cos[i] - x2 * sin[i];
        a[i + half] = x2 * cos[i] + x1 * sin[i];
      }
    }
  }
}

// One layer's part of a packed array: the array itself (`dims` its own), or for one stacked
// over the decoder's layers ([L, ...dims]) its row `layer` (data null: no such row).
struct Layer {
  const void* data;
  std::vector<int64_t> dims;
};

Layer layer_of(const ffi::AnyBuffer& a, int32_t layer) {
  auto d = a.dimensions();
  if (d.size() != 4) return {a.untyped_data(), std::vector<int64_t>(d.begin(), d.end())};
  if (layer < 0 || layer >= d[0]) return {nullptr, {}};
  std::vector<int64_t> dims(d.begin() + 1, d.end());
  const int64_t bytes = a.size_bytes() / d[0];
  return {static_cast<const char*>(a.untyped_data()) + layer * bytes, dims};
}

ffi::Error PackedProjectionsImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                                 ffi::Buffer<ffi::S32> rows, ffi::Buffer<ffi::F32> norm,
                                 ffi::Buffer<ffi::F32> residual,
                                 ffi::Buffer<ffi::S32> positions,
                                 ffi::Buffer<ffi::F32> inv_freq, ffi::RemainingArgs args,
                                 ffi::RemainingRets rets, float eps, int32_t gated,
                                 int32_t int8, int32_t rope_outputs, int32_t layer) {
  auto xd = x.dimensions();
  if (xd.size() != 2 || rows.element_count() != 1 || args.size() == 0 ||
      args.size() % 3 != 0) {
    return ffi::Error::InvalidArgument(
        "expected x [M, K], rows [], norm, residual, then blocks, scale, min per weight");
  }
  const int64_t m = xd[0], k = xd[1], num_weights = args.size() / 3;
  // A norm [L, K] stacked over the decoder's layers: this call's is row `layer`.
  const float* norm_weight = norm.typed_data();
  int64_t norm_size = norm.element_count();
  if (norm.dimensions().size() == 2 && norm_size != 0) {
    if (layer < 0 || layer >= norm.dimensions()[0]) {
      return ffi::Error::InvalidArgument("a stacked norm needs its layer");
    }
    norm_size = norm.dimensions()[1];
    norm_weight += layer * norm_size;
  }
  if ((norm_size != 0 && norm_size != k) ||
      rets.size() != (gated ? 1 : static_cast<size_t>(num_weights)) ||
      (gated && num_weights != 2) ||
      (residual.element_count() != 0 && (num_weights != 1 || gated))) {
    return ffi::Error::InvalidArgument("inconsistent norm, residual, gated and outputs");
  }
  if (rope_outputs < 0 || rope_outputs > (gated ? 0 : num_weights) ||
      (rope_outputs > 0 && (positions.element_count() != m || inv_freq.element_count() == 0))) {
    return ffi::Error::InvalidArgument("rope: positions [M] and inv_freq [D/2] for its outputs");
  }
  const int64_t valid = std::clamp<int64_t>(rows.typed_data()[0], 0, m);
  auto shared = std::make_shared<Call>();
  Call& c = *shared;
  const bool normalize = norm_size == k && valid > 0;
  std::vector<float> normalized(normalize ? valid * k : 0);
  const float* input = normalize ? normalized.data() : x.typed_data();
  c.gated = gated != 0;
  c.first_item.push_back(0);
  for (int64_t p = 0; p < num_weights; ++p) {
    auto q = args.get<ffi::AnyBuffer>(3 * p);
    auto scale = args.get<ffi::AnyBuffer>(3 * p + 1);
    auto min = args.get<ffi::AnyBuffer>(3 * p + 2);
    auto y = rets.get<ffi::Buffer<ffi::F32>>(c.gated ? 0 : p);
    if (!q.has_value() || !scale.has_value() || !min.has_value() || !y.has_value()) {
      return ffi::Error::InvalidArgument("weights must be (blocks, scale, min)");
    }
    const auto scale_type = scale->element_type();
    if ((scale_type != ffi::DataType::F32 && scale_type != ffi::DataType::F16) ||
        min->element_type() != scale_type) {
      return ffi::Error::InvalidArgument("scale and min must both be float32 or float16");
    }
    const bool half = scale_type == ffi::DataType::F16;
    // A weight stacked over the decoder's layers ([L, ...] each of the three): row `layer`.
    Layer lq = layer_of(*q, layer), ls = layer_of(*scale, layer), lm = layer_of(*min, layer);
    const auto& qd = lq.dims;
    const auto& sd = ls.dims;
    auto yd = (*y)->dimensions();
    const bool four_bit = q->element_type() == ffi::DataType::U8;
    if (!four_bit && q->element_type() != ffi::DataType::S8) {
      return ffi::Error::InvalidArgument("blocks must be uint8 (4-bit) or int8 (8-bit)");
    }
    const int64_t n = qd.size() == 3 ? qd[0] * kLanes : -1;
    if (!lq.data || !ls.data || !lm.data || qd.size() != 3 || sd.size() != 3 ||
        yd.size() != 2 || yd[0] != m || yd[1] != n ||
        qd[2] != kLanes || sd[2] != kLanes || sd[0] != qd[0] || sd[1] == 0 ||
        k % sd[1] != 0 || qd[1] != (four_bit ? k / 2 : k) || sd != lm.dims ||
        (four_bit && (k / sd[1]) % 2 != 0) ||
        (residual.element_count() != 0 && residual.element_count() != m * n)) {
      return ffi::Error::InvalidArgument("inconsistent packed matmul shapes");
    }
    float* out = (*y)->typed_data();
    if (p == 0 || !c.gated) std::fill(out + valid * n, out + m * n, 0.0f);
    c.weights.push_back({input, lq.data, {ls.data, half}, {lm.data, half}, out,
                         valid, k, n, k / sd[1], n, 0, four_bit});
    c.xsums.push_back(xsums_for(c, valid, k, k / sd[1]));
    c.splits.push_back(int8 ? split_for(c, valid, k, k / sd[1], four_bit) : nullptr);
    // The int8 path at several rows: items of kSplitChunkVectors, so that the last items
    // of a call keep both threads busy (its loop is per vector, so a smaller chunk costs
    // nothing but an atomic increment); the float paths keep kChunkVectors (panel widths).
    const int64_t chunk = (c.gated && p == 1) ? c.chunk[0]
                          : (c.splits.back() && valid >= 4) ? kSplitChunkVectors : kChunkVectors;
    c.chunk.push_back(chunk);
    const int64_t items = (n / kLanes + chunk - 1) / chunk;
    c.first_item.push_back(c.first_item.back() + ((c.gated && p == 1) ? 0 : items));
  }
  if (c.gated && c.weights[0].n != c.weights[1].n) {
    return ffi::Error::InvalidArgument("gated: the gate and up weights differ in width");
  }
  c.residual = residual.element_count() != 0 ? residual.typed_data() : nullptr;
  if (valid == 0) return ffi::Error::Success();
  prepare_rows(pool, shared, x.typed_data(), normalize ? norm_weight : nullptr, eps,
               normalized.data(), valid, k);
  run_items(pool, c.first_item.back(), [shared, valid] {
    return [shared, scratch = std::vector<float>(valid * kChunkVectors * kLanes)](
               int64_t i) mutable { run_item(*shared, i, scratch); };
  });
  if (rope_outputs > 0) {
    const int64_t half = inv_freq.element_count();
    const RopeAngles& angles =
        RopeAngles::of(valid, positions.typed_data(), inv_freq.typed_data(), half);
    for (int32_t p = 0; p < rope_outputs; ++p) {
      rotate(c.weights[p].y, valid, c.weights[p].n, angles, half);
    }
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxpaged_cpu

// 1 when the library multiplies packed weights by split activations in int8 (packed_vnni.h),
// 0 when it multiplies in float32 (read by jaxpaged.layers.cpu_build.packed_int8_dots).
extern "C" int jaxpaged_packed_int8_dots() {
#ifdef JAXPAGED_PACKED_VNNI
  return 1;
#else
  return 0;
#endif
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpagedPackedMatmul, jaxpaged_cpu::PackedProjectionsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<float>("eps")
                                  .Attr<int32_t>("gated")
                                  .Attr<int32_t>("int8")
                                  .Attr<int32_t>("rope_outputs")
                                  .Attr<int32_t>("layer"));
