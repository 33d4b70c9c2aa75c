"""`ModelRunner`: one scheduled step -> padded device arrays -> one compiled forward + sample.

The step takes the model's parameters, the donated KV pool and the batch, and returns the
sampled tokens (with their log-probabilities when asked) plus the updated pool. Arrays are
padded to buckets so the step compiles a bounded number of times:

- decode-only steps: T = B = a sequence bucket (8, 16, ... up to ``max_num_seqs``);
- steps with prefill chunks: T = a token bucket (16, 32, ... up to ``max_num_batched_tokens``)
  and B = the sequence bucket of min(T, ``max_num_seqs``);
- pages per sequence P: 4, 8, ... up to ``max_model_len / page_size``.

Each (T, B, P, decode-only, logprobs) shape is compiled ahead of time once and kept;
:meth:`ModelRunner.precompile` compiles every shape a logprob-free run can meet, and
:attr:`ModelRunner.num_compilations` counts compilations so one during serving is visible.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import jax
import numpy as np
from flax import nnx

from jaxpaged.distributed.multihost import to_host
from jaxpaged.engine.kv_cache_manager import KVCacheManager
from jaxpaged.engine.scheduler import SchedulerOutput
from jaxpaged.layers.attention import (NULL_PAGE, AttentionBackend, BatchLayout, KVPages,
                                       allocate_kv_pool)
from jaxpaged.sampling.logits_adjust import needs_adjustment, pack, row_adjustment
from jaxpaged.sampling.sampler import SamplingMetadata, sample, token_logprobs

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


@dataclass(frozen=True)
class SampleResult:
    """What one scheduled sequence got from a step (empty ``token_ids`` for a prefill chunk
    that does not reach the end of its tokens).

    Attributes:
        token_ids: one token per sample (``n_samples`` of them for a parallel-sampling prefill).
        logprobs: per token, the sampled token's log-probability (raw model distribution);
            None unless some request in the step asked for logprobs.
        ranks: per token, its rank in the distribution (1 = most likely).
        top_ids, top_logprobs: per token, the ``MAX_LOGPROBS`` most likely ids and their
            log-probabilities, best first.
        prompt_logprobs: for each prompt position this chunk computed that predicts a prompt
            token: (that token's logprob, its rank, top ids, top logprobs).
    """

    token_ids: list[int]
    logprobs: list[float] | None = None
    ranks: list[int] | None = None
    top_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None
    prompt_logprobs: list[tuple[float, int, list[int], list[float]]] | None = None


class ModelRunner:
    """Holds the model's parameters and the KV pool; executes scheduled steps.

    Args:
        model: the loaded NNX model (split once into graph and state here).
        kv_caches: the preallocated pool, one ``(k_pages, v_pages)`` per layer.
        backend: the attention backend the model was built with.
        page_size: tokens per page.
        limits: the largest padded shapes.
        eos_token_ids: the model's EOS ids (masked before a request's ``min_tokens``).
        replicated: the sharding of every per-step input and output (the whole mesh); the
            parameters and the pool keep the shardings they arrived with.
    """

    def __init__(self, model: nnx.Module, kv_caches: list[KVPages], backend: AttentionBackend,
                 page_size: int, limits: RunnerLimits, eos_token_ids: frozenset[int],
                 replicated: jax.sharding.Sharding):
        graphdef, self._state = nnx.split(model)
        self._kv_caches = kv_caches
        self._backend = backend
        self._page_size = page_size
        self._limits = limits
        self._token_buckets = bucket_sizes(16, max(16, limits.max_num_tokens))
        self._seq_buckets = bucket_sizes(8, max(8, limits.max_num_seqs))
        self._page_buckets = bucket_sizes(4, max(4, limits.max_pages_per_seq))
        self._executables: dict[tuple, object] = {}
        self._eos_token_ids = eos_token_ids

        def step(state, kv_caches, input_ids, prompt_targets, positions, logits_indices,
                 attn_metadata, sampling, adjust, with_logprobs, with_prompt_logprobs):
            model = nnx.merge(graphdef, state)
            hidden, kv_caches = model(input_ids, positions, kv_caches, attn_metadata)
            logits = model.compute_logits(hidden[logits_indices])
            out = sample(logits, sampling, with_logprobs, adjust)
            if with_prompt_logprobs:
                # Every token's distribution over the next prompt token (a chunk's last
                # token predicts the first token of the request's next chunk, which is not
                # among this step's inputs: the host passes every row's target).
                out["prompt"] = token_logprobs(model.compute_logits(hidden), prompt_targets)
            return out, kv_caches

        state_sharding = jax.tree.map(lambda a: a.sharding, self._state)
        kv_sharding = jax.tree.map(lambda a: a.sharding, kv_caches)
        rep = replicated
        self._step = jax.jit(step, donate_argnums=(1,), static_argnums=(9, 10),
                             in_shardings=(state_sharding, kv_sharding, rep, rep, rep, rep, rep,
                                           rep, rep),
                             out_shardings=(rep, kv_sharding))

        def copy_pages(kv_caches, src, dst):
            return [(k.at[dst].set(k[src]), v.at[dst].set(v[src])) for k, v in kv_caches]

        self._copy_pages = jax.jit(copy_pages, donate_argnums=(0,),
                                   in_shardings=(kv_sharding, rep, rep), out_shardings=kv_sharding)

        def prefill(state, kv_caches, input_ids, positions, attn_metadata):
            model = nnx.merge(graphdef, state)
            hidden, kv_caches = model(input_ids, positions, kv_caches, attn_metadata)
            return model.compute_logits(hidden), kv_caches

        # A scratch pool of any page count has the serving pool's per-array shardings.
        self._prefill = jax.jit(prefill, in_shardings=(state_sharding, kv_sharding, rep, rep, rep),
                                out_shardings=(rep, kv_sharding))

    @property
    def backend(self) -> AttentionBackend:
        return self._backend

    @property
    def weight_bytes(self) -> int:
        """Bytes of the model's parameters (each array counted once, however it is sharded):
        what ``--quantization`` shrinks."""
        return sum(x.nbytes for x in jax.tree.leaves(self._state))

    @property
    def num_compilations(self) -> int:
        """Step shapes compiled so far (a rise while serving means a recompilation)."""
        return len(self._executables)

    @property
    def kv_pool_lost(self) -> bool:
        """True when the KV pool's arrays are gone: a step that failed after the pool was
        donated to it (its contents cannot be recovered)."""
        return any(a.is_deleted() for pair in self._kv_caches for a in pair)

    def reallocate_kv_pool(self) -> None:
        """Replace the pool with a zero-filled one of the same layout (after
        :attr:`kv_pool_lost`); every page's contents are then gone."""
        k = self._kv_caches[0][0]
        self._kv_caches = allocate_kv_pool(len(self._kv_caches), *k.shape, k.dtype, k.sharding)

    # ---- execution ---------------------------------------------------------------------------

    def copy_pages(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole pages (source -> destination) in every layer, in place (copy-on-write)."""
        if not copies:
            return
        n = pick_bucket(bucket_sizes(4, max(4, len(copies))), len(copies))
        src = np.full(n, NULL_PAGE, np.int32)
        dst = np.full(n, NULL_PAGE, np.int32)
        src[:len(copies)], dst[:len(copies)] = zip(*copies)
        self._kv_caches = self._copy_pages(self._kv_caches, src, dst)

    def execute(self, sched: SchedulerOutput, kv: KVCacheManager) -> list[SampleResult]:
        """Run one step: pending page copies, then the forward pass and sampling.

        Args:
            sched: the scheduled sequences, in batch order.
            kv: their page tables (and pending copy-on-write copies).

        Returns:
            One :class:`SampleResult` per scheduled sequence.
        """
        self.copy_pages(kv.take_pending_copies())
        rows, owners, adjustments = [], [], []
        for i, s in enumerate(sched.scheduled):
            req, p = s.request, s.request.params
            n = req.n_samples if s.samples else 1
            adjustment = row_adjustment(p, req.prompt_token_ids, req.output_token_ids,
                                        self._eos_token_ids, req.bad_words_ids) \
                if s.samples and needs_adjustment(p) else None
            for j in range(n):
                rows.append((p.temperature, p.top_k, p.top_p, p.min_p, p.is_greedy,
                             req.seed + j, req.num_tokens))
                owners.append(i)
                adjustments.append(adjustment)
        with_logprobs = any(s.request.params.logprobs is not None for s in sched.scheduled)
        with_prompt = any(s.request.params.prompt_logprobs is not None
                          and s.start < s.request.num_prompt_tokens - 1 for s in sched.scheduled)
        layout, input_ids, prompt_targets, logits_indices = self._layout(sched, kv, owners,
                                                                         with_prompt)
        metadata = self._metadata(layout)
        sampling = SamplingMetadata.from_host(rows, layout.seq_lens.shape[0])
        adjust = (pack(adjustments, layout.seq_lens.shape[0])
                  if any(a is not None for a in adjustments) else None)
        fn = self._executable(layout, (with_logprobs, with_prompt), input_ids, prompt_targets,
                              logits_indices, metadata, sampling, adjust)
        out, self._kv_caches = fn(self._state, self._kv_caches, input_ids, prompt_targets,
                                  layout.positions, logits_indices, metadata, sampling, adjust)
        out = jax.tree.map(to_host, out)
        results: list[list[int]] = [[] for _ in sched.scheduled]
        for r, i in enumerate(owners):
            results[i].append(r)
        starts = layout.query_start_loc
        return [self._result(out, rs, s, int(starts[i]))
                for i, (rs, s) in enumerate(zip(results, sched.scheduled))]

    @staticmethod
    def _result(out, rows: list[int], s, first_token: int) -> SampleResult:
        prompt = None
        if s.request.params.prompt_logprobs is not None:
            # Positions p of this chunk that predict a prompt token (p + 1 < prompt length);
            # none for a one-token prompt, whose prompt logprobs are then just [None].
            end = min(s.start + s.num_new_tokens, s.request.num_prompt_tokens - 1)
            idx = [first_token + p - s.start for p in range(s.start, end)]
            p_out = out.get("prompt")
            prompt = [(float(p_out["logprobs"][t]), int(p_out["ranks"][t]),
                       p_out["top_ids"][t].tolist(), p_out["top_logprobs"][t].tolist())
                      for t in idx]
        if not s.samples:
            return SampleResult([], prompt_logprobs=prompt)
        tokens = [int(out["token_ids"][r]) for r in rows]
        if "logprobs" not in out:
            return SampleResult(tokens, prompt_logprobs=prompt)
        return SampleResult(tokens, [float(out["logprobs"][r]) for r in rows],
                            [int(out["ranks"][r]) for r in rows],
                            [out["top_ids"][r].tolist() for r in rows],
                            [out["top_logprobs"][r].tolist() for r in rows], prompt)

    def _executable(self, layout: BatchLayout, logprob_flags: tuple[bool, bool], input_ids,
                    prompt_targets, logits_indices, metadata, sampling, adjust):
        key = (layout.positions.shape[0], layout.seq_lens.shape[0], layout.page_table.shape[1],
               layout.is_decode_only, logprob_flags,
               None if adjust is None else (adjust.ids.shape[1], adjust.allowed_ids.shape[1]))
        fn = self._executables.get(key)
        if fn is None:
            t0 = time.perf_counter()
            fn = self._step.lower(self._state, self._kv_caches, input_ids, prompt_targets,
                                  layout.positions, logits_indices, metadata, sampling, adjust,
                                  *logprob_flags).compile()
            self._executables[key] = fn
            logger.debug("compiled step %s in %.2fs", key, time.perf_counter() - t0)
        return fn

    def _metadata(self, layout: BatchLayout) -> dict[str, np.ndarray]:
        metadata = self._backend.build_metadata(layout)
        metadata.update(slot_mapping=layout.slot_mapping, page_table=layout.page_table,
                        seq_lens=layout.seq_lens, query_start_loc=layout.query_start_loc,
                        positions=layout.positions)
        return metadata

    def run_prefill(self, token_ids: list[int]) -> tuple[np.ndarray, list[KVPages]]:
        """One whole-prompt prefill on a scratch pool, outside the serving path.

        The scratch pool is shaped like the serving pool (dtype, page size, heads, sharding)
        but holds only the prompt, in pages 1..n (page 0 stays the null page); the serving
        pool, the compiled steps and the KV cache manager are not touched. It shows what a
        prompt's K/V look like in this runner's cache (KV-scale calibration,
        ``jaxpaged.engine.kv_scales``) and what logits this configuration gives (accuracy
        measurements against reference logits).

        Args:
            token_ids: the prompt (compiled for its exact length, not a bucket; no step
                limit applies).

        Returns:
            ([T, vocab_size] float32 logits at every position, the scratch pool: one
            ``(k_pages, v_pages)`` of [n + 1, page_size, KVH, head_dim] per layer).

        Raises:
            ValueError: an empty prompt.
        """
        t = len(token_ids)
        if not t:
            raise ValueError("run_prefill needs at least one token")
        page_size = self._page_size
        num_pages = -(-t // page_size)
        k_pages = self._kv_caches[0][0]
        pool = allocate_kv_pool(len(self._kv_caches), num_pages + 1, page_size,
                                *k_pages.shape[2:], k_pages.dtype, k_pages.sharding)
        positions = np.arange(t, dtype=np.int32)
        pages = np.arange(1, num_pages + 1, dtype=np.int32)
        layout = BatchLayout(
            query_start_loc=np.array([0, t], np.int32), seq_lens=np.array([t], np.int32),
            positions=positions, slot_mapping=pages[positions // page_size] * page_size
            + positions % page_size, page_table=pages[None], num_seqs=1, num_tokens=t)
        logits, pool = self._prefill(self._state, pool, np.asarray(token_ids, np.int32),
                                     positions, self._metadata(layout))
        return to_host(logits), pool

    # ---- shapes ------------------------------------------------------------------------------

    def _pad_sizes(self, num_tokens: int, num_seqs: int, num_rows: int, max_pages: int,
                   decode_only: bool) -> tuple[int, int, int]:
        if decode_only:
            t_pad = b_pad = pick_bucket(self._seq_buckets, num_rows)
        else:
            t_pad = pick_bucket(self._token_buckets, num_tokens)
            b_pad = pick_bucket(self._seq_buckets,
                                max(num_rows, min(t_pad, self._limits.max_num_seqs)))
        return t_pad, b_pad, pick_bucket(self._page_buckets, max_pages)

    def _layout(self, sched: SchedulerOutput, kv: KVCacheManager, owners: list[int],
                with_prompt_targets: bool):
        num_seqs, num_tokens = len(sched.scheduled), sched.num_tokens
        max_pages = max(len(kv.page_table(s.request.request_id)) for s in sched.scheduled)
        t_pad, b_pad, p_pad = self._pad_sizes(num_tokens, num_seqs, len(owners), max_pages,
                                              num_tokens == num_seqs)
        input_ids = np.zeros(t_pad, np.int32)
        # each row's next prompt token, only for a step that scores prompts (None otherwise:
        # no host work or transfer)
        prompt_targets = np.zeros(t_pad, np.int32) if with_prompt_targets else None
        positions = np.zeros(t_pad, np.int32)
        slot_mapping = np.full(t_pad, NULL_PAGE * self._page_size, np.int32)
        page_table = np.full((b_pad, p_pad), NULL_PAGE, np.int32)
        seq_lens = np.zeros(b_pad, np.int32)
        query_start_loc = np.full(b_pad + 1, num_tokens, np.int32)
        last_token = np.zeros(num_seqs, np.int32)
        t = 0
        for i, s in enumerate(sched.scheduled):
            rid, start, n = s.request.request_id, s.start, s.num_new_tokens
            query_start_loc[i] = t
            input_ids[t:t + n] = s.request.all_token_ids[start:start + n]
            if prompt_targets is not None:
                following = s.request.all_token_ids[start + 1:start + n + 1]
                prompt_targets[t:t + len(following)] = following
            positions[t:t + n] = np.arange(start, start + n)
            slot_mapping[t:t + n] = kv.slots(rid, start, start + n)
            table = kv.page_table(rid)
            page_table[i, :len(table)] = table
            seq_lens[i] = start + n
            last_token[i] = t + n - 1
            t += n
        logits_indices = np.zeros(b_pad, np.int32)
        logits_indices[:len(owners)] = last_token[owners]
        layout = BatchLayout(query_start_loc=query_start_loc, seq_lens=seq_lens,
                             positions=positions, slot_mapping=slot_mapping,
                             page_table=page_table, num_seqs=num_seqs, num_tokens=num_tokens)
        return layout, input_ids, prompt_targets, logits_indices

    def _dummy_layout(self, t_pad: int, b_pad: int, p_pad: int, decode_only: bool):
        """A layout of the given padded shape whose tokens all write to the null page."""
        n_tokens = 1 if decode_only else 2
        return BatchLayout(
            query_start_loc=np.full(b_pad + 1, n_tokens, np.int32),
            seq_lens=np.zeros(b_pad, np.int32), positions=np.zeros(t_pad, np.int32),
            slot_mapping=np.zeros(t_pad, np.int32),
            page_table=np.zeros((b_pad, p_pad), np.int32), num_seqs=1, num_tokens=n_tokens)

    def _dummy_args(self, layout: BatchLayout):
        t_pad, b_pad = layout.positions.shape[0], layout.seq_lens.shape[0]
        return (np.zeros(t_pad, np.int32), None, np.zeros(b_pad, np.int32),
                self._metadata(layout), SamplingMetadata.from_host([], b_pad), None)

    def profile_peak_bytes(self) -> int | None:
        """Run the largest prefill step once on dummy data; the device's peak bytes in use
        afterwards (None if the device keeps no memory statistics)."""
        t_pad = self._token_buckets[-1]
        _, b_pad, _ = self._pad_sizes(t_pad, 1, 1, 1, False)
        layout = self._dummy_layout(t_pad, b_pad, self._page_buckets[-1], False)
        args = self._dummy_args(layout)
        fn = self._executable(layout, (True, False), *args)
        input_ids, prompt_targets, logits_indices, metadata, sampling, adjust = args
        out, self._kv_caches = fn(self._state, self._kv_caches, input_ids, prompt_targets,
                                  layout.positions, logits_indices, metadata, sampling, adjust)
        jax.block_until_ready(out)
        stats = jax.local_devices()[0].memory_stats()
        return None if not stats else stats.get("peak_bytes_in_use")

    def precompile(self, should_stop: Callable[[], bool] = lambda: False) -> float:
        """Compile every step shape a run without logprobs can meet, unless ``should_stop``
        turns true between two shapes (the rest then compile lazily); returns seconds taken."""
        t0 = time.perf_counter()
        shapes = {(b, b, p, True) for b in self._seq_buckets for p in self._page_buckets}
        for t in self._token_buckets:
            _, b, _ = self._pad_sizes(t, 1, 1, 1, False)
            shapes.update((t, b, p, False) for p in self._page_buckets)
        for shape in sorted(shapes):
            if should_stop():
                break
            layout = self._dummy_layout(*shape)
            self._executable(layout, (False, False), *self._dummy_args(layout))
        return time.perf_counter() - t0
