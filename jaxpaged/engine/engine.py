"""`Engine`: requests in, `RequestOutput`s out, one scheduled model step at a time.

``step()`` = schedule (scheduler + KV cache manager) -> execute (model runner) -> append each
sampled token, detokenize it, check stop conditions, free the pages of finished requests.
Callers drive it themselves (``add_request`` / ``step`` / ``abort_request``) or through
:class:`jaxpaged.LLM`.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.config import ModelConfig
from jaxpaged.engine.arg_utils import EngineArgs
from jaxpaged.engine.detokenizer import IncrementalDetokenizer
from jaxpaged.engine.kv_cache_manager import KVCacheManager
from jaxpaged.engine.request import Request, RequestStatus
from jaxpaged.engine.scheduler import Scheduler, SchedulerConfig
from jaxpaged.layers.attention import allocate_kv_pool, get_attention_backend, kv_bytes_per_page
from jaxpaged.models.loader import load_model
from jaxpaged.outputs import CompletionOutput, RequestOutput
from jaxpaged.runner.model_runner import ModelRunner, RunnerLimits
from jaxpaged.sampling_params import SamplingParams
from jaxpaged.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

#: KV pool budget when neither a page count nor a byte budget is given and the device is
#: not a GPU (vLLM's CPU backend defaults to 4 GiB as well). The pool is further capped at
#: what ``max_num_seqs`` requests of ``max_model_len`` tokens can use.
DEFAULT_CPU_KV_CACHE_BYTES = 4 << 30
#: Fraction of a GPU's free memory the KV pool takes by default.
DEFAULT_GPU_KV_FRACTION = 0.9

Prompt = str | list[int] | dict


@dataclass
class _Tracked:
    request: Request
    detokenizer: IncrementalDetokenizer


class Engine:
    """The inference engine for one model.

    Args:
        args: the engine configuration.

    Raises:
        FileNotFoundError / UnsupportedModelError / MissingWeightsError: bad model directory.
        ValueError: inconsistent limits (e.g. a pool too small for one ``max_model_len``
            request, or ``max_model_len`` beyond the model's trained context).
    """

    def __init__(self, args: EngineArgs):
        self.args = args
        self.model_config = ModelConfig.from_pretrained(args.model)
        cfg = self.model_config
        self.tokenizer = load_tokenizer(args.tokenizer or args.model)
        self.dtype = _resolve_dtype(args.dtype, cfg.checkpoint_dtype)
        self.max_model_len = args.max_model_len or cfg.max_position_embeddings
        if self.max_model_len > cfg.max_position_embeddings:
            raise ValueError(f"max_model_len={self.max_model_len} exceeds the model's "
                             f"max_position_embeddings={cfg.max_position_embeddings}")
        self.eos_token_ids = _eos_token_ids(args.model, cfg, self.tokenizer)

        backend = get_attention_backend(
            args.attention_backend, num_kv_heads=cfg.num_kv_heads, num_heads=cfg.num_heads,
            head_dim=cfg.head_dim, page_size=args.block_size, dtype=self.dtype)
        model = load_model(args.model, cfg, dtype=self.dtype, backend=backend,
                           load_format=args.load_format, seed=args.seed)
        page_size = args.block_size
        pages_per_seq = -(-self.max_model_len // page_size)
        num_pages = self._num_pages(kv_bytes_per_page(cfg.num_layers, page_size, cfg.num_kv_heads,
                                                      cfg.head_dim, self.dtype), pages_per_seq)
        self.kv_cache_manager = KVCacheManager(num_pages, page_size)
        if self.kv_cache_manager.num_usable_pages < pages_per_seq:
            raise ValueError(
                f"the KV pool ({self.kv_cache_manager.num_usable_pages} usable pages of "
                f"{page_size} tokens) cannot hold one request of max_model_len="
                f"{self.max_model_len} tokens; give more KV memory or lower max_model_len")
        self.scheduler = Scheduler(
            SchedulerConfig(args.max_num_seqs, args.max_num_batched_tokens, self.max_model_len),
            self.kv_cache_manager)
        kv_caches = allocate_kv_pool(cfg.num_layers, num_pages, page_size, cfg.num_kv_heads,
                                     cfg.head_dim, self.dtype)
        self.runner = ModelRunner(model, kv_caches, backend, page_size, RunnerLimits(
            args.max_num_batched_tokens, args.max_num_seqs, pages_per_seq))
        self._requests: dict[str, _Tracked] = {}
        self._seed_rng = np.random.default_rng(args.seed)
        logger.info("model %s (%s, %d layers), dtype %s, max_model_len %d, attention %s",
                    args.model, cfg.architecture, cfg.num_layers, jnp.dtype(self.dtype).name,
                    self.max_model_len, backend.name)

    def _num_pages(self, bytes_per_page: int, pages_per_seq: int) -> int:
        args = self.args
        if args.num_gpu_blocks_override is not None:
            num_pages = args.num_gpu_blocks_override
        elif args.kv_cache_memory_bytes is not None:
            num_pages = args.kv_cache_memory_bytes // bytes_per_page
        elif jax.default_backend() == "gpu":
            stats = jax.devices()[0].memory_stats() or {}
            free = stats.get("bytes_limit", 0) - stats.get("bytes_in_use", 0)
            num_pages = int(free * DEFAULT_GPU_KV_FRACTION) // bytes_per_page
        else:
            num_pages = min(DEFAULT_CPU_KV_CACHE_BYTES // bytes_per_page,
                            args.max_num_seqs * pages_per_seq + 1)
        logger.info("KV cache: %d pages of %d tokens, %d bytes per page (%.1f MiB in all); "
                    "maximum concurrency for %d-token requests: %.2fx",
                    num_pages, args.block_size, bytes_per_page, num_pages * bytes_per_page / 2**20,
                    self.max_model_len, (num_pages - 1) / pages_per_seq)
        return num_pages

    # ---- requests -------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: Prompt,
                    params: SamplingParams | None = None) -> None:
        """Queue a request; it runs from the next :meth:`step`.

        Args:
            request_id: unique among unfinished requests.
            prompt: text, a list of token ids, or ``{"prompt_token_ids": [...]}`` /
                ``{"prompt": "..."}`` (vLLM's TokensPrompt / TextPrompt).
            params: sampling parameters (default ``SamplingParams()``).

        Raises:
            ValueError: duplicate id, empty prompt, token ids outside the vocabulary, or a
                prompt longer than ``max_model_len``. Nothing is queued then.
            TypeError: a prompt of another type.
        """
        params = params or SamplingParams()
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, ids = self._tokenize(prompt)
        seed = params.seed if params.seed is not None else int(self._seed_rng.integers(2**63))
        max_tokens = self.max_model_len - len(ids)
        if params.max_tokens is not None:
            max_tokens = min(max_tokens, params.max_tokens)
        req = Request(request_id, text, ids, params, seed=seed, max_tokens=max(max_tokens, 1))
        detok = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens,
                                       params.stop_strings, params.include_stop_str_in_output)
        self._requests[request_id] = _Tracked(req, detok)
        self.scheduler.add_request(req)

    def _tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a dict prompt needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)):
            if not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in prompt):
                raise TypeError("a token-id prompt must be a list of integers")
            text, ids = None, [int(t) for t in prompt]
        else:
            raise TypeError(f"prompt must be a string, a list of token ids or a dict, "
                            f"got {type(prompt).__name__}")
        if not ids:
            raise ValueError("the prompt is empty (no tokens)")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token ids {bad[:8]} are outside the vocabulary [0, {vocab})")
        if len(ids) > self.max_model_len:
            raise ValueError(f"the prompt (length {len(ids)}) is longer than the maximum "
                             f"model length of {self.max_model_len}")
        return text, ids

    def abort_request(self, request_id: str | list[str]) -> None:
        """Stop requests now and free their pages; unknown ids are ignored."""
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            tracked = self._requests.pop(rid, None)
            if tracked is not None:
                tracked.request.finish_reason = "abort"
                self.scheduler.finish_request(tracked.request)

    def has_unfinished_requests(self) -> bool:
        """True while any request is waiting or running."""
        return bool(self._requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self._requests)

    # ---- the step -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduling iteration and model step.

        Returns:
            An output for every request that produced a token this step (cumulative text and
            ids; ``finished`` set on the last one).
        """
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            return []
        tokens = self.runner.execute(sched, self.kv_cache_manager)
        outputs = []
        for s, token in zip(sched.scheduled, tokens):
            req = s.request
            req.num_computed_tokens += s.num_new_tokens
            if not s.samples:
                continue
            tracked = self._requests[req.request_id]
            self._append_token(tracked, token)
            if req.finish_reason is not None:
                self.scheduler.finish_request(req)
                del self._requests[req.request_id]
            outputs.append(self._output(tracked))
        return outputs

    def _append_token(self, tracked: _Tracked, token: int) -> None:
        """Record a sampled token and apply vLLM's stop rules (EOS, stop ids, stop strings,
        then length)."""
        req = tracked.request
        req.output_token_ids.append(token)
        p = req.params
        if not p.ignore_eos and token in self.eos_token_ids:
            req.finish_reason = "stop"
        elif token in p.stop_token_id_set:
            req.finish_reason, req.stop_reason = "stop", token
        else:
            stop = tracked.detokenizer.add_token(token)
            if stop is not None:
                req.finish_reason, req.stop_reason = "stop", stop
        if req.finish_reason is None and (len(req.output_token_ids) >= req.max_tokens
                                          or req.num_tokens >= self.max_model_len):
            req.finish_reason = "length"

    @staticmethod
    def _output(tracked: _Tracked) -> RequestOutput:
        req = tracked.request
        return RequestOutput(
            request_id=req.request_id, prompt=req.prompt, prompt_token_ids=req.prompt_token_ids,
            outputs=[CompletionOutput(0, tracked.detokenizer.text, list(req.output_token_ids),
                                      req.finish_reason, req.stop_reason)],
            finished=req.status is RequestStatus.FINISHED, num_preemptions=req.num_preemptions)

    # ---- stats ----------------------------------------------------------------------------

    @property
    def num_preemptions(self) -> int:
        """Preemptions since start-up."""
        return self.scheduler.num_preemptions


def _resolve_dtype(name: str, checkpoint_dtype: str):
    if name == "auto":
        name = "float32" if checkpoint_dtype in ("float32", "float64") else "bfloat16"
    return {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[name]


def _eos_token_ids(model_dir: str, cfg: ModelConfig, tokenizer) -> frozenset[int]:
    """EOS ids of the config, ``generation_config.json`` and the tokenizer, together."""
    ids = set(cfg.eos_token_ids)
    path = os.path.join(model_dir, "generation_config.json")
    if os.path.isfile(path):
        with open(path) as f:
            eos = json.load(f).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(int(i) for i in ids)
