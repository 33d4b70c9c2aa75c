"""`LLM`: the offline Python API (vLLM's ``LLM`` class)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
from tqdm.auto import tqdm

from jaxpaged.chat_utils import encode_chat, render_chat
from jaxpaged.distributed.multihost import (JobFailed, check_same_everywhere, digest,
                                           first_line, is_leader)
from jaxpaged.distributed.step_sync import JobStopped, sync_step
from jaxpaged.arg_utils import DEFAULT_MODEL, EngineArgs
from jaxpaged.engine.data_parallel import make_engine
from jaxpaged.core.generation_config import apply_generation_defaults
from jaxpaged.core.input_processor import Prompt
from jaxpaged.engine.rollout import GenerationPausedError
from jaxpaged.entrypoints.rollout_api import RolloutAPI
from jaxpaged.outputs import (ClassificationRequestOutput, EmbeddingRequestOutput,
                              RequestOutput, ScoringOutput, ScoringRequestOutput)
from jaxpaged.pooling_params import PoolingParams
from jaxpaged.scoring import as_list, cosine_similarity, cross_encoder_prompt, score_pairs
from jaxpaged.runner.background_compile import OFFLINE
from jaxpaged.sampling_params import MODEL_DEFAULT_FIELDS, RequestOutputKind, SamplingParams


class LLM(RolloutAPI):
    """Generate text for batches of prompts with continuous batching; RL rollouts'
    controls (weight updates, pause, sleep: ``jaxpaged.entrypoints.rollout_api``).

    Args:
        model: Hugging Face model directory (default: the bundled stories260K).
        **engine_args: any :class:`EngineArgs` field (``block_size``, ``max_num_seqs``, ...).

    Raises:
        TypeError: an unknown engine argument. Model-loading errors as in
            :class:`~jaxpaged.engine.engine.Engine`.

    Example::

        llm = LLM()
        out = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=60))
        print(out[0].outputs[0].text)
    """

    def __init__(self, model: str = DEFAULT_MODEL, **engine_args):
        args = EngineArgs(model=model, **engine_args)
        # The step programs compile in the background (a step whose program is not ready
        # compiles it itself); one process only: a job's processes compile in lockstep.
        self.engine = make_engine(args, OFFLINE if args.num_processes == 1 else None)
        self._counter = 0

    def get_tokenizer(self):
        """The engine's Hugging Face tokenizer."""
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """``SamplingParams()`` with the model's ``generation_config.json`` defaults applied
        (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens -> max_tokens),
        as vLLM's ``--generation-config auto`` does; used when ``generate`` gets no params."""
        return apply_generation_defaults(SamplingParams(model_default_fields=MODEL_DEFAULT_FIELDS),
                                         self.engine.model_info.generation_defaults)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = True, chat_template: str | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             lora_request=None) -> list[RequestOutput]:
        """Generate replies to conversations, rendered with the tokenizer's chat template.

        Args:
            messages: one conversation (a list of ``{"role", "content"}`` dicts) or a list
                of them.
            sampling_params: as for :meth:`generate`.
            chat_template: a Jinja template to use instead of the tokenizer's.
            add_generation_prompt: end the prompt with the assistant turn's opening.
            continue_final_message: leave the last (assistant) message open to be continued
                (exclusive with ``add_generation_prompt``).
            lora_request: as for :meth:`generate`.

        Returns:
            One ``RequestOutput`` per conversation, in order.

        Raises:
            ValueError: malformed messages, or both ``add_generation_prompt`` and
                ``continue_final_message``; ``ChatTemplateError`` (a ValueError) when there is
                no template or it refuses the conversation (its own message).
        """
        tokenizer = self.get_tokenizer()
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        prompts = []
        for conv in conversations:
            if not all(isinstance(m, dict) and "role" in m and "content" in m for m in conv):
                raise ValueError("each message must be a dict with 'role' and 'content'")
            text = render_chat(tokenizer, conv, chat_template, add_generation_prompt,
                               continue_final_message)
            prompts.append({"prompt_token_ids": encode_chat(tokenizer, text)})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm,
                             lora_request=lora_request)

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, lora_request=None) -> list[RequestOutput]:
        """Run every prompt to completion.

        Args:
            prompts: a string, a list of token ids, a TokensPrompt/TextPrompt dict, or a list
                of any of these (a list of ints is one prompt).
            sampling_params: one for all prompts, or one per prompt (default
                :meth:`get_default_sampling_params`).
            use_tqdm: show a progress bar.
            lora_request: a ``jaxpaged.lora.request.LoRARequest`` for every prompt, or a
                list of them (None entries: the base model), as vLLM's; needs
                ``enable_lora=True``.

        Returns:
            The final ``RequestOutput`` of each prompt, in input order. The requests are
            submitted with ``output_kind=FINAL_ONLY`` whatever the given params say (on
            copies: the caller's objects are left alone), as vLLM's ``LLM`` does: only
            final outputs are returned, so the engine builds no output while they run.

        Raises:
            ValueError / TypeError: a bad prompt, params or adapter, or a params or
                lora_request list of the wrong length. Whatever is raised (an interrupt
                too), no request of this call is left queued.
            MultiHostError: (multi-host) the processes were given different prompts or params.
            JobStopped: (multi-host) a process of the job received SIGINT or SIGTERM; raised
                on every process at the same step.
            JobFailed: (multi-host) a step failed, typically because a process died.
        """
        prompts = prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or self.get_default_sampling_params()] * len(prompts)
        elif isinstance(sampling_params, (list, tuple)):
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts")
        else:
            raise TypeError("sampling_params must be a SamplingParams or a list of them, "
                            f"got {type(sampling_params).__name__}")
        if self.engine.args.num_processes > 1:
            check_same_everywhere("inputs", {"the prompt list": digest(prompts), **{
                f"SamplingParams.{f.name}": digest([   # (a set's pickle order varies by process)
                    sorted(v) if isinstance(v := getattr(p, f.name), frozenset) else v
                    for p in params])
                for f in dataclasses.fields(SamplingParams)}}, show_values=False)
        return self._add_and_run(prompts, final_only(params), use_tqdm,
                                 per_prompt(lora_request, len(prompts), "lora_request"))

    def embed(self, prompts: Prompt | Sequence[Prompt],
              pooling_params: PoolingParams | None = None,
              use_tqdm: bool = True) -> list[EmbeddingRequestOutput]:
        """Embed every prompt (vLLM's ``LLM.embed``): a prefill-only pass through the engine,
        pooled and normalised as the engine's pooler says (``jaxpaged.pooling_params``).

        Args:
            prompts: as :meth:`generate`'s.
            pooling_params: one for all prompts (default ``PoolingParams()``).
            use_tqdm: show a progress bar.

        Returns:
            Per prompt, in input order, its embedding (``out.outputs.embedding``, a list of
            ``hidden_size`` floats).

        Raises:
            ValueError: an engine that does not run the model for pooling (start it with
                ``runner="pooling"`` or ``convert="embed"``), ``dimensions`` set, or a bad
                prompt; no request of this call is left queued.
            RuntimeError: a request failed (its model step raised).
        """
        prompts = prompt_list(prompts)
        params = [_for_task(pooling_params, "embed")] * len(prompts)
        return [EmbeddingRequestOutput.from_base(out)
                for out in self._add_and_run(prompts, params, use_tqdm)]

    def classify(self, prompts: Prompt | Sequence[Prompt],
                 pooling_params: PoolingParams | None = None,
                 use_tqdm: bool = True) -> list[ClassificationRequestOutput]:
        """Classify every prompt with the model's classifier head (vLLM's ``LLM.classify``;
        an engine started for a sequence classifier: ``jaxpaged.classification``).

        Returns:
            Per prompt, in input order, ``out.outputs.probs`` (``num_labels`` floats).

        Raises:
            ValueError: an engine that does not run a classifier, or a bad prompt.
            RuntimeError: a request failed.
        """
        prompts = prompt_list(prompts)
        params = [_for_task(pooling_params, "classify")] * len(prompts)
        return [ClassificationRequestOutput.from_base(out)
                for out in self._add_and_run(prompts, params, use_tqdm)]

    def score(self, data_1: str | list[str], data_2: str | list[str],
              use_tqdm: bool = True, pooling_params: PoolingParams | None = None,
              chat_template: str | None = None) -> list[ScoringRequestOutput]:
        """Score text pairs (vLLM's ``LLM.score``; rules in ``jaxpaged.scoring``): a
        classifier scores each pair's prompt (``chat_template``: the score template over
        the roles ``query`` and ``document``), an embedding model the cosine similarity of
        the two texts' embeddings.

        Args:
            data_1, data_2: a text or a list of texts each, paired 1:1, 1:N or N:N.

        Returns:
            Per pair, in order, ``out.outputs.score``.

        Raises:
            ValueError: a generating engine, mismatched or empty sides, a bad prompt.
            RuntimeError: a request failed.
        """
        pooler = self.engine.args.pooler
        if pooler is None:
            raise ValueError("LLM.score needs a pooling engine (a sequence classifier, or an "
                             "embedding model); this one runs for generation")
        pairs = score_pairs(data_1, data_2)
        texts_1, texts_2 = as_list(data_1), as_list(data_2)
        params = [_for_task(pooling_params, pooler.task)]
        if pooler.task == "classify":
            spec = self.engine.model_config.classifier
            tokenizer = self.get_tokenizer()
            prompts = [cross_encoder_prompt(tokenizer, texts_1[i], texts_2[j], chat_template,
                                            bool(spec and spec.from_tokens)) for i, j in pairs]
            outs = self._add_and_run(prompts, params * len(prompts), use_tqdm)
            return [ScoringRequestOutput(o.request_id, ScoringOutput(
                float(ClassificationRequestOutput.from_base(o).outputs.probs[0])),
                o.prompt_token_ids) for o in outs]
        embedded = [EmbeddingRequestOutput.from_base(o) for o in self._add_and_run(
            texts_1 + texts_2, params * (len(texts_1) + len(texts_2)), use_tqdm)]
        one, two = embedded[:len(texts_1)], embedded[len(texts_1):]
        return [ScoringRequestOutput(
            f"{one[i].request_id}_{two[j].request_id}",
            ScoringOutput(cosine_similarity(one[i].outputs.embedding, two[j].outputs.embedding)),
            one[i].prompt_token_ids + two[j].prompt_token_ids) for i, j in pairs]

    def _add_and_run(self, prompts: list, params: list, use_tqdm: bool,
                     loras: list | None = None) -> list:
        """Queue each prompt with its params (and adapter) and run them all to their final
        outputs."""
        ids = []
        try:
            for prompt, p, lora in zip(prompts, params, loras or [None] * len(prompts)):
                rid = str(self._counter)
                self._counter += 1
                self.engine.add_request(rid, prompt, p, lora_request=lora)
                ids.append(rid)
            return self._run(ids, use_tqdm)
        except BaseException:
            # Bad input, an interrupt or a failed step: leave nothing of this call queued.
            self.engine.abort_request(ids)
            raise

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        final: dict[str, RequestOutput] = {}
        multihost = self.engine.args.num_processes > 1
        with tqdm(total=len(ids), desc="Processed prompts",
                  disable=not use_tqdm or not is_leader()) as bar:
            while self.engine.has_unfinished_requests():
                if getattr(self.engine, "is_frozen", False):
                    raise GenerationPausedError(
                        "generation is paused, asleep or inside a weight update: call "
                        "resume_generation(), wake_up() or finish_weight_update() first")
                for out in self._step(multihost):
                    if out.finished:
                        final[out.request_id] = out
                        bar.update(1)
        return [final[i] for i in ids]

    def _step(self, multihost: bool) -> list[RequestOutput]:
        if not multihost:
            return self.engine.step()
        try:
            sync_step()     # raises JobStopped on every process after a stop signal
            return self.engine.step()
        except JobStopped:
            raise
        except Exception as e:   # noqa: BLE001 - in a collective: the job is broken
            raise JobFailed(first_line(e)) from e


def _for_task(params: PoolingParams | None, task: str) -> PoolingParams:
    """``params`` (default ``PoolingParams()``) for ``task`` unless they name another."""
    params = params or PoolingParams()
    return params if params.task is not None else dataclasses.replace(params, task=task)


def prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """One prompt or a list of prompts as a list (a list of ints is one prompt).

    Raises:
        TypeError: neither a prompt nor a list of them.
    """
    if isinstance(prompts, np.ndarray) and prompts.ndim == 1:
        prompts = prompts.tolist()
    if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(f"prompts must be a prompt or a list of prompts, "
                        f"got {type(prompts).__name__}")
    return list(prompts)


def per_prompt(value, count: int, name: str) -> list:
    """``value`` for each of ``count`` prompts: a list of them as given, else repeated.

    Raises:
        ValueError: a list of another length.
    """
    if isinstance(value, (list, tuple)):
        if len(value) != count:
            raise ValueError(f"got {len(value)} {name} for {count} prompts")
        return list(value)
    return [value] * count


def final_only(params: list[SamplingParams]) -> list[SamplingParams]:
    """``params`` with ``output_kind=FINAL_ONLY``: a copy of each distinct object that asks
    for another kind (vLLM's ``LLM._validate_and_add_requests`` sets it on the caller's
    objects; a copy leaves them as they were)."""
    copies: dict[int, SamplingParams] = {}
    for p in params:
        if id(p) not in copies:
            copies[id(p)] = p if p.output_kind is RequestOutputKind.FINAL_ONLY else \
                dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY)
    return [copies[id(p)] for p in params]
