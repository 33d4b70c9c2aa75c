// The shapes of one kernel call and how a query finds its keys in the KV page pool
// (the layout of jaxpaged.layers.attention.base): k_pages, v_pages [num_pages, page_size,
// KVH, D]; the token at position p of a sequence sits in page page_table[seq][p / page_size],
// row p % page_size, and a page's rows hold every KV head: row t, head h starts at element
// ((page * page_size + t) * KVH + h) * D.
#pragma once

#include <algorithm>
#include <cstdint>

namespace jaxpaged_cpu {

struct Shape {
  int64_t num_tokens, num_blocks, block_q, num_heads, head_dim;  // q [T, H, D]; NB blocks of Bq
  int64_t num_pages, page_size, num_kv_heads, pages_per_seq;    // pools, page_table [B, P]
  float scale, soft_cap, v_scale;     // scale includes k_scale; soft_cap 0: none
  int32_t sliding_window;             // 0: none
  int64_t heads_per_item;             // KV heads of one work item (a divisor of KVH)
  const float* sinks;                 // [H] attention-sink logits (gpt-oss), nullptr: none

  // A block query that attends: a real position and a token row of q.
  bool is_query(int32_t pos, int32_t token) const {
    return pos >= 0 && token >= 0 && token < num_tokens;
  }
  int64_t group() const { return num_heads / num_kv_heads; }        // query heads per KV head
  int64_t row_stride() const { return num_kv_heads * head_dim; }    // elements between rows
  // First key position a query at `qpos` sees (its sliding window's start, or 0).
  int64_t first_key(int64_t qpos) const {
    return sliding_window > 0 ? std::max<int64_t>(0, qpos - sliding_window + 1) : 0;
  }
  // Element offset of page-table entry j's row 0 for KV head h (an out-of-range page id,
  // which a correct page table never holds, is clamped into the pool).
  int64_t page_offset(const int32_t* pages, int64_t j, int64_t h) const {
    const int64_t page = std::clamp<int64_t>(pages[j], 0, num_pages - 1);
    return page * page_size * row_stride() + h * head_dim;
  }
  // The softmax state a row of query head `head` starts from: the head's sink as a key
  // without a value (running max at the sink, sum exp(0) = 1), or, without sinks, `none`
  // (the path's "no key yet" max) and sum 0.
  float initial_max(int64_t head, float none) const { return sinks ? sinks[head] : none; }
  float initial_sum() const { return sinks ? 1.0f : 0.0f; }
  // Last page-table entry holding a key at or before `qpos`.
  int64_t last_page(int64_t qpos) const {
    return std::min<int64_t>(qpos / page_size, pages_per_seq - 1);
  }
};

}  // namespace jaxpaged_cpu
