// float32 y = x . w^T for few rows (a decode step's projections) as an XLA FFI custom call.
//
// Inputs: xt [K, Mp], the step's rows transposed and zero-padded to Mp (a multiple of 16) rows
// (XLA writes it in the fusion that produces x); w [N, K], the projection's weight in torch's
// [out, in] layout. Output y [M, N], M <= Mp.
//
// Why: XLA:CPU's YNNPACK dot costs a fixed time per weight on top of the rows' arithmetic (it
// repacks the weight on every call), so at few rows it runs well below the machine's peak
// (docs/measurements.md, "CPU matmul"; docs/benchmarks.md, "Small-row matmuls"). Here the weight is read where it
// lies, once per call: a register block holds 16 x MV rows of y^T for NR output features,
// and each step k broadcasts NR weights w[n, k] against the MV vectors xt[k, 16 i .. 16 i + 15]
// (MV * NR fused multiply-adds for MV vector loads and NR scalar broadcasts), the outer-product
// micro-kernel of BLIS (Van Zee & van de Geijn, ACM TOMS 2015) with the activation, not the
// weight, as the packed operand. Each weight row is contiguous in k, so NR rows are NR
// sequential streams, and the next block's rows are prefetched into L2 a cache line per 16
// steps of k (faster on W1's decode step: docs/measurements.md, "CPU matmul"); xt (Mp x K floats) stays
// in L2 for every block. The finished block is written to y transposed through a small tile.
//
// Work items are chunks of kChunk output features (work_items.h). The sum over k runs in
// order, one fused multiply-add per term, in float32.

#include <algorithm>
#include <vector>

#include "cpu_math.h"
#include "work_items.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxpaged_cpu {
namespace {

// Output features per work item: a multiple of every block width NR below.
constexpr int64_t kChunk = 48;
// Rows of y one register block covers at most (4 vectors of 16).
constexpr int64_t kMaxBlockRows = 64;

struct MatmulArgs {
  const float* xt;  // [K, mp]
  const float* w;   // [N, K]
  float* y;         // [M, N]
  int64_t m, mp, k, n;
};

// y^T[n0 .. n0 + NR, m0 .. m0 + 16 MV] into tile[j * kMaxBlockRows + r].
template <int MV, int NR>
inline void register_block(const MatmulArgs& a, int64_t m0, int64_t n0, float* tile,
                           const float* next) {
  v16 acc[NR][MV];
#pragma GCC unroll 16
  for (int j = 0; j < NR; ++j) {
#pragma GCC unroll 4
    for (int i = 0; i < MV; ++i) acc[j][i] = v16{};
  }
  const float* xt = a.xt + m0;
  const float* w = a.w + n0 * a.k;
  for (int64_t k = 0; k < a.k; ++k) {
    if (next != nullptr && k % kLanes == 0) {
#pragma GCC unroll 16
      for (int j = 0; j < NR; ++j) __builtin_prefetch(next + j * a.k + k, 0, 2);
    }
    v16 xv[MV];
#pragma GCC unroll 4
    for (int i = 0; i < MV; ++i) xv[i] = load16(xt + k * a.mp + kLanes * i);
#pragma GCC unroll 16
    for (int j = 0; j < NR; ++j) {
      const float b = w[j * a.k + k];
#pragma GCC unroll 4
      for (int i = 0; i < MV; ++i) acc[j][i] += b * xv[i];
    }
  }
#pragma GCC unroll 16
  for (int j = 0; j < NR; ++j) {
#pragma GCC unroll 4
    for (int i = 0; i < MV; ++i) store16(tile + j * kMaxBlockRows + kLanes * i, acc[j][i]);
  }
}

// Output features [n0, n1) of rows [m0, m0 + 16 MV): blocks of NR features, then single ones.
template <int MV, int NR>
void row_group(const MatmulArgs& a, int64_t m0, int64_t n0, int64_t n1, float* tile) {
  const int64_t rows = std::min<int64_t>(kLanes * MV, a.m - m0);
  auto write = [&](int64_t n, int width) {
    for (int64_t r = 0; r < rows; ++r) {
      float* out = a.y + (m0 + r) * a.n + n;
      for (int j = 0; j < width; ++j) out[j] = tile[j * kMaxBlockRows + r];
    }
  };
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) {
    // The next NR weight rows are fetched into L2 while these are used (past the item's
    // end they are the next item's, which a thread takes next).
    const float* next = n + 2 * NR <= a.n ? a.w + (n + NR) * a.k : nullptr;
    register_block<MV, NR>(a, m0, n, tile, next);
    write(n, NR);
  }
  for (; n < n1; ++n) {
    register_block<MV, 1>(a, m0, n, tile, nullptr);
    write(n, 1);
  }
}

// Work item `item`: output features [item * kChunk, +kChunk) of every row. Block shapes keep
// MV * NR = 24 accumulators (12 for one vector) of the 32 vector registers.
void matmul_item(const MatmulArgs& a, int64_t item, float* tile) {
  const int64_t n0 = item * kChunk, n1 = std::min(a.n, n0 + kChunk);
  const int64_t vectors = a.mp / kLanes;
  for (int64_t v = 0; v < vectors; v += 4) {
    const int64_t m0 = v * kLanes;
    switch (std::min<int64_t>(4, vectors - v)) {
      case 4: row_group<4, 6>(a, m0, n0, n1, tile); break;
      case 3: row_group<3, 8>(a, m0, n0, n1, tile); break;
      case 2: row_group<2, 12>(a, m0, n0, n1, tile); break;
      default: row_group<1, 12>(a, m0, n0, n1, tile); break;
    }
  }
}

ffi::Error SmallRowsMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> xt,
                               ffi::Buffer<ffi::F32> w, ffi::Result<ffi::Buffer<ffi::F32>> y) {
  auto xd = xt.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 2 || yd.size() != 2) {
    return ffi::Error::InvalidArgument("expected xt [K, Mp], w [N, K], y [M, N]");
  }
  const MatmulArgs a{xt.typed_data(), w.typed_data(), y->typed_data(), yd[0], xd[1], xd[0],
                     wd[0]};
  if (a.mp % kLanes != 0 || a.m > a.mp || wd[1] != a.k || yd[1] != a.n) {
    return ffi::Error::InvalidArgument("inconsistent shapes (Mp must be a multiple of 16)");
  }
  if (a.m == 0 || a.n == 0) return ffi::Error::Success();
  run_items(pool, (a.n + kChunk - 1) / kChunk, [a] {
    return [a, tile = std::vector<float>(12 * kMaxBlockRows)](int64_t i) mutable {
      matmul_item(a, i, tile.data());
    };
  });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxpaged_cpu

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpagedSmallRowsMatmul, jaxpaged_cpu::SmallRowsMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
