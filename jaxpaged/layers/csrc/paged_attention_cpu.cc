// Paged attention for XLA:CPU as an XLA FFI custom call: query blocks of Bq >= 1 tokens of one
// sequence each (Bq = 1: decodes; Bq = 16: prefill chunks and the decodes of a mixed step; any
// Bq for speculative verify blocks), grouped-query attention, causal by each query's position.
//
// Inputs: q [T, H, D] the step's query tokens; k_pages, v_pages [num_pages, page_size, KVH, D]
// (the pool layout of jaxpaged.layers.attention.base, holding K / k_scale and V / v_scale) in
// q's dtype, or float16 under float32 queries (widened to float32 as read); page_table
// [B, P]; block_tokens [NB, Bq] the token (row of q) of each block query; block_seq [NB]
// each block's page-table row; block_pos [NB, Bq] each query's position, -1 for a padding
// query (skipped); sinks [H] float32 attention-sink logits
// (gpt-oss), or [0] for none. Output [T, H, D]: each block query's attention in its token's
// row, zeros in the rows of tokens no block query names. Reading q and writing the output by
// token spares the step a gather into blocks and a scatter back.
//
// A work item is one block with a range of its KV heads (all of them unless there are too few
// blocks to keep the threads busy). Its real queries take one of two paths:
//   * enough rows (real queries x G >= kMinTileRows): per KV head, tiles of 16 (query, query
//     head) rows (row_tiles.h), which read each K/V page of the head once per tile and do
//     small register-blocked matmuls against it;
//   * otherwise (decodes, mostly-padding blocks): each real query alone, with its
//     accumulators in registers where G and D allow (one_query_regs.h), else reading every
//     page's rows of all the item's heads once, in memory order (one_query.h).
// Items are spread over XLA:CPU's intra-op thread pool (the FFI ThreadPool context); the
// calling thread works too, so no thread waits on work nobody has started; the pool's threads
// made a W1 decode layer faster than the calling thread alone (docs/measurements.md, "CPU
// attention kernel").
//
// Numerics follow the xla backend (jaxpaged/layers/attention/xla.py): scores q.k in float32
// times `scale` (which includes k_scale), optional soft-capping cap * tanh(s / cap), keys
// outside (qpos - sliding_window, qpos] skipped, float32 softmax statistics and accumulator;
// for bfloat16 the softmax weights are rounded to bfloat16 before the value product (as the
// xla backend's bf16 dots and the Pallas kernels do). The output is acc / l * v_scale. A
// head's sink is a key without a value: each of its rows starts with max = sink and l = 1 (as
// the xla backend's m0, l0), an empty sinks array keeps max = -inf and l = 0 (no other cost).

#include <cstring>
#include <memory>
#include <vector>

#include "one_query.h"
#include "one_query_regs.h"
#include "row_tiles.h"
#include "work_items.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxpaged_cpu {
namespace {

// Fewer rows than this waste most of a tile's 16 lanes: take the one-query path instead.
constexpr int64_t kMinTileRows = 8;

struct Scratch {
  QueryScratch query;
  TileScratch tile;
  explicit Scratch(const Shape& sh) : query(sh), tile(sh) {}
};

// TQ: the queries' and output's element type; T: the pools'.
template <typename TQ, typename T>
struct Operands {
  const TQ* q;
  const T *k, *v;
  const int32_t *page_table, *block_tokens, *block_seq, *block_pos;
  TQ* out;
};

// Work item `item`: block b's KV heads [h0, h0 + heads_per_item).
template <typename TQ, typename T>
void attend_item(const Shape& sh, int64_t item, const Operands<TQ, T>& x, Scratch& w) {
  const int64_t items_per_block = sh.num_kv_heads / sh.heads_per_item;
  const int64_t b = item / items_per_block, h0 = item % items_per_block * sh.heads_per_item;
  const int64_t d_len = sh.head_dim, group = sh.group(), nh = sh.heads_per_item;
  const int32_t* pos = x.block_pos + b * sh.block_q;
  const int32_t* tokens = x.block_tokens + b * sh.block_q;
  const int32_t* pages = x.page_table + static_cast<int64_t>(x.block_seq[b]) * sh.pages_per_seq;
  // Query i's heads h0 * G .. (h0 + nh) * G are nh * G contiguous rows of D in its token's row.
  auto rows_of = [&](auto* base, int64_t i) {
    return base + (static_cast<int64_t>(tokens[i]) * sh.num_heads + h0 * group) * d_len;
  };
  int64_t real = 0;
  for (int64_t i = 0; i < sh.block_q; ++i) real += sh.is_query(pos[i], tokens[i]);
  if (real * group < kMinTileRows) {
    for (int64_t i = 0; i < sh.block_q; ++i) {
      if (!sh.is_query(pos[i], tokens[i])) continue;
#ifdef JAXPAGED_ONE_QUERY_REGS
      if (one_query_regs_shape(sh)) {
        attend_one_query_regs(sh, rows_of(x.q, i), pos[i], pages, h0, nh, x.k, x.v,
                              rows_of(x.out, i), w.query.q.data());
        continue;
      }
#endif
      attend_one_query(sh, rows_of(x.q, i), pos[i], pages, h0, nh, x.k, x.v,
                       rows_of(x.out, i), w.query);
    }
    return;
  }
  for (int64_t h = h0; h < h0 + nh; ++h) {
    RowTile<TQ> tile;
    for (int64_t i = 0; i < sh.block_q; ++i) {
      if (!sh.is_query(pos[i], tokens[i])) continue;
      for (int64_t g = 0; g < group; ++g) {           // row (i, g): query head h * G + g
        const int64_t offset = ((h - h0) * group + g) * d_len;
        tile.q[tile.n] = rows_of(x.q, i) + offset;
        tile.out[tile.n] = rows_of(x.out, i) + offset;
        tile.pos[tile.n] = pos[i];
        tile.head[tile.n] = static_cast<int32_t>(h * group + g);
        if (++tile.n == kLanes) {
          attend_row_tile(sh, tile, pages, h, x.k, x.v, w.tile);
          tile.n = 0;
        }
      }
    }
    if (tile.n > 0) attend_row_tile(sh, tile, pages, h, x.k, x.v, w.tile);
  }
}

// Zeros in the output rows of tokens that are no block's query (padding tokens).
template <typename TQ, typename T>
void zero_other_tokens(const Shape& sh, const Operands<TQ, T>& x) {
  std::vector<bool> named(sh.num_tokens, false);
  for (int64_t e = 0; e < sh.num_blocks * sh.block_q; ++e) {
    if (sh.is_query(x.block_pos[e], x.block_tokens[e])) named[x.block_tokens[e]] = true;
  }
  const int64_t row = sh.num_heads * sh.head_dim;
  for (int64_t t = 0; t < sh.num_tokens; ++t) {
    if (!named[t]) std::fill(x.out + t * row, x.out + (t + 1) * row, TQ{0});
  }
}

template <typename TQ, typename T>
void launch(ffi::ThreadPool& pool, const Shape& sh, const Operands<TQ, T>& x) {
  zero_other_tokens(sh, x);
  run_items(pool, sh.num_blocks * (sh.num_kv_heads / sh.heads_per_item), [sh, x] {
    return [sh, x, scratch = std::make_shared<Scratch>(sh)](int64_t i) {
      attend_item(sh, i, x, *scratch);
    };
  });
}

template <typename TQ, typename T>
Operands<TQ, T> operands(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                         const int32_t* pt, const int32_t* tokens, const int32_t* seq,
                         const int32_t* pos, ffi::Result<ffi::AnyBuffer>& out) {
  return {static_cast<const TQ*>(q.untyped_data()), static_cast<const T*>(k.untyped_data()),
          static_cast<const T*>(v.untyped_data()), pt, tokens, seq, pos,
          static_cast<TQ*>(out->untyped_data())};
}

ffi::Error PagedAttentionImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k_pages,
                              ffi::AnyBuffer v_pages, ffi::Buffer<ffi::S32> page_table,
                              ffi::Buffer<ffi::S32> block_tokens,
                              ffi::Buffer<ffi::S32> block_seq, ffi::Buffer<ffi::S32> block_pos,
                              ffi::Buffer<ffi::F32> sinks, ffi::Result<ffi::AnyBuffer> out,
                              float scale, float soft_cap, int32_t sliding_window,
                              float v_scale) {
  auto qd = q.dimensions(), kd = k_pages.dimensions(), bd = block_tokens.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || page_table.dimensions().size() != 2 ||
      bd.size() != 2) {
    return ffi::Error::InvalidArgument("expected q [T, H, D], pages [N, S, KVH, D], "
                                       "page_table [B, P], block_tokens [NB, Bq]");
  }
  Shape sh{qd[0], bd[0], bd[1], qd[1], qd[2], kd[0], kd[1], kd[2], page_table.dimensions()[1],
           scale, soft_cap, v_scale, sliding_window, 0,
           sinks.element_count() == 0 ? nullptr : sinks.typed_data()};
  if (kd[3] != sh.head_dim || sh.num_heads % sh.num_kv_heads != 0 ||
      !std::equal(kd.begin(), kd.end(), v_pages.dimensions().begin(),
                  v_pages.dimensions().end()) ||
      static_cast<int64_t>(block_seq.element_count()) != sh.num_blocks ||
      static_cast<int64_t>(block_pos.element_count()) != sh.num_blocks * sh.block_q ||
      (sh.sinks != nullptr && static_cast<int64_t>(sinks.element_count()) != sh.num_heads)) {
    return ffi::Error::InvalidArgument("inconsistent shapes (sinks: [H] or [0])");
  }
  const auto dtype = q.element_type(), pool_dtype = k_pages.element_type();
  if (v_pages.element_type() != pool_dtype || out->element_type() != dtype ||
      (pool_dtype != dtype && !(dtype == ffi::DataType::F32 && pool_dtype == ffi::DataType::F16))) {
    return ffi::Error::InvalidArgument(
        "q and output share a dtype, the pools q's (or float16 pools for float32 q)");
  }
  // Whole blocks make the longest contiguous reads (a page's rows of every KV head); split a
  // block's KV heads only when there are too few blocks to keep the threads busy.
  const int64_t wanted_items = 4 * std::max<int64_t>(1, pool.num_threads());
  sh.heads_per_item = sh.num_kv_heads;
  while (sh.heads_per_item % 2 == 0 &&
         sh.num_blocks * (sh.num_kv_heads / sh.heads_per_item) < wanted_items) {
    sh.heads_per_item /= 2;
  }
  const int32_t *pt = page_table.typed_data(), *tokens = block_tokens.typed_data(),
                *seq = block_seq.typed_data(), *pos = block_pos.typed_data();
  if (dtype == ffi::DataType::F32 && pool_dtype == ffi::DataType::F16) {
    launch(pool, sh, operands<float, Half>(q, k_pages, v_pages, pt, tokens, seq, pos, out));
  } else if (dtype == ffi::DataType::F32) {
    launch(pool, sh, operands<float, float>(q, k_pages, v_pages, pt, tokens, seq, pos, out));
  } else if (dtype == ffi::DataType::BF16) {
    launch(pool, sh,
           operands<uint16_t, uint16_t>(q, k_pages, v_pages, pt, tokens, seq, pos, out));
  } else {
    return ffi::Error::InvalidArgument("dtype must be float32 or bfloat16");
  }
  return ffi::Error::Success();
}

// The step's new K/V rows into their slots, then PagedAttentionImpl over the pool: k_out and
// v_out are the pools (XLA aliases them to k_pages and v_pages, so they hold the pool's rows
// when the call starts and the write happens in place). k_new, v_new: [T, KVH, D] in the
// pool's dtype; slots: [T] int32 flat slots (page * page_size + row; padding tokens name the
// null page's; a slot outside the pool is skipped); sinks as PagedAttentionImpl's. One XLA
// scatter less per pool and layer.
ffi::Error PagedAttentionWriteImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k_pages,
                                   ffi::AnyBuffer v_pages, ffi::Buffer<ffi::S32> page_table,
                                   ffi::Buffer<ffi::S32> block_tokens,
                                   ffi::Buffer<ffi::S32> block_seq,
                                   ffi::Buffer<ffi::S32> block_pos, ffi::Buffer<ffi::F32> sinks,
                                   ffi::AnyBuffer k_new, ffi::AnyBuffer v_new, ffi::Buffer<ffi::S32> slots,
                                   ffi::Result<ffi::AnyBuffer> out,
                                   ffi::Result<ffi::AnyBuffer> k_out,
                                   ffi::Result<ffi::AnyBuffer> v_out, float scale,
                                   float soft_cap, int32_t sliding_window, float v_scale) {
  auto kd = k_pages.dimensions(), nd = k_new.dimensions();
  if (kd.size() != 4 || nd.size() != 3 || nd[1] != kd[2] || nd[2] != kd[3] ||
      static_cast<int64_t>(slots.element_count()) != nd[0] ||
      !std::equal(nd.begin(), nd.end(), v_new.dimensions().begin(), v_new.dimensions().end()) ||
      k_new.element_type() != k_pages.element_type() ||
      v_new.element_type() != k_pages.element_type() ||
      k_out->size_bytes() != k_pages.size_bytes() || v_out->size_bytes() != v_pages.size_bytes()) {
    return ffi::Error::InvalidArgument("expected k_new, v_new [T, KVH, D] in the pool's dtype, "
                                       "slots [T] and the pools as outputs");
  }
  const int64_t slots_in_pool = kd[0] * kd[1];
  const size_t row = k_new.size_bytes() / std::max<int64_t>(nd[0], 1);
  auto* kp = static_cast<char*>(k_out->untyped_data());
  auto* vp = static_cast<char*>(v_out->untyped_data());
  const auto* kn = static_cast<const char*>(k_new.untyped_data());
  const auto* vn = static_cast<const char*>(v_new.untyped_data());
  const int32_t* slot = slots.typed_data();
  for (int64_t t = 0; t < nd[0]; ++t) {
    if (slot[t] < 0 || slot[t] >= slots_in_pool) continue;
    std::memcpy(kp + slot[t] * row, kn + t * row, row);
    std::memcpy(vp + slot[t] * row, vn + t * row, row);
  }
  return PagedAttentionImpl(pool, q, *k_out, *v_out, page_table, block_tokens, block_seq,
                            block_pos, sinks, out, scale, soft_cap, sliding_window, v_scale);
}

}  // namespace
}  // namespace jaxpaged_cpu

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpagedPagedAttentionWrite, jaxpaged_cpu::PagedAttentionWriteImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<float>("scale")
                                  .Attr<float>("soft_cap")
                                  .Attr<int32_t>("sliding_window")
                                  .Attr<float>("v_scale"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpagedPagedAttention, jaxpaged_cpu::PagedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<float>("scale")
                                  .Attr<float>("soft_cap")
                                  .Attr<int32_t>("sliding_window")
                                  .Attr<float>("v_scale"));
