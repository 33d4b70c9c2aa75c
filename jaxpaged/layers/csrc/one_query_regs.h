// one_query.h's attention of one query token, with the accumulators in AVX-512 registers: the
// path of decodes whose G query heads per KV head times D / 16 fit 16 registers (G <= 4 at
// D = 64, G <= 2 at D = 128), pages of a multiple of 16 rows and no soft-capping.
//
// one_query.h's loop does, per key and query head, a 64-wide dot ending in a horizontal sum
// and an axpy that loads and stores its accumulator row, a large share of a SmolLM2 decode
// step's thread time (docs/measurements.md, "CPU attention kernel"). Here the item's KV
// heads walk the sequence's pages together, 16 keys at a time (attend_heads_regs): each
// head's part of a key row is loaded (and widened from bfloat16 or float16) once for its G
// query heads, whose 16 partial dot products a transposing add tree turns into one vector of
// 16 scores (45 shuffles and adds instead of 16 horizontal sums); the softmax runs on those
// vectors, and the values are added into each head's G x D / 16 accumulators (HeadState),
// kept in registers while a chunk is folded in. Same arithmetic as one_query.h (float32 scores,
// statistics and accumulators; weights rounded to bfloat16 for a bfloat16 pool; its exp) in a
// different summation order, sinks included (each row starts from its head's sink).
#pragma once

#if defined(__AVX512F__)
#define JAXPAGED_ONE_QUERY_REGS 1

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "cpu_math.h"
#include "paged_layout.h"

namespace jaxpaged_cpu {

inline __m512 load_row16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load_row16(const Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load_row16(const uint16_t* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// Lane t of the result: the sum of a[t]'s 16 lanes (a transposing add tree).
inline __m512 sum_each_16(const __m512* a) {
  __m512 b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i) {
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                         _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  }
  for (int i = 0; i < 4; ++i) {
    c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0xEE));
  }
  for (int i = 0; i < 2; ++i) {
    d[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0xDD));
  }
  return _mm512_add_ps(_mm512_shuffle_f32x4(d[0], d[1], 0x88),
                       _mm512_shuffle_f32x4(d[0], d[1], 0xDD));
}

// cpu_math.h's exp_nonpositive on 16 lanes (the same operations).
inline __m512 exp_nonpositive16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-0.693145751953125f), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(-1.428606765330187045e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  for (const float c : {1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f}) {
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  }
  const __m512i bits = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

// Softmax weights as they meet the values: rounded to bfloat16 (nearest even) for a bfloat16
// pool, as cpu_math.h's round_weight.
inline __m512 round_weights(__m512 p, const float*) { return p; }
inline __m512 round_weights(__m512 p, const Half*) { return p; }
inline __m512 round_weights(__m512 p, const uint16_t*) {
  const __m512i u = _mm512_castps_si512(p);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i up = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd));
  return _mm512_castsi512_ps(_mm512_and_si512(up, _mm512_set1_epi32(~0xffff)));
}

// Whether one KV head of this shape takes attend_head_regs.
inline bool one_query_regs_shape(const Shape& sh) {
  const int64_t nc = sh.head_dim / 16, g = sh.group();
  return sh.head_dim % 16 == 0 && sh.page_size % 16 == 0 && sh.soft_cap <= 0.0f &&
         g >= 1 && g * nc <= 16 && (nc == 4 || nc == 8);
}

// The online-softmax state of one KV head's G query rows (accumulators, running max and
// sum); the compiler keeps it in registers while a chunk of 16 keys is folded in.
template <int G, int NC>
struct HeadState {
  __m512 acc[G][NC];
  float m[G], l[G];
};

// Folds keys [t0 + from, t0 + to) of one page (kp, vp: this head's part of row t0, rows
// `stride` elements apart) into state `st` of query rows q [G, D] (float32); kn, vn: the
// same rows of the next page, fetched into L2 as these are read (nullptr: none).
template <typename T, int G, int NC>
inline void fold_chunk16(const Shape& sh, const float* q, const T* kp, const T* vp,
                         int64_t stride, int64_t from, int64_t to, const T* kn, const T* vn,
                         HeadState<G, NC>& st) {
  const __mmask16 keys = static_cast<__mmask16>(((1u << to) - 1) & ~((1u << from) - 1));
  __m512 partial[G][16];
  for (int i = 0; i < 16; ++i) {
    if (kn != nullptr) {
      for (int64_t b = 0; b < 16 * NC * static_cast<int64_t>(sizeof(T)); b += 64) {
        __builtin_prefetch(reinterpret_cast<const char*>(kn + i * stride) + b, 0, 2);
        __builtin_prefetch(reinterpret_cast<const char*>(vn + i * stride) + b, 0, 2);
      }
    }
    const T* row = kp + i * stride;
    __m512 k[NC];
    for (int c = 0; c < NC; ++c) k[c] = load_row16(row + 16 * c);
    for (int r = 0; r < G; ++r) {
      __m512 s = _mm512_mul_ps(k[0], _mm512_loadu_ps(q + r * 16 * NC));
      for (int c = 1; c < NC; ++c) s = _mm512_fmadd_ps(k[c], _mm512_loadu_ps(q + (r * NC + c) * 16), s);
      partial[r][i] = s;
    }
  }
  alignas(64) float weight[G][16];
  for (int r = 0; r < G; ++r) {
    const __m512 s = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), keys,
                                        _mm512_mul_ps(sum_each_16(partial[r]), _mm512_set1_ps(sh.scale)));
    const float m_new = std::max(st.m[r], _mm512_reduce_max_ps(s));
    const float correction = exp_nonpositive(st.m[r] - m_new);
    const __m512 p = _mm512_maskz_mov_ps(keys, exp_nonpositive16(
        _mm512_sub_ps(s, _mm512_set1_ps(m_new))));
    st.l[r] = st.l[r] * correction + _mm512_reduce_add_ps(p);
    st.m[r] = m_new;
    _mm512_store_ps(weight[r], round_weights(p, kp));
    for (int c = 0; c < NC; ++c) st.acc[r][c] = _mm512_mul_ps(st.acc[r][c], _mm512_set1_ps(correction));
  }
  for (int64_t i = from; i < to; ++i) {
    const T* row = vp + i * stride;
    __m512 v[NC];
    for (int c = 0; c < NC; ++c) v[c] = load_row16(row + 16 * c);
    for (int r = 0; r < G; ++r) {
      const __m512 w = _mm512_set1_ps(weight[r][i]);
      for (int c = 0; c < NC; ++c) st.acc[r][c] = _mm512_fmadd_ps(w, v[c], st.acc[r][c]);
    }
  }
}

// Most KV heads one query walks together; an item with more walks them in turns.
constexpr int64_t kMaxRegsHeads = 8;

// Query rows q [nh, G, D] (float32) of KV heads [h0, h0 + nh) (nh <= kMaxRegsHeads) attending
// to their keys at positions [lo, qpos] (pages: the sequence's page-table row); out
// [nh, G, D] in T. The sequence's pages are walked once for all nh heads, 16 keys at a
// time: the heads' parts of a row are contiguous (paged_layout.h), so a page's K and V rows
// are read whole, in memory order, while the next page is fetched into L2 (decode attention
// was DRAM-latency bound with one head walking at a time: docs/measurements.md, "CPU
// attention kernel").
template <typename TQ, typename T, int G, int NC>
void attend_heads_regs(const Shape& sh, const float* q, int64_t lo, int64_t qpos,
                       const int32_t* pages, int64_t h0, int64_t nh, const T* k_pages,
                       const T* v_pages, TQ* out) {
  const int64_t ps = sh.page_size, stride = sh.row_stride();
  constexpr int64_t kHeadDim = 16 * NC;
  HeadState<G, NC> st[kMaxRegsHeads];
  for (int64_t h = 0; h < nh; ++h) {
    for (int r = 0; r < G; ++r) {
      st[h].m[r] = sh.initial_max((h0 + h) * G + r, -INFINITY);
      st[h].l[r] = sh.initial_sum();
      for (int c = 0; c < NC; ++c) st[h].acc[r][c] = _mm512_setzero_ps();
    }
  }
  const int64_t last = sh.last_page(qpos);
  for (int64_t j = lo / ps; j <= last; ++j) {
    const T* kp = k_pages + sh.page_offset(pages, j, h0);
    const T* vp = v_pages + sh.page_offset(pages, j, h0);
    // The next page's rows are fetched into L2 a row at a time while this page's rows are
    // read (a burst of a whole page's prefetches stalled the loads behind it).
    const T* kn = j < last ? k_pages + sh.page_offset(pages, j + 1, h0) : nullptr;
    const T* vn = j < last ? v_pages + sh.page_offset(pages, j + 1, h0) : nullptr;
    const int64_t t_begin = std::max<int64_t>(0, lo - j * ps);
    const int64_t t_end = std::min<int64_t>(ps, qpos - j * ps + 1);
    for (int64_t t0 = t_begin / 16 * 16; t0 < t_end; t0 += 16) {
      // Lanes t0 + i with t_begin <= t0 + i < t_end are keys of this query.
      const int64_t from = std::max<int64_t>(t_begin - t0, 0), to = std::min<int64_t>(t_end - t0, 16);
      for (int64_t h = 0; h < nh; ++h) {
        fold_chunk16<T, G, NC>(sh, q + h * G * kHeadDim, kp + t0 * stride + h * kHeadDim,
                               vp + t0 * stride + h * kHeadDim, stride, from, to,
                               kn ? kn + t0 * stride + h * kHeadDim : nullptr,
                               vn ? vn + t0 * stride + h * kHeadDim : nullptr, st[h]);
      }
    }
  }
  for (int64_t h = 0; h < nh; ++h) {
    for (int r = 0; r < G; ++r) {
      const float norm = sh.v_scale / st[h].l[r];
      alignas(64) float row[kHeadDim];
      for (int c = 0; c < NC; ++c) {
        _mm512_store_ps(row + 16 * c, _mm512_mul_ps(st[h].acc[r][c], _mm512_set1_ps(norm)));
      }
      for (int64_t d = 0; d < kHeadDim; ++d) store(out, (h * G + r) * kHeadDim + d, row[d]);
    }
  }
}

// A query's KV heads [h0, h0 + nh) through attend_heads_regs (one_query_regs_shape(sh)),
// kMaxRegsHeads at a time; q_rows / out_rows as one_query.h's attend_one_query; q_scratch:
// nh * G * D floats.
template <typename TQ, typename T>
void attend_one_query_regs(const Shape& sh, const TQ* q_rows, int64_t qpos, const int32_t* pages,
                           int64_t h0, int64_t nh, const T* k_pages, const T* v_pages,
                           TQ* out_rows, float* q_scratch) {
  const int64_t g = sh.group(), d_len = sh.head_dim, lo = sh.first_key(qpos);
  for (int64_t i = 0; i < nh * g * d_len; ++i) q_scratch[i] = load(q_rows, i);
  for (int64_t h = h0; h < h0 + nh; h += kMaxRegsHeads) {
    const int64_t n = std::min(kMaxRegsHeads, h0 + nh - h);
    const float* q = q_scratch + (h - h0) * g * d_len;
    TQ* out = out_rows + (h - h0) * g * d_len;
#define JAXPAGED_HEAD_REGS(GG, NN)                                                         \
  if (g == GG && d_len == 16 * NN) {                                                       \
    attend_heads_regs<TQ, T, GG, NN>(sh, q, lo, qpos, pages, h, n, k_pages, v_pages, out);     \
    continue;                                                                              \
  }
    JAXPAGED_HEAD_REGS(1, 4) JAXPAGED_HEAD_REGS(2, 4) JAXPAGED_HEAD_REGS(3, 4)
    JAXPAGED_HEAD_REGS(4, 4) JAXPAGED_HEAD_REGS(1, 8) JAXPAGED_HEAD_REGS(2, 8)
#undef JAXPAGED_HEAD_REGS
  }
}

}  // namespace jaxpaged_cpu

#endif  // __AVX512F__
