// Attention of a tile of up to 16 query rows of one KV head over their sequence's pages: the
// path of query blocks (prefill chunks, speculative verify blocks) with enough real queries.
//
// A tile's rows are (query, query head) pairs of one block that read the same KV head: the
// block's real queries times the G = H / KVH query heads of the KV head. Everything is laid
// out with the 16 rows as the vector lanes, so one AVX-512 register holds a value per row:
//   qT   [D][16]   the queries, transposed once per tile and pre-multiplied by the scale;
//   s    [ps][16]  one page's scores, then its softmax weights;
//   accT [D][16]   the float32 accumulator; m, l [16] the running max and sum.
// Per page the tile does two small register-blocked matmuls, each reading the page's K or V
// rows of this head once (a row is D contiguous elements; rows are KVH * D apart):
//   scores  s[t][:]  = sum_d K[t][d] * qT[d][:]   4 keys at a time, K[t][d] broadcast;
//   values  accT[d][:] = accT[d][:] * correction + sum_t V[t][d] * s[t][:]   8 d at a time,
//                                                     accumulators in registers over the page.
// Between them the online softmax (Milakov & Gimelshein 2018; FlashAttention-2's rescaled
// accumulator, Dao 2023) is elementwise over the lanes. Keys a row must not see (after its
// position, or before its sliding window) get weight 0; pages wholly visible to every row
// skip the mask. bfloat16 pages are widened to float32 scratch rows first (one pass). With
// attention sinks each row starts from its head's sink (paged_layout.h's initial_max).
#pragma once

#include <climits>
#include <vector>

#include "cpu_math.h"
#include "paged_layout.h"

namespace jaxpaged_cpu {

constexpr float kMasked = -1e30f;     // the score of a key a row does not see

// Scratch of one worker for this path.
struct TileScratch {
  std::vector<float> qT, s, accT;     // [D][16], [ps][16], [D][16]
  std::vector<float> kf, vf;          // a bf16 page's rows of one head, widened
  explicit TileScratch(const Shape& sh)
      : qT(sh.head_dim * kLanes), s(sh.page_size * kLanes), accT(sh.head_dim * kLanes),
        kf(sh.page_size * sh.head_dim), vf(sh.page_size * sh.head_dim) {}
};

// The tile's rows: query and output pointers ([D] each) and the query positions.
template <typename T>
struct RowTile {
  int n = 0;
  const T* q[kLanes];
  T* out[kLanes];
  int32_t pos[kLanes];
  int32_t head[kLanes];               // each row's query head (its sink's index)
};

// Rows t0..t1 of one head of a page as float32 rows `stride` apart: the page itself for a
// float32 pool; for bf16, widened into `scratch` (then `stride` = D).
inline const float* page_rows(const float* p, int64_t, int64_t, int64_t, float*, int64_t*) {
  return p;
}
#if defined(__AVX512F__)
inline const float* page_rows(const Half* p, int64_t t0, int64_t t1, int64_t d_len,
                              float* scratch, int64_t* stride) {
  for (int64_t t = t0; t < t1; ++t) {
    const Half* row = p + t * *stride;
    int64_t d = 0;
    for (; d + 16 <= d_len; d += 16) {
      _mm512_storeu_ps(scratch + t * d_len + d, _mm512_cvtph_ps(_mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(row + d))));
    }
    for (; d < d_len; ++d) scratch[t * d_len + d] = load(row, d);
  }
  *stride = d_len;
  return scratch;
}
#endif
template <typename T>
inline const float* page_rows(const T* p, int64_t t0, int64_t t1, int64_t d_len,
                              float* scratch, int64_t* stride) {
  for (int64_t t = t0; t < t1; ++t) {
#pragma omp simd
    for (int64_t d = 0; d < d_len; ++d) scratch[t * d_len + d] = load(p, t * *stride + d);
  }
  *stride = d_len;
  return scratch;
}

// s[t] = sum_d K[t][d] * qT[d] for t in [t0, t1).
inline void tile_scores(const float* k, int64_t stride, int64_t t0, int64_t t1, int64_t d_len,
                        const float* qT, float* s) {
  int64_t t = t0;
  for (; t + 4 <= t1; t += 4) {
    const float *k0 = k + t * stride, *k1 = k0 + stride, *k2 = k1 + stride, *k3 = k2 + stride;
    v16 a0 = {}, a1 = {}, a2 = {}, a3 = {};
    for (int64_t d = 0; d < d_len; ++d) {
      const v16 q = load16(qT + d * kLanes);
      a0 += k0[d] * q;
      a1 += k1[d] * q;
      a2 += k2[d] * q;
      a3 += k3[d] * q;
    }
    store16(s + t * kLanes, a0);
    store16(s + (t + 1) * kLanes, a1);
    store16(s + (t + 2) * kLanes, a2);
    store16(s + (t + 3) * kLanes, a3);
  }
  for (; t < t1; ++t) {
    const float* kt = k + t * stride;
    v16 a = {};
    for (int64_t d = 0; d < d_len; ++d) a += kt[d] * load16(qT + d * kLanes);
    store16(s + t * kLanes, a);
  }
}

// accT[d] = accT[d] * corr + sum_t V[t][d] * p[t] for every d.
inline void tile_values(const float* v, int64_t stride, int64_t t0, int64_t t1, int64_t d_len,
                        const float* p, v16 corr, float* accT) {
  constexpr int kD = 8;
  int64_t d = 0;
  for (; d + kD <= d_len; d += kD) {
    v16 a[kD];
    for (int i = 0; i < kD; ++i) a[i] = load16(accT + (d + i) * kLanes) * corr;
    for (int64_t t = t0; t < t1; ++t) {
      const float* vt = v + t * stride + d;
      const v16 pt = load16(p + t * kLanes);
      for (int i = 0; i < kD; ++i) a[i] += vt[i] * pt;
    }
    for (int i = 0; i < kD; ++i) store16(accT + (d + i) * kLanes, a[i]);
  }
  for (; d < d_len; ++d) {
    v16 a = load16(accT + d * kLanes) * corr;
    for (int64_t t = t0; t < t1; ++t) a += v[t * stride + d] * load16(p + t * kLanes);
    store16(accT + d * kLanes, a);
  }
}

template <typename TQ, typename T>
void attend_row_tile(const Shape& sh, const RowTile<TQ>& tile, const int32_t* pages, int64_t h,
                     const T* k_pages, const T* v_pages, TileScratch& w) {
  const int64_t d_len = sh.head_dim, ps = sh.page_size;
  // Lanes past tile.n are idle: zero queries at position -1 (every key masked).
  int32_t pos[kLanes];
  int64_t lo = INT64_MAX, hi = -1, min_pos = INT64_MAX;
  for (int l = 0; l < kLanes; ++l) {
    pos[l] = l < tile.n ? tile.pos[l] : -1;
    if (l < tile.n) {
      lo = std::min(lo, sh.first_key(pos[l]));
      hi = std::max<int64_t>(hi, pos[l]);
      min_pos = std::min<int64_t>(min_pos, pos[l]);
    }
  }
  for (int64_t d = 0; d < d_len; ++d) {
    for (int l = 0; l < kLanes; ++l) {
      w.qT[d * kLanes + l] = l < tile.n ? load(tile.q[l], d) * sh.scale : 0.0f;
    }
  }
  float m[kLanes], lsum[kLanes];
  for (int l = 0; l < kLanes; ++l) {
    m[l] = l < tile.n ? sh.initial_max(tile.head[l], kMasked) : kMasked;
    lsum[l] = l < tile.n ? sh.initial_sum() : 0.0f;
  }
  std::fill(w.accT.begin(), w.accT.end(), 0.0f);
  float* s = w.s.data();
  for (int64_t j = lo / ps; j <= sh.last_page(hi); ++j) {
    const int64_t base = j * ps;      // position of the page's row 0
    const int64_t t0 = std::max<int64_t>(0, lo - base), t1 = std::min<int64_t>(ps, hi - base + 1);
    int64_t k_stride = sh.row_stride(), v_stride = sh.row_stride();
    const float* k = page_rows(k_pages + sh.page_offset(pages, j, h), t0, t1, d_len,
                               w.kf.data(), &k_stride);
    const float* v = page_rows(v_pages + sh.page_offset(pages, j, h), t0, t1, d_len,
                               w.vf.data(), &v_stride);
    tile_scores(k, k_stride, t0, t1, d_len, w.qT.data(), s);
    // Every row sees every key of [t0, t1) unless the page meets a row's diagonal or window.
    // (Idle lanes see zero queries: finite scores, never stored.)
    const bool masked = base + t1 - 1 > min_pos || base + t0 < sh.first_key(hi);
    for (int64_t t = t0; t < t1; ++t) {
      float* st = s + t * kLanes;
      if (sh.soft_cap > 0) {
#pragma omp simd
        for (int l = 0; l < kLanes; ++l) st[l] = soft_cap_score(st[l], sh.soft_cap);
      }
      if (masked) {
        const int64_t key = base + t;
#pragma omp simd
        for (int l = 0; l < kLanes; ++l) {
          const bool seen = key <= pos[l] &&
                            (sh.sliding_window <= 0 || key > pos[l] - sh.sliding_window);
          st[l] = seen ? st[l] : kMasked;
        }
      }
    }
    float m_new[kLanes], sum[kLanes], corr[kLanes];
    std::copy(m, m + kLanes, m_new);
    for (int64_t t = t0; t < t1; ++t) {
      const float* st = s + t * kLanes;
#pragma omp simd
      for (int l = 0; l < kLanes; ++l) m_new[l] = std::max(m_new[l], st[l]);
    }
    std::fill(sum, sum + kLanes, 0.0f);
    for (int64_t t = t0; t < t1; ++t) {
      float* st = s + t * kLanes;
#pragma omp simd
      for (int l = 0; l < kLanes; ++l) {
        const float p = st[l] > 0.5f * kMasked ? exp_nonpositive(st[l] - m_new[l]) : 0.0f;
        sum[l] += p;
        st[l] = round_weight(p, k_pages);
      }
    }
#pragma omp simd
    for (int l = 0; l < kLanes; ++l) {
      corr[l] = exp_nonpositive(m[l] - m_new[l]);
      lsum[l] = lsum[l] * corr[l] + sum[l];
      m[l] = m_new[l];
    }
    tile_values(v, v_stride, t0, t1, d_len, s, load16(corr), w.accT.data());
  }
  for (int l = 0; l < tile.n; ++l) {
    const float norm = sh.v_scale / lsum[l];
    for (int64_t d = 0; d < d_len; ++d) store(tile.out[l], d, w.accT[d * kLanes + l] * norm);
  }
}

}  // namespace jaxpaged_cpu
