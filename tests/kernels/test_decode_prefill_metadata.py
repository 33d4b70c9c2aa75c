"""Host metadata of the v2 kernels: decodes and prefill blocks apart, bucket-only shapes."""

import jax.numpy as jnp
import numpy as np

from jaxpaged.layers.attention.decode_prefill import (PREFILL_BLOCK_Q,
                                                      build_decode_prefill_metadata)
from pallas_kernels.paged_attention import (MIN_TILES_PER_SPLIT, TARGET_PROGRAMS, max_splits,
                                            split_range)
from tests.kernels.ragged_batches import make_batch


def test_decodes_and_prefill_blocks_are_split_longest_first():
    rng = np.random.default_rng(3)
    # tokens: seq0 chunk [0, 40), seq1 decode 40, seq2 chunk [41, 44), seq3 decode 44
    batch = make_batch(rng, num_heads=4, num_kv_heads=2, head_dim=8, page_size=16,
                       dtype=jnp.float32, seqs=[(10, 40), (70, 1), (0, 3), (150, 1)],
                       pad_tokens=4, pad_seqs=2)
    meta = build_decode_prefill_metadata(batch.layout)
    t = 49                                      # padded tokens: 45 real + 4
    np.testing.assert_array_equal(meta["decode_tokens"], [44, 40, t, t, t, t])
    np.testing.assert_array_equal(meta["decode_seq"], [3, 1, 0, 0, 0, 0])
    np.testing.assert_array_equal(meta["decode_positions"], [150, 70, -1, -1, -1, -1])
    np.testing.assert_array_equal(meta["decode_kv_tokens"], [151 + 71])
    # ceil(49 / 32) + min(6, 49 // 2) = 8 blocks: seq0's [0, 32) and [32, 40), seq2's 3 tokens
    assert meta["prefill_tokens"].shape == (8, PREFILL_BLOCK_Q)
    np.testing.assert_array_equal(meta["prefill_seq"][:3], [0, 0, 2])
    np.testing.assert_array_equal(meta["prefill_positions"][0, :8], np.arange(42, 50))
    assert (meta["prefill_positions"][0, 8:] == -1).all()
    np.testing.assert_array_equal(meta["prefill_positions"][1], np.arange(10, 42))
    np.testing.assert_array_equal(meta["prefill_tokens"][2, :3], [41, 42, 43])
    assert (meta["prefill_positions"][3:] == -1).all() and (meta["prefill_tokens"][3:] == t).all()
    assert all(a.dtype == np.int32 for a in meta.values())


def test_decode_only_step_has_no_prefill_blocks():
    rng = np.random.default_rng(4)
    batch = make_batch(rng, num_heads=4, num_kv_heads=2, head_dim=8, page_size=16,
                       dtype=jnp.float32, seqs=[(5, 1), (30, 1), (17, 1)], pad_tokens=1,
                       pad_seqs=1)
    meta = build_decode_prefill_metadata(batch.layout)
    assert meta["prefill_tokens"].shape == (0, PREFILL_BLOCK_Q)
    np.testing.assert_array_equal(meta["decode_positions"], [30, 17, 5, -1])
    np.testing.assert_array_equal(meta["decode_tokens"], [1, 2, 0, 4])


def programs(context_tokens, num_kv_heads=8, page_size=16):
    """Split-K programs doing work, summed over a batch of decodes at these contexts."""
    tiles = [-(-c // 32) for c in context_tokens]
    slots = max_splits(len(tiles), num_kv_heads, -(-max(context_tokens) // page_size),
                       page_size)
    kv_tokens = jnp.int32(sum(context_tokens))
    used = 0
    for n in tiles:
        ranges = [split_range(jnp.int32(0), jnp.int32(n), kv_tokens, jnp.int32(s),
                              num_kv_heads=num_kv_heads, num_slots=slots) for s in range(slots)]
        covered = sorted(t for a, b in ranges for t in range(int(a), int(b)))
        assert covered == list(range(n))                 # the splits tile the sequence once
        used += sum(int(b) > int(a) for a, b in ranges)
    return used * num_kv_heads


def test_split_k_fills_the_gpu_without_a_cliff():
    """About TARGET_PROGRAMS (4 per SM) or more at every batch, 33 to 48 included; a single
    long sequence gets more than 16 splits, never shorter than MIN_TILES_PER_SPLIT tiles."""
    assert programs([4096] * 64) == 1024            # 2 splits each
    assert programs([4096] * 33) == TARGET_PROGRAMS  # 2 splits each: 528
    assert programs([4096] * 48) == 768
    assert programs([8192]) == 8 * 32               # 32 splits of 8 tiles
    assert programs([2048]) == 8 * 8                # 64 tiles: 8 splits of 8
    assert programs([200]) == 8 * 1                 # 7 tiles: not below 8 tiles a split
    # skewed: the bucket's 17 slots cap the long sequence (16 splits of 16 tiles), 7 x 1
    assert max_splits(8, 8, 512, 16) == 17
    assert programs([8192] + [64] * 7) == 8 * (16 + 7)
    assert MIN_TILES_PER_SPLIT == 8 and TARGET_PROGRAMS == 528
