"""`ModelRunner`: one scheduled step -> padded device arrays -> one jitted forward + sample.

The jitted step takes the model's parameters, the donated KV pool and the batch, and returns
the sampled token of every sequence plus the updated pool. Arrays are padded to buckets
(powers of two, capped by the engine limits) in three sizes: tokens T, sequences B and pages
per sequence P, so the step compiles at most once per (T, B, P, decode-only) combination.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import jax
import numpy as np
from flax import nnx

from jaxpaged.engine.kv_cache_manager import KVCacheManager
from jaxpaged.engine.scheduler import SchedulerOutput
from jaxpaged.layers.attention import NULL_PAGE, AttentionBackend, BatchLayout, KVPages
from jaxpaged.sampling.sampler import SamplingMetadata, sample

logger = logging.getLogger(__name__)


def bucket_sizes(smallest: int, largest: int) -> list[int]:
    """Powers of two from ``smallest`` up to (and ending exactly at) ``largest``."""
    sizes, s = [], smallest
    while s < largest:
        sizes.append(s)
        s *= 2
    sizes.append(largest)
    return sizes


def pick_bucket(sizes: list[int], n: int) -> int:
    """The smallest bucket >= n.

    Raises:
        ValueError: ``n`` exceeds the largest bucket.
    """
    for s in sizes:
        if s >= n:
            return s
    raise ValueError(f"{n} exceeds the largest bucket {sizes[-1]}")


@dataclass(frozen=True)
class RunnerLimits:
    """Largest shapes the runner pads to.

    Attributes:
        max_num_tokens: tokens per step (``max_num_batched_tokens``).
        max_num_seqs: sequences per step.
        max_pages_per_seq: pages of a ``max_model_len`` sequence.
    """

    max_num_tokens: int
    max_num_seqs: int
    max_pages_per_seq: int


class ModelRunner:
    """Holds the model's parameters and the KV pool; executes scheduled steps.

    Args:
        model: the loaded NNX model (split once into graph and state here).
        kv_caches: the preallocated pool, one ``(k_pages, v_pages)`` per layer.
        backend: the attention backend the model was built with.
        page_size: tokens per page.
        limits: the largest padded shapes.
    """

    def __init__(self, model: nnx.Module, kv_caches: list[KVPages], backend: AttentionBackend,
                 page_size: int, limits: RunnerLimits):
        graphdef, self._state = nnx.split(model)
        self._kv_caches = kv_caches
        self._backend = backend
        self._page_size = page_size
        self._token_buckets = bucket_sizes(16, max(16, limits.max_num_tokens))
        self._seq_buckets = bucket_sizes(8, max(8, limits.max_num_seqs))
        self._page_buckets = bucket_sizes(4, max(4, limits.max_pages_per_seq))

        def step(state, kv_caches, input_ids, positions, logits_indices, attn_metadata, sampling):
            model = nnx.merge(graphdef, state)
            hidden, kv_caches = model(input_ids, positions, kv_caches, attn_metadata)
            logits = model.compute_logits(hidden[logits_indices])
            return sample(logits, sampling), kv_caches

        self._step = jax.jit(step, donate_argnums=(1,))

    def execute(self, sched: SchedulerOutput, kv: KVCacheManager) -> list[int]:
        """Run one step.

        Args:
            sched: the scheduled requests, in batch order.
            kv: the page tables of those requests.

        Returns:
            One sampled token per scheduled request (meaningless where the request's chunk
            does not reach its last token).
        """
        layout, input_ids, logits_indices = self._layout(sched, kv)
        metadata = self._backend.build_metadata(layout)
        metadata.update(slot_mapping=layout.slot_mapping, page_table=layout.page_table,
                        seq_lens=layout.seq_lens, query_start_loc=layout.query_start_loc,
                        positions=layout.positions)
        rows = []
        for s in sched.scheduled:
            p = s.request.params
            rows.append((p.temperature, p.top_k, p.top_p, p.min_p, p.is_greedy,
                         s.request.seed, s.request.num_tokens))
        sampling = SamplingMetadata.from_host(rows, layout.seq_lens.shape[0])
        tokens, self._kv_caches = self._step(self._state, self._kv_caches, input_ids,
                                             layout.positions, logits_indices, metadata, sampling)
        return np.asarray(tokens)[: layout.num_seqs].tolist()

    def _layout(self, sched: SchedulerOutput, kv: KVCacheManager):
        num_seqs, num_tokens = len(sched.scheduled), sched.num_tokens
        t_pad = pick_bucket(self._token_buckets, num_tokens)
        b_pad = pick_bucket(self._seq_buckets, num_seqs)
        max_pages = max(len(kv.page_table(s.request.request_id)) for s in sched.scheduled)
        p_pad = pick_bucket(self._page_buckets, max_pages)

        input_ids = np.zeros(t_pad, np.int32)
        positions = np.zeros(t_pad, np.int32)
        slot_mapping = np.full(t_pad, NULL_PAGE * self._page_size, np.int32)
        page_table = np.full((b_pad, p_pad), NULL_PAGE, np.int32)
        seq_lens = np.zeros(b_pad, np.int32)
        query_start_loc = np.full(b_pad + 1, num_tokens, np.int32)
        logits_indices = np.zeros(b_pad, np.int32)
        t = 0
        for i, s in enumerate(sched.scheduled):
            rid, start, n = s.request.request_id, s.start, s.num_new_tokens
            query_start_loc[i] = t
            input_ids[t:t + n] = s.request.token_ids(start, start + n)
            positions[t:t + n] = np.arange(start, start + n)
            slot_mapping[t:t + n] = kv.slots(rid, start, start + n)
            table = kv.page_table(rid)
            page_table[i, :len(table)] = table
            seq_lens[i] = start + n
            logits_indices[i] = t + n - 1
            t += n
        layout = BatchLayout(query_start_loc=query_start_loc, seq_lens=seq_lens,
                             positions=positions, slot_mapping=slot_mapping,
                             page_table=page_table, num_seqs=num_seqs, num_tokens=num_tokens)
        return layout, input_ids, logits_indices
