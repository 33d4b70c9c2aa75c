"""KV cache groups: a model's layers grouped by attention kind, sharing one page pool.

A model that mixes full-attention layers with sliding-window ones (Gemma 2: alternating;
Gemma 3: five local layers of window 512 or 1024 to one global) needs, per sequence, every
page of its full layers but only the pages its sliding layers' window can still see. With one
page table for every layer (a page holding a token's K/V for *all* layers) the sliding layers
keep their whole history: 25% of Gemma 2's KV and most of Gemma 3's is dead (vllm#11382).

The grouping follows vLLM's hybrid allocator (``vllm/v1/core/kv_cache_utils.py``, "uniform
page size" grouping; ``kv_cache_coordinator.py``): layers of one kind (full, or sliding with
window ``w``) are cut, in layer order, into groups of ``slots`` layers, the same ``slots`` for
every kind, so a page of any group is ``slots`` layers' K/V for ``page_size`` tokens. The
device pool then holds ``slots`` pairs of ``[num_pages, page_size, kv_heads, head_dim]`` arrays
(not one pair per layer): layer ``i`` reads and writes pool slot :attr:`KVLayout.layer_slot`
``[i]`` through the page table of its group :attr:`KVLayout.layer_group` ``[i]``. Every group
draws page ids from the one free queue, so memory moves between kinds as sequences grow,
and each group holds per sequence only what its kind needs
(:class:`jaxpaged.core.hybrid_kv_cache_manager.HybridKVCacheManager`).

``slots`` is the smallest kind's layer count, or the largest's when every kind has within 25%
of it (vLLM's rule: few groups, little padding). A kind's last group may then be short: its
pages are whole pages of ``slots`` layers, so its empty slots are pool bytes no layer uses
(vLLM pads the same way). When more than :data:`MAX_PADDING` of the groups' slots would be
empty, ``slots`` is instead the largest count dividing every kind's (no padding; the better
strategy vLLM's ``_get_kv_cache_groups_uniform_page_size`` names in its FIXME, "20 full + 30
sw, where the group size should be 10") if that makes at most :data:`MAX_GROUPS` groups.
Gemma 3 27B (10 global, 52 local layers) goes from 10 slots (8 of 70 empty: its last local
group's 2 layers in pages of 10) to 2 slots in 31 groups, which brings an 8k sequence under
issue 45's bound (``tests/test_kv_groups.py``) at about 4x the allocator's host time; 1B (4
and 22 layers: 2 of 28 slots empty) keeps 4, 4B (5 and 29: 1 of 35) 5 and 12B (8 and 40) 8.

Pure Python, no JAX (host side); the runner reads the same :class:`KVLayout`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: The most groups a padding-free grouping may make: each group is one more page table per
#: sequence (host bookkeeping at every page a sequence opens, one more [B, P] table a step).
MAX_GROUPS = 32
#: The largest share of the groups' slots vLLM's grouping may leave empty before the
#: padding-free one replaces it (Gemma 3 1B's 7% stays; 27B's 11% goes).
MAX_PADDING = 1 / 10


@dataclass(frozen=True)
class KVGroup:
    """One KV cache group.

    Attributes:
        window: the sliding window W of its layers (a query at p reads keys
            ``p - W + 1 .. p``), None for full attention.
        layers: its layer indices, ascending (at most :attr:`KVLayout.slots`).
    """

    window: int | None
    layers: tuple[int, ...]


@dataclass(frozen=True)
class KVLayout:
    """How a hybrid model's layers share the pool (module docstring). Hashable: the runner
    keeps it as a static part of the model.

    Attributes:
        groups: the groups; group 0 is a full-attention one (its page table is the
            sequence's ``page_ids``, the others ride in ``group_page_ids``).
        slots: pool slots (layers' K/V arrays) a page spans.
        layer_slot, layer_group: per layer, its pool slot and its group.
    """

    groups: tuple[KVGroup, ...]
    slots: int
    layer_slot: tuple[int, ...]
    layer_group: tuple[int, ...]

    @property
    def num_layers(self) -> int:
        return len(self.layer_slot)

    def group_pages_per_seq(self, max_model_len: int, page_size: int,
                            max_num_batched_tokens: int) -> list[int]:
        """Pages each group may hold for one sequence of ``max_model_len`` tokens: a full
        group ``ceil(L / page_size)``, a sliding group the pages its window and the largest
        chunk can span, ``ceil((W - 1 + chunk) / page_size) + 1`` (no more than the full
        count; vLLM's ``SlidingWindowSpec.max_memory_usage_bytes``)."""
        full = -(-max_model_len // page_size)
        chunk = min(max_num_batched_tokens, max_model_len)
        return [full if g.window is None else min(full, -(-(g.window - 1 + chunk)
                                                          // page_size) + 1)
                for g in self.groups]

    def pages_per_seq(self, max_model_len: int, page_size: int,
                      max_num_batched_tokens: int) -> int:
        """Pages of the shared pool one ``max_model_len`` sequence may hold, all groups
        together (:meth:`group_pages_per_seq`): what the sizing and the logged maximum
        concurrency divide by."""
        return sum(self.group_pages_per_seq(max_model_len, page_size, max_num_batched_tokens))


def max_concurrency(num_pages: int, max_model_len: int, page_size: int,
                    max_num_batched_tokens: int, layout: KVLayout | None = None) -> float:
    """``max_model_len``-token requests a pool of ``num_pages`` pages (the null page
    included) holds at once: what start-up logs (vLLM's "maximum concurrency").

    One page table for every layer: ``(num_pages - 1) / ceil(L / page_size)``. With KV cache
    groups a decoding request holds ``ceil(L / page_size)`` pages in each full group and
    ``ceil((W - 1) / page_size) + 1`` in each sliding one; the step's prefill chunks (at most
    ``max_num_batched_tokens`` tokens in all) may hold up to
    ``ceil(max_num_batched_tokens / page_size) + 1`` more pages in each sliding group, kept
    aside first.
    """
    full = -(-max_model_len // page_size)
    if layout is None:
        return (num_pages - 1) / full
    per_seq, reserve = 0, 0
    for g in layout.groups:
        if g.window is None:
            per_seq += full
        else:
            per_seq += min(full, -(-(g.window - 1) // page_size) + 1)
            reserve += -(-min(max_num_batched_tokens, max_model_len) // page_size) + 1
    return max(0, num_pages - 1 - reserve) / per_seq


def kv_layout(sliding_windows, enabled: bool = True) -> KVLayout | None:
    """The groups of a model whose layers have ``sliding_windows`` (per layer: W, or None for
    full attention), or None when one page table serves every layer: a model of one kind
    (all full; all sliding, which :mod:`jaxpaged.core.sliding_window_pages` handles), or
    ``enabled`` False (speculative decoding, pipeline stages, fp8 scale calibration keep one
    page per token per layer).

    Raises:
        ValueError: a window below 1.
    """
    windows = tuple(sliding_windows)
    if not enabled or None not in windows or all(w is None for w in windows):
        return None
    if any(w is not None and w < 1 for w in windows):
        raise ValueError(f"sliding windows must be >= 1 token, got {windows}")
    kinds: dict[int | None, list[int]] = {None: []}      # full attention first: group 0
    for i, w in enumerate(windows):
        kinds.setdefault(w, []).append(i)
    slots = group_slots([len(layers) for layers in kinds.values()])
    groups, layer_slot, layer_group = [], [0] * len(windows), [0] * len(windows)
    for window, layers in kinds.items():
        for start in range(0, len(layers), slots):
            members = tuple(layers[start:start + slots])
            for slot, layer in enumerate(members):
                layer_slot[layer], layer_group[layer] = slot, len(groups)
            groups.append(KVGroup(window, members))
    return KVLayout(tuple(groups), slots, tuple(layer_slot), tuple(layer_group))


def group_slots(counts: list[int]) -> int:
    """Layers per group (a page's pool slots) for kinds of ``counts`` layers each (module
    docstring): vLLM's rule, or the counts' greatest common divisor when vLLM's would leave
    more than :data:`MAX_PADDING` of its slots empty and the divisor makes no more than
    :data:`MAX_GROUPS` groups."""
    slots = max(counts) if max(counts) * 4 < min(counts) * 5 else min(counts)
    padded = sum(-(-c // slots) for c in counts) * slots
    exact = math.gcd(*counts)
    if padded - sum(counts) > MAX_PADDING * padded and sum(counts) // exact <= MAX_GROUPS:
        return exact
    return slots
