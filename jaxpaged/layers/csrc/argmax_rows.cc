// Each real row's argmax of float32 logits, a greedy step's tokens, as an XLA FFI custom call.
//
// Inputs: logits [B, V] float32, rows [] int32 (the step's real sampling rows; the rest are
// padding). Output: ids [B] int32, row r < rows the first index of the row's largest value, or
// of its first NaN (NaN counts as the largest): jnp.argmax's answer, and
// jaxpaged.sampling.sampler.argmax_first's. Padding rows get 0.
//
// Why: the forward step's logits are padded to a row bucket (8 rows at least), and XLA:CPU's
// reductions read every row, where the real rows alone are a fraction of that
// (docs/measurements.md, "Sampling on XLA:CPU").
//
// A row is read twice: a 16-lane max that also notes NaNs, then a scan for the first lane
// equal to it (or the first NaN), block by block. Rows are work items (work_items.h).

#include <algorithm>
#include <cstdint>
#include <limits>

#include "cpu_math.h"
#include "work_items.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxpaged_cpu {
namespace {

typedef int32_t v16i __attribute__((vector_size(64)));

// The first index i < n with x[i] == target, or (nan) with x[i] a NaN; n if none.
int64_t first_match(const float* x, int64_t n, float target, bool nan) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const v16 a = load16(x + i);
    const v16i hit = nan ? (a != a) : (a == target);
    bool any = false;
    for (int j = 0; j < kLanes; ++j) any |= hit[j] != 0;
    if (any) break;
  }
  for (; i < n; ++i) {
    if (nan ? x[i] != x[i] : x[i] == target) return i;
  }
  return n;
}

int32_t argmax_row(const float* x, int64_t n) {
  const float lowest = -std::numeric_limits<float>::infinity();
  v16 best = v16{} + lowest;
  v16i nans = v16i{};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const v16 a = load16(x + i);
    best = a > best ? a : best;
    nans |= (a != a);
  }
  float m = lowest;
  bool nan = false;
  for (int j = 0; j < kLanes; ++j) {
    m = std::max(m, best[j]);
    nan |= nans[j] != 0;
  }
  for (; i < n; ++i) {
    nan |= x[i] != x[i];
    if (x[i] > m) m = x[i];
  }
  const int64_t at = first_match(x, n, m, nan);
  return static_cast<int32_t>(at < n ? at : 0);
}

ffi::Error ArgmaxRowsImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> logits,
                          ffi::Buffer<ffi::S32> rows, ffi::Result<ffi::Buffer<ffi::S32>> ids) {
  auto ld = logits.dimensions();
  if (ld.size() != 2 || rows.element_count() != 1 || ids->element_count() != ld[0]) {
    return ffi::Error::InvalidArgument("expected logits [B, V], rows [] and ids [B]");
  }
  const int64_t b = ld[0], v = ld[1];
  const int64_t valid = std::clamp<int64_t>(rows.typed_data()[0], 0, b);
  const float* x = logits.typed_data();
  int32_t* out = ids->typed_data();
  std::fill(out + valid, out + b, 0);
  if (valid == 0) return ffi::Error::Success();
  if (valid == 1 || v == 0) {
    for (int64_t r = 0; r < valid; ++r) out[r] = v == 0 ? 0 : argmax_row(x + r * v, v);
    return ffi::Error::Success();
  }
  run_items(pool, valid, [x, v, out] {
    return [x, v, out](int64_t r) { out[r] = argmax_row(x + r * v, v); };
  });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxpaged_cpu

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpagedArgmaxRows, jaxpaged_cpu::ArgmaxRowsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());
