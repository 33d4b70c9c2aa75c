"""Draft-model proposals: a smaller model with the target's vocabulary proposes k tokens per
sequence greedily, on its own KV pool indexed by the target's page tables.

The draft's pool has the target's page count and page size, so a sequence's page table
(and slot mapping) addresses both pools: draft page i holds the draft K/V of the positions
target page i holds, and no second KV cache manager exists. The scheduler allocates a
speculating sequence's ``1 + m`` slots and leaves ``m`` placeholders
(``SpecDecodeScheduling.drafts``); before the step is dispatched
:meth:`DraftModelProposer.propose` runs the draft through its own :class:`ModelRunner`'s
``execute``: one catch-up forward over the tokens it has no K/V for (a prompt's whole
prefill the first time, in chunks of the token budget; afterwards usually the one or two
tokens the last verification emitted) whose last logits give d_0, then m - 1 one-token
decode steps giving d_1 .. d_{m-1}, dispatched back to back (each reads the previous one's
sample on the device) and read once at the end. It writes positions up to ``T + m - 2`` (T: the
sequence's tokens), inside the ``T + m`` slots allocated.

Proposals are the argmax, so q is a point mass at each and the rejection sampler
(``jaxpaged.sampling.rejection``) stays exact unchanged: vLLM v1 does the same (its
``EagleProposer.propose``, ``vllm/v1/spec_decode/eagle.py``, takes the argmax of the draft
logits, and ``GPUModelRunner`` passes no draft probabilities to its ``RejectionSampler``).
The draft's own sampling parameters are greedy and its own; the request's seed, penalties
and logit adjustments never reach it.

What the draft has K/V for is tracked per request: the positions before the length ``T``
it last proposed at, plus those of its written proposals d_0 .. d_{m-2} that turned out to
be the request's tokens (the accepted ones: the same token at the same position after
correct K/V gives the same K/V). That is ``min(its count, num_computed_tokens)`` after the
verification, read off the request's tokens, so no hook after the step is needed. A
preemption (the request's ``num_preemptions`` changed) or a new request object under the
id starts it at 0; finished requests are dropped. Every step's page copies
(copy-on-write) are applied to the draft pool too.

A prefix-cache hit skips the target's cached prompt tokens, but the draft computes its
K/V for the whole prompt on its first catch-up, writing draft slots of pages it shares with
other sequences: the same tokens at the same positions, so the same values up to the last
bits of another step shape (at worst another draft proposal; the verification does not
depend on the draft's K/V). Host bookkeeping is plain Python; the draft runner is JAX.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from jaxpaged.config import ModelConfig, UnsupportedModelError
from jaxpaged.distributed.tensor_parallel import TensorParallel
from jaxpaged.arg_utils import EngineArgs
from jaxpaged.core.scheduler_config import SchedulerConfig
from jaxpaged.engine_config import LoadConfig
from jaxpaged.core.request import Request
from jaxpaged.core.scheduler_output import ScheduledRequest, SchedulerOutput
from jaxpaged.layers.attention import allocate_kv_pool, get_attention_backend, kv_bytes_per_page
from jaxpaged.models.loader import MissingWeightsError, has_weights, load_model
from jaxpaged.runner.compile_cache import resolve_cache_dir
from jaxpaged.runner.model_runner import ModelRunner, RunnerLimits
from jaxpaged.runner.worker import Worker, resolve_dtype
from jaxpaged.sampling_params import SamplingParams
from jaxpaged.core.spec_decode.config import SpeculativeConfig, SpeculativeConfigError

logger = logging.getLogger(__name__)

#: The draft's sampling: argmax (q a point mass), nothing of the request's.
_GREEDY = SamplingParams(temperature=0.0, max_tokens=1)


@dataclass(frozen=True)
class DraftModel:
    """A checked draft model, before it is loaded.

    Attributes:
        path: its directory or GGUF file (``speculative_config.model``).
        config: its ``config.json``.
        dtype: the compute dtype (the target's) of its weights and its KV pool.
        load: the engine's load config (load format, seed, compilation cache).
        attention_backend: the engine's ``--attention-backend``.
        scheduler_config: the engine's step limits and ``max_model_len``.
    """

    path: str
    config: ModelConfig
    dtype: object
    load: LoadConfig
    attention_backend: str
    scheduler_config: SchedulerConfig

    @property
    def max_model_len(self) -> int:
        """The engine's length limit."""
        return self.scheduler_config.max_model_len

    @classmethod
    def check(cls, spec: SpeculativeConfig | None, target: ModelConfig, *, load: LoadConfig,
              attention_backend: str, scheduler_config: SchedulerConfig) -> DraftModel | None:
        """The draft of ``spec`` (None unless ``method="draft_model"``) for ``target``,
        under the engine's configs.

        Raises:
            SpeculativeConfigError: ``field="model"``: no readable config or no weights
                file, another vocabulary size than the target's, a context shorter than
                ``max_model_len``. (Engine settings a draft does not combine with are
                refused by ``EngineArgs`` already: ``SpeculativeConfig.check_engine``.)
        """
        if spec is None or spec.method != "draft_model":
            return None
        max_model_len = scheduler_config.max_model_len
        try:
            config = ModelConfig.from_pretrained(spec.model)
        except (OSError, ValueError) as e:
            raise SpeculativeConfigError("model", f"cannot read the draft model: {e}") from e
        if config.vocab_size != target.vocab_size:
            raise SpeculativeConfigError(
                "model", f"the draft's vocab_size {config.vocab_size} differs from the "
                f"target's {target.vocab_size} (draft and target must share the tokenizer)")
        if load.load_format != "dummy" and not has_weights(spec.model):
            raise SpeculativeConfigError(
                "model", f"no weights in {spec.model!r} (a model.safetensors, a "
                "model.safetensors.index.json with its shards, or a .gguf file)")
        if config.max_position_embeddings < max_model_len:
            raise SpeculativeConfigError(
                "model", f"the draft's max_position_embeddings "
                f"{config.max_position_embeddings} is below max_model_len={max_model_len}")
        return cls(spec.model, config, resolve_dtype(load.dtype, target.checkpoint_dtype),
                   load, attention_backend, scheduler_config)

    def kv_bytes_per_page(self, page_size: int) -> int:
        """Bytes one page of the draft's pool takes (all its layers, K and V)."""
        c = self.config
        return kv_bytes_per_page(c.num_layers, page_size, c.num_kv_heads, c.head_dim, self.dtype)

    def build(self, worker: Worker, num_speculative_tokens: int) -> DraftModelProposer:
        """Load the draft onto the target's first device with its own ``ModelRunner``
        (the target's attention backend, page size and page count, as
        ``jaxpaged.runner.worker.build_worker`` builds one) and return its proposer."""
        load, limits, cfg = self.load, self.scheduler_config, self.config
        page_size = worker.page_size
        tp = TensorParallel.create(1, cfg, worker.runner.devices[:1])
        backend = get_attention_backend(
            self.attention_backend, num_kv_heads=cfg.num_kv_heads, num_heads=cfg.num_heads,
            head_dim=cfg.head_dim, page_size=page_size, dtype=self.dtype,
            kv_cache_dtype=self.dtype)
        try:
            model = load_model(self.path, cfg, dtype=self.dtype, backend=backend,
                               load_format=load.load_format, seed=load.seed, tp=tp)
        except (MissingWeightsError, UnsupportedModelError, FileNotFoundError) as e:
            raise SpeculativeConfigError("model", f"cannot load the draft model: {e}") from e
        pool = allocate_kv_pool(cfg.num_layers, worker.num_pages, page_size,
                                tp.physical_config(cfg).num_kv_heads, cfg.head_dim,
                                self.dtype, tp.kv_pool_sharding)
        cache_dir = resolve_cache_dir(load.compilation_cache_dir)
        runner = ModelRunner(
            model, pool, backend, page_size=page_size, replicated=tp.replicated,
            executable_dir=cache_dir and os.path.join(cache_dir, "steps"),
            limits=RunnerLimits(max_num_tokens=limits.max_num_batched_tokens,
                                max_num_seqs=limits.max_num_seqs,
                                max_pages_per_seq=-(-self.max_model_len // page_size),
                                vocab_size=cfg.vocab_size))
        logger.info("draft model %s (%s, %d layers, weights %.1f MiB): KV pool of %d pages "
                    "of %d tokens, %.1f MiB on top of the target's", self.path,
                    cfg.architecture, cfg.num_layers, runner.weight_bytes / 2**20,
                    worker.num_pages, page_size,
                    worker.num_pages * self.kv_bytes_per_page(page_size) / 2**20)
        return DraftModelProposer(runner, num_speculative_tokens,
                                  limits.max_num_batched_tokens, limits.max_num_seqs)


def check_draft_model(args: EngineArgs) -> None:
    """The checks of :meth:`DraftModel.check` from the flags alone (the target's and the
    draft's ``config.json``), for ``jaxpaged serve`` to refuse a bad draft before it starts
    listening; nothing without ``method="draft_model"``.

    Raises:
        SpeculativeConfigError: as :meth:`DraftModel.check`.
    """
    spec = SpeculativeConfig.from_dict(args.speculative_config)
    if spec is None or spec.method != "draft_model":
        return
    target = ModelConfig.from_pretrained(args.model)
    DraftModel.check(spec, target, load=args.create_load_config(),
                     attention_backend=args.attention_backend,
                     scheduler_config=args.create_scheduler_config(
                         args.max_model_len or target.max_position_embeddings))



@dataclass
class _Known:
    """What the draft has K/V for, for one request (see the module docstring)."""

    request: Request
    num_preemptions: int
    length: int          # T when it last proposed: positions 0 .. T-1 are known
    written: list[int]   # the proposals written at positions T, T+1, ...

    def count(self, token_ids: list[int]) -> int:
        """Known positions now: ``length`` plus the leading written proposals that are
        the request's tokens."""
        n = self.length
        for j, token in enumerate(self.written):
            if n >= len(token_ids) or token_ids[n] != token:
                break
            n = self.length + j + 1
        return n


class DraftModelProposer:
    """Fills a scheduled step's draft placeholders with the draft model's greedy tokens.

    Args:
        runner: the draft's runner (its pool: the target's page count and page size).
        num_speculative_tokens: k.
        max_num_tokens, max_num_seqs: one draft step's limits (the target's).
    """

    def __init__(self, runner: ModelRunner, num_speculative_tokens: int, max_num_tokens: int,
                 max_num_seqs: int):
        self.runner = runner
        self.k = num_speculative_tokens
        self.max_num_tokens = max_num_tokens
        self.max_num_seqs = max_num_seqs
        self._known: dict[str, _Known] = {}

    @property
    def num_compilations(self) -> int:
        """Executables of the draft runner (see ``ModelRunner.num_compilations``)."""
        return self.runner.num_compilations

    def known(self, s: ScheduledRequest) -> int:
        """Positions of ``s``'s sequence the draft has K/V for (at most ``s.start``: the
        decode token is always fed, its logits give d_0)."""
        req = s.request
        state = self._known.get(req.request_id)
        if state is None or state.request is not req \
                or state.num_preemptions != req.num_preemptions:
            return 0
        return min(state.count(req.all_token_ids), s.start)

    def propose(self, scheduler_output: SchedulerOutput) -> None:
        """Apply the step's page copies to the draft pool, then fill every
        ``draft_token_ids`` placeholder list of the step in place (its length is the
        number of proposals the scheduler allotted).

        Raises:
            whatever the draft runner raises (the engine fails the step's requests; a
            draft pool lost in it is reallocated, and its K/V recomputed, next time).
        """
        runner = self.runner
        if runner.kv_pool_lost:
            runner.reallocate_kv_pool()
            self._known.clear()
        runner.copy_pages(scheduler_output.page_copies)
        for rid in [r for r, st in self._known.items() if st.request.is_finished]:
            del self._known[rid]
        seqs = [s for s in scheduler_output.scheduled if s.draft_token_ids]
        if not seqs:
            return
        # The draft's own copy of each sequence: greedy, its tokens plus the proposals.
        drafts = [Request(s.request.request_id, None, s.request.prompt_token_ids, _GREEDY,
                          seed=0, max_tokens=1, all_token_ids=list(s.request.all_token_ids))
                  for s in seqs]
        self._catch_up(seqs, drafts)
        # The decode steps run back to back: from the second on, each step's input token
        # is the previous step's sample, read on the device (``prev_token_index``, as
        # under async scheduling), and the host reads all their tokens at the end.
        pending = []
        for j in range(1, max(len(s.draft_token_ids) for s in seqs)):
            live = [i for i, s in enumerate(seqs) if len(s.draft_token_ids) > j]
            pending.append((live, self.runner.dispatch(SchedulerOutput([
                ScheduledRequest(drafts[i], len(seqs[i].request.all_token_ids) + j - 1, 1,
                                 seqs[i].page_ids, True, 1) for i in live]))))
        for live, step in pending:
            for i, tokens in zip(live, step.result().sampled_token_ids, strict=True):
                drafts[i].all_token_ids.extend(tokens)
        for s, d in zip(seqs, drafts):
            length = len(s.request.all_token_ids)
            s.draft_token_ids[:] = d.all_token_ids[length:]
            self._known[s.request.request_id] = _Known(
                s.request, s.request.num_preemptions, length, d.all_token_ids[length:-1])

    def _catch_up(self, seqs: list[ScheduledRequest], drafts: list[Request]) -> None:
        """Feed each sequence's tokens from what the draft knows to its decode token, in
        steps of at most ``max_num_tokens`` tokens and ``max_num_seqs`` sequences; each
        sequence's last chunk appends d_0 to its draft's tokens."""
        pos = [self.known(s) for s in seqs]
        ends = [s.start + 1 for s in seqs]
        todo = list(range(len(seqs)))
        while todo:
            batch, budget = [], self.max_num_tokens
            for i in todo[:self.max_num_seqs]:
                n = min(ends[i] - pos[i], budget)
                if n <= 0:
                    break
                last = pos[i] + n == ends[i]
                batch.append((i, ScheduledRequest(drafts[i], pos[i], n, seqs[i].page_ids,
                                                  last, int(last))))
                budget -= n
            self._run([b for _, b in batch], [drafts[i] for i, _ in batch])
            for i, b in batch:
                pos[i] = b.end
            todo = [i for i in todo if pos[i] < ends[i]]

    def _run(self, scheduled: list[ScheduledRequest], drafts: list[Request]) -> None:
        """One draft step; each sampling sequence's argmax is appended to its tokens."""
        out = self.runner.execute(SchedulerOutput(scheduled))
        for d, tokens in zip(drafts, out.sampled_token_ids, strict=True):
            d.all_token_ids.extend(tokens)

