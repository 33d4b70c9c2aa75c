"""``ModelRunner.run_prefill``: one whole prompt on a scratch KV pool, outside the serving path
(KV-scale calibration, ``jaxpaged.runner.kv_scales``; accuracy measurements against reference
logits)."""

from __future__ import annotations

import numpy as np

from jaxpaged.distributed.multihost import to_host
from jaxpaged.layers.attention import BatchLayout, KVPages, allocate_kv_pool
from jaxpaged.runner.input_batch import attention_metadata


class ScratchPrefill:
    """A base of ``ModelRunner`` (it reads the runner's pool shape, page size, programs, model
    state and backend)."""

    def run_prefill(self, token_ids: list[int]) -> tuple[np.ndarray, list[KVPages]]:
        """One whole-prompt prefill on a scratch pool, outside the serving path.

        The scratch pool is shaped like the serving pool (dtype, page size, heads, sharding)
        but holds only the prompt, in pages 1..n (page 0 stays the null page); the serving
        pool, the compiled steps and the KV cache manager are not touched. It shows what a
        prompt's K/V look like in this runner's cache (KV-scale calibration,
        ``jaxpaged.runner.kv_scales``) and what logits this configuration gives (accuracy
        measurements against reference logits).

        Args:
            token_ids: the prompt (compiled for its exact length, not a bucket; no step
                limit applies).

        Returns:
            ([T, vocab_size] float32 logits at every position, the scratch pool: one
            ``(k_pages, v_pages)`` of [n + 1, page_size, KVH, head_dim] per layer; with KV
            cache groups one per pool slot, of [G * n + 1, ...], group k in pages
            ``1 + k * n ..``).

        Raises:
            ValueError: an empty prompt.
            PipelineParallelError: a runner of pipeline stages.
        """
        self._executor.refuse("run_prefill")
        t = len(token_ids)
        if not t:
            raise ValueError("run_prefill needs at least one token")
        page_size = self._page_size
        num_pages = -(-t // page_size)
        groups = self.num_kv_groups          # (each KV cache group gets its own pages)
        k_pages = self._kv_caches[0][0]
        pool = allocate_kv_pool(len(self._kv_caches), groups * num_pages + 1, page_size,
                                *k_pages.shape[2:], k_pages.dtype, k_pages.sharding)
        positions = np.arange(t, dtype=np.int32)
        pages = 1 + np.arange(groups * num_pages, dtype=np.int32).reshape(groups, num_pages)
        slots = pages[:, positions // page_size] * page_size + positions % page_size
        layout = BatchLayout(
            query_start_loc=np.array([0, t], np.int32), seq_lens=np.array([t], np.int32),
            positions=positions, slot_mapping=slots[0], page_table=pages[:1], num_seqs=1,
            num_tokens=t, group_page_tables=pages[1:, None] if groups > 1 else None,
            group_slot_mappings=slots[1:] if groups > 1 else None)
        logits, pool = self._programs.prefill(self._state_leaves, pool,
                                              np.asarray(token_ids, np.int32), positions,
                                              attention_metadata(self._backend, layout))
        return to_host(logits), pool
