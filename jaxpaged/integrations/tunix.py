"""A tunix rollout sampler backed by jaxpaged (``pip install "jaxpaged[tunix]"``).

:class:`JaxpagedSampler` implements tunix's sampler contract
(``tunix/generate/base_sampler.py`` of google-tunix 0.1.7: ``transformer``,
``transformer_state``, ``__call__(input_strings, max_generation_steps, ...)`` returning a
``SamplerOutput``, ``tokenize``; and, as tunix's vLLM and sglang-jax samplers,
``update_params`` and ``load_checkpoint``), plus ``delete_cache`` / ``reinitialize_cache``
over sleep mode. Rollouts run on jaxpaged's paged engine (continuous batching, prefix
caching) on any JAX backend, NVIDIA GPUs included; new policy weights go in place without
recompiling (``jaxpaged.engine.rollout``).

With tunix installed the class derives from tunix's ``BaseSampler`` and returns its
``SamplerOutput``; without it, from stand-ins with the same fields, so the adapter works
(and is tested) either way.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable

import numpy as np
from flax import nnx

from jaxpaged.entrypoints.llm import LLM
from jaxpaged.sampling_params import SamplingParams

try:        # (tunix's package imports its trainers: only with the whole package installed)
    from tunix.generate.base_sampler import BaseSampler, SamplerOutput
    HAVE_TUNIX = True
except ImportError:
    HAVE_TUNIX = False

    class BaseSampler(abc.ABC):     # noqa: D101 - tunix's, absent
        pass

    @dataclasses.dataclass
    class SamplerOutput:
        """tunix's ``SamplerOutput`` fields (used when tunix is not installed)."""

        text: list[str]
        logits: list | None
        tokens: list[np.ndarray]
        padded_prompt_tokens: np.ndarray
        logprobs: list | None


class JaxpagedSampler(BaseSampler):
    """tunix's sampler contract over a jaxpaged :class:`~jaxpaged.LLM`.

    Args:
        llm: the engine to sample from (or ``engine_args`` to build one).
        to_hf: turns what a trainer passes to :meth:`update_params` (its model's
            ``nnx.State``) into Hugging Face tensor names -> arrays; None: the weights are
            already such a mapping, or an NNX state of jaxpaged's own model paths.
        **engine_args: ``LLM(**engine_args)`` when ``llm`` is None.
    """

    def __init__(self, llm: LLM | None = None, *,
                 to_hf: Callable[[object], dict] | None = None, **engine_args):
        self.llm = llm if llm is not None else LLM(**engine_args)
        self.to_hf = to_hf
        self.tokenizer = self.llm.get_tokenizer()

    # ---- tunix's contract --------------------------------------------------------------

    @property
    def transformer(self) -> nnx.Module:
        """The served model, merged from the engine's current state."""
        return nnx.merge(*self.llm.engine.runner.state)

    @property
    def transformer_state(self) -> nnx.State:
        """The served parameters (jaxpaged's paths)."""
        return self.llm.engine.runner.state[1]

    def tokenize(self, input_string: str) -> list[int]:
        """The prompt's token ids as the engine encodes it (BOS included when the tokenizer
        adds one)."""
        return list(self.tokenizer.encode(input_string))

    @property
    def pad_id(self) -> int:
        pad = getattr(self.tokenizer, "pad_token_id", None)
        return 0 if pad is None else int(pad)

    def __call__(self, input_strings: str | list[str], max_generation_steps: int,
                 max_prompt_length: int | None = None, temperature: float = 0.0,
                 top_p: float | None = None, top_k: int | None = None,
                 beam_size: int | None = None, seed: int | list[int] | None = None,
                 multi_sampling: int = 1, return_logits: bool = True, echo: bool = False,
                 pad_output: bool = False, **kwargs) -> SamplerOutput:
        """Sample ``multi_sampling`` completions of each input, at most
        ``max_generation_steps`` tokens each.

        Returns:
            A ``SamplerOutput``: ``text`` and ``tokens`` (int32 arrays; with ``echo`` the
            prompt first; with ``pad_output`` right-padded to ``max_generation_steps``) per
            sample, input by input; ``logprobs``: each sample's sampled-token logprobs
            (float32 arrays, the model's raw log-softmax); ``padded_prompt_tokens``: the
            prompts left-padded to ``max_prompt_length`` (default: the next power of two of
            the longest); ``logits``: None (per-step logits are not kept).

        Raises:
            NotImplementedError: ``beam_size``.
            ValueError: bad sampling values (``SamplingParams``'s checks) or a ``seed`` list
                of the wrong length.
        """
        if beam_size is not None:
            raise NotImplementedError("beam search is not supported by jaxpaged's sampler")
        strings = [input_strings] if isinstance(input_strings, str) else list(input_strings)
        seeds = seed if isinstance(seed, (list, tuple)) else [seed] * len(strings)
        if len(seeds) != len(strings):
            raise ValueError(f"seed: {len(seeds)} seeds for {len(strings)} input strings")
        prompts = [self.tokenize(s) for s in strings]
        params = [SamplingParams(n=multi_sampling, temperature=temperature,
                                 top_p=1.0 if top_p is None else top_p,
                                 top_k=0 if top_k is None else top_k, seed=s,
                                 max_tokens=max_generation_steps, logprobs=0, **kwargs)
                  for s in seeds]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        texts, tokens, logprobs = [], [], []
        for prompt, out in zip(prompts, outputs):
            for sample in out.outputs:
                ids = (prompt if echo else []) + list(sample.token_ids)
                if pad_output:
                    ids += [self.pad_id] * (max_generation_steps - len(sample.token_ids))
                texts.append(sample.text)
                tokens.append(np.asarray(ids, np.int32))
                logprobs.append(np.asarray([lp[t].logprob for lp, t in zip(
                    sample.logprobs, sample.token_ids)], np.float32))
        longest = max(len(p) for p in prompts)
        width = max_prompt_length if max_prompt_length and max_prompt_length >= longest \
            else 1 << (longest - 1).bit_length()
        padded = np.full((len(prompts), width), self.pad_id, np.int32)
        for i, p in enumerate(prompts):
            padded[i, width - len(p):] = p
        return SamplerOutput(text=texts, logits=None, tokens=tokens,
                             padded_prompt_tokens=padded, logprobs=logprobs)

    # ---- weights and memory --------------------------------------------------------------

    def update_params(self, updated_weights, filter_types=None) -> int:
        """Serve ``updated_weights`` from the next call (in place, no recompilation;
        ``LLM.update_weights``): passed through ``to_hf`` when given. Returns the new
        weight version. ``filter_types`` is accepted for tunix's signature and ignored."""
        del filter_types
        weights = self.to_hf(updated_weights) if self.to_hf else updated_weights
        return self.llm.update_weights(weights)

    def load_checkpoint(self, path_or_weights) -> int:
        """A safetensors directory (a path) or weights as :meth:`update_params` takes."""
        if isinstance(path_or_weights, str):
            return self.llm.update_weights(path_or_weights)
        return self.update_params(path_or_weights)

    def delete_cache(self) -> None:
        """Give the device memory back between rollouts (``sleep(level=1)``: the KV pool
        freed, the weights kept on the host)."""
        self.llm.sleep(level=1)

    def reinitialize_cache(self) -> None:
        """Undo :meth:`delete_cache` (``wake_up()``)."""
        self.llm.wake_up()

    @property
    def weight_version(self) -> int:
        """The engine's weight version (``LLM.weight_version``)."""
        return self.llm.weight_version
