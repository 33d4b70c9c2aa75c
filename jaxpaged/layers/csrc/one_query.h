// Attention of one query token over its sequence's pages, for a range of KV heads: the path
// of decodes and of query blocks with too few real queries to fill a row tile (row_tiles.h).
//
// The query's rows (its G = H / KVH query heads per KV head, for every KV head of the range)
// are folded into a float32 online softmax (Milakov & Gimelshein, "Online normalizer
// calculation for softmax", 2018; the per-page loop of vLLM's paged attention v1 kernel) one
// page at a time. Each page's rows are read once, in memory order (row t: every KV head of
// the range, contiguous), first for the scores (q.k as a vectorized dot over D), then for the
// weighted values (an axpy over D), while the page is still in L1/L2. While one half of a page
// (its K rows, then its V rows) is read, the next half (the page's V rows, then the next
// page's K rows) is fetched into L2 (prefetcht1, a 64-byte line at a time, a row per row
// read): the pages of a sequence are scattered over the pool, so the hardware prefetcher,
// which follows one address stream, starts over at every half; this half-ahead distance
// into L2 was the fastest of those tried on W1's decode step (docs/measurements.md, "CPU
// attention kernel"). With attention sinks each row's softmax starts from its head's sink
// (paged_layout.h's initial_max): the sink joins the denominator and adds no value.
#pragma once

#include <vector>

#include "cpu_math.h"
#include "paged_layout.h"

namespace jaxpaged_cpu {

// Scratch of one worker for this path: the item's query rows, scores and softmax state.
struct QueryScratch {
  std::vector<float> q, s, m, l, acc;
  explicit QueryScratch(const Shape& sh) {
    const int64_t rows = sh.heads_per_item * sh.group();
    q.resize(rows * sh.head_dim);
    s.resize(rows * sh.page_size);
    m.resize(rows);
    l.resize(rows);
    acc.resize(rows * sh.head_dim);
  }
};

template <typename T>
inline float dot(const float* __restrict q, const T* __restrict k, int64_t n) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t d = 0; d < n; ++d) sum += q[d] * load(k, d);
  return sum;
}

template <typename T>
inline void axpy(float* __restrict acc, float p, const T* __restrict v, int64_t n) {
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) acc[d] += p * load(v, d);
}

// q_rows / out_rows: the query's heads h0 * G .. (h0 + nh) * G, [nh * G, D] contiguous;
// pages: the sequence's page-table row; qpos >= 0.
template <typename TQ, typename T>
void attend_one_query(const Shape& sh, const TQ* q_rows, int64_t qpos, const int32_t* pages,
                      int64_t h0, int64_t nh, const T* k_pages, const T* v_pages, TQ* out_rows,
                      QueryScratch& w) {
  const int64_t d_len = sh.head_dim, ps = sh.page_size, group = sh.group();
  const int64_t rows = nh * group, row_stride = sh.row_stride();
  float* qf = w.q.data();
  for (int64_t i = 0; i < rows * d_len; ++i) qf[i] = load(q_rows, i);
  for (int64_t r = 0; r < rows; ++r) {    // row r: query head h0 * G + r
    w.m[r] = sh.initial_max(h0 * group + r, -INFINITY);
    w.l[r] = sh.initial_sum();
  }
  std::fill(w.acc.begin(), w.acc.begin() + rows * d_len, 0.0f);
  const int64_t lo = sh.first_key(qpos);
  float* s = w.s.data();
  const int64_t last = sh.last_page(qpos);
  const int64_t row_bytes = nh * d_len * static_cast<int64_t>(sizeof(T));
  for (int64_t j = lo / ps; j <= last; ++j) {
    const T* kp = k_pages + sh.page_offset(pages, j, h0);
    const T* vp = v_pages + sh.page_offset(pages, j, h0);
    const bool more = j < last;
    const char* v_this = reinterpret_cast<const char*>(vp);
    const char* k_next =
        more ? reinterpret_cast<const char*>(k_pages + sh.page_offset(pages, j + 1, h0)) : nullptr;
    const int64_t t0 = std::max<int64_t>(0, lo - j * ps);
    const int64_t t1 = std::min<int64_t>(ps, qpos - j * ps + 1);
    for (int64_t t = t0; t < t1; ++t) {      // scores: the page's rows in memory order
      for (int64_t b = 0; b < row_bytes; b += 64)
        __builtin_prefetch(v_this + t * row_stride * sizeof(T) + b, 0, 2);
      for (int64_t r = 0; r < rows; ++r) {
        float x = dot(qf + r * d_len, kp + t * row_stride + (r / group) * d_len, d_len) * sh.scale;
        if (sh.soft_cap > 0) x = soft_cap_score(x, sh.soft_cap);
        s[r * ps + t] = x;
      }
    }
    for (int64_t r = 0; r < rows; ++r) {     // online softmax update
      float* sr = s + r * ps;
      float m_new = w.m[r];
      for (int64_t t = t0; t < t1; ++t) m_new = std::max(m_new, sr[t]);
      const float correction = exp_nonpositive(w.m[r] - m_new);
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int64_t t = t0; t < t1; ++t) {
        const float p = exp_nonpositive(sr[t] - m_new);
        sum += p;
        sr[t] = round_weight(p, k_pages);
      }
      w.l[r] = w.l[r] * correction + sum;
      w.m[r] = m_new;
      float* acc = w.acc.data() + r * d_len;
#pragma omp simd
      for (int64_t d = 0; d < d_len; ++d) acc[d] *= correction;
    }
    for (int64_t t = t0; t < t1; ++t) {      // weighted values, same order
      if (more)
        for (int64_t b = 0; b < row_bytes; b += 64)
          __builtin_prefetch(k_next + t * row_stride * sizeof(T) + b, 0, 2);
      for (int64_t r = 0; r < rows; ++r) {
        axpy(w.acc.data() + r * d_len, s[r * ps + t], vp + t * row_stride + (r / group) * d_len,
             d_len);
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float norm = sh.v_scale / w.l[r];
    const float* acc = w.acc.data() + r * d_len;
    for (int64_t d = 0; d < d_len; ++d) store(out_rows, r * d_len + d, acc[d] * norm);
  }
}

}  // namespace jaxpaged_cpu
