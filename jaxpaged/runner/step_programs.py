"""The jitted programs a :class:`~jaxpaged.runner.model_runner.ModelRunner` runs.

A step is two programs dispatched back to back (JAX queues the second behind the first, so
the host does not wait in between):

- ``forward``, one executable per ``(T, B, P, decode_only)`` bucket: the model over the
  step's tokens (the KV pool donated and updated in place), the logits of each sampling row
  ``[B, V]`` and, when asked, every token's prompt log-probabilities; and each real row's
  argmax with the next ``prev_tokens`` made of them: the tokens of a step whose rows are all
  greedy, with no logprobs, logit adjustments or grammar masks (the runner decides on the
  host, :func:`is_plain_greedy`), which then runs nothing else. On the CPU the argmax reads
  the real rows only (:mod:`jaxpaged.sampling.cpu_argmax`). A separate greedy program cost a
  second dispatch and a padded-row argmax every step (``docs/measurements.md``, "Step
  programs");
- ``sample``, one executable per row bucket ``B`` (and adjustment capacity): the sampler
  and the sampled tokens' log-probabilities over those logits, for every other step.
  ``sample`` sizes its XLA temp buffer for the branches it skips (the sort and the random
  draws); above glibc's mmap ceiling that buffer is mapped afresh every call and faulted in
  again, costing system CPU (``docs/measurements.md``, "Step programs"): a greedy step does
  not call it.

Splitting them lets every forward bucket of the same row count share one compiled sampler:
the sampler (sort, top-k, the random draws, penalties, logprobs) is a large part of a step's
XLA compile (``docs/measurements.md``, "Step programs"), and the bundled model's 14 step
shapes have 6 row buckets. vLLM keeps the
sampler outside the captured model graph the same way (``vllm/v1/worker/gpu_model_runner.py``
runs ``self.sampler`` after the model's forward).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpaged.layers.attention.base import KVPages
from jaxpaged.layers.cpu_matmul import small_rows_matmuls
from jaxpaged.layers.lora import lora_token_slots
from jaxpaged.layers.packed_linear import valid_rows
from jaxpaged.runner.input_batch import StepInputs
from jaxpaged.runner.pooling import pool_rows
from jaxpaged.sampling.cpu_argmax import argmax_rows
from jaxpaged.sampling.logits_adjust import has_entries
from jaxpaged.sampling.sampler import SamplerOutput, argmax_first, sample, token_logprobs, when


def forward_inputs(inputs: StepInputs) -> dict:
    """The fields of ``inputs`` the forward program reads (the rest feed the sampler)."""
    return {"input_ids": inputs.input_ids, "positions": inputs.positions,
            "logits_indices": inputs.logits_indices, "attn_metadata": inputs.attn_metadata,
            "prompt_targets": inputs.prompt_targets,
            "prev_token_index": inputs.prev_token_index,
            "with_prompt_logprobs": inputs.with_prompt_logprobs,
            "with_pooling": inputs.with_pooling, "num_rows": inputs.num_rows}


def sample_inputs(inputs: StepInputs) -> dict:
    """The fields of ``inputs`` the sample program reads."""
    return {"sampling": inputs.sampling, "adjust": inputs.adjust,
            "token_bitmask": inputs.token_bitmask, "with_logprobs": inputs.with_logprobs}


def forward_outputs(model, hidden: jax.Array, inputs: dict) -> tuple:
    """What the forward program returns besides the pool, from the final hidden states
    ``hidden`` [T, H]: (logits [B, V] float32 of the sampling rows, prompt TokenLogprobs of
    [T] rows (zeros unless asked), pooled [2, B, H] float32 rows (zeros unless asked)).
    Packed projections compute only the real rows (:func:`valid_rows`)."""
    with valid_rows(inputs["num_rows"]):
        logits = model.compute_logits(hidden[inputs["logits_indices"]])
    # Every token's distribution over the next prompt token (a chunk's last token
    # predicts the first token of the request's next chunk, which is not among this
    # step's inputs: the host passes every row's target); skipped on the device
    # unless asked.
    with valid_rows(inputs["attn_metadata"]["query_start_loc"][-1]):
        prompt = when(inputs["with_prompt_logprobs"], lambda: token_logprobs(
            model.compute_logits(hidden), inputs["prompt_targets"]))
    pooled = pool_rows(hidden, inputs["logits_indices"],
                       inputs["attn_metadata"]["query_start_loc"], inputs["with_pooling"])
    return logits, prompt, pooled


def sample_step_rows(logits: jax.Array, inputs: dict,
                     prev_tokens: jax.Array) -> tuple[SamplerOutput, jax.Array]:
    """The sample program's body (see :class:`StepPrograms`)."""
    out = sample(logits, inputs["sampling"], inputs["with_logprobs"], inputs["adjust"],
                 inputs["token_bitmask"])
    # The sampled ids written over the first rows of the [R] buffer: the next step's
    # prev_tokens (it reads only rows this step sampled).
    return out, prev_tokens.at[:out.token_ids.shape[0]].set(out.token_ids)


def greedy_step_rows(logits: jax.Array, num_rows: jax.Array, prev_tokens: jax.Array,
                     cpu_argmax: bool = False) -> tuple[jax.Array, jax.Array]:
    """The forward program's greedy tokens: each real row's argmax of ``logits`` [B, V]
    (``num_rows`` [] int32 real rows; ``sample``'s tokens for all-greedy rows without
    logprobs, adjustments or grammar masks, :func:`argmax_first`; by the C++ kernel over the
    real rows alone with ``cpu_argmax``), and the next ``prev_tokens`` [R] with its first
    ``min(B, R)`` rows set to them (a verification step's B may exceed R; it samples with
    the verifier). Returns ([B] int32, [R] int32)."""
    tokens = argmax_rows(logits, num_rows) if cpu_argmax else argmax_first(logits)
    n = min(tokens.shape[0], prev_tokens.shape[0])
    return tokens, prev_tokens.at[:n].set(tokens[:n])


def is_plain_greedy(inputs: StepInputs, free_bitmask) -> bool:
    """Whether ``sample`` reduces to the forward's greedy tokens for ``inputs`` (host
    arrays): every row greedy (padding rows are), no logprobs, no logit adjustment, and the
    grammar mask the shared all-allowed ``free_bitmask`` (a step's own mask, even an
    all-allowed one, keeps ``sample``; so do the start-up's dummy inputs)."""
    return bool(np.all(inputs.sampling.greedy)) and not bool(inputs.with_logprobs) \
        and not bool(has_entries(inputs.adjust)) and inputs.token_bitmask is free_bitmask


def copy_kv_pages(kv_caches: list[KVPages], src: jax.Array, dst: jax.Array) -> list[KVPages]:
    """Every KV layer's pages ``src`` [n] copied over pages ``dst`` [n] (a recurrent layer's
    state pair, ``jaxpaged.layers.recurrent_pool``, passes through)."""
    return [(k, v) if k.shape != v.shape else (k.at[dst].set(k[src]), v.at[dst].set(v[src]))
            for k, v in kv_caches]


@dataclass(frozen=True)
class StepPrograms:
    """The runner's jitted functions (not yet compiled for any shape).

    Attributes:
        forward: ``(state, kv_caches, forward_inputs, prev_tokens) -> (logits [B, V]
            float32, prompt TokenLogprobs of [T] rows (zeros unless asked), pooled [2, B, H]
            float32 hidden rows for pooling requests (zeros unless the step has one;
            ``jaxpaged.runner.pooling``), greedy ids [B] int32, the next prev_tokens [R]
            int32 if the step is greedy, kv_caches)`` (:func:`greedy_step_rows`);
            ``prev_tokens`` [R] int32 are the previous step's sampled ids (R the largest
            row bucket), read for the tokens the host does not know yet.
        sample: ``(logits, sample_inputs, prev_tokens) -> (SamplerOutput without prompt
            logprobs, prev_tokens [R] with its first rows set to the sampled ids)``, the
            second the next step's ``prev_tokens``.
        copy_pages: ``(kv_caches, src [n], dst [n]) -> kv_caches`` with whole pages copied.
        prefill: ``(state, kv_caches, input_ids, positions, attn_metadata) -> (logits [T, V],
            kv_caches)``, a whole-prompt prefill outside the serving path.
    """

    forward: jax.stages.Wrapped
    sample: jax.stages.Wrapped
    copy_pages: jax.stages.Wrapped
    prefill: jax.stages.Wrapped


def build_verify_program(replicated: jax.sharding.Sharding) -> jax.stages.Wrapped:
    """The speculative-decoding sampler, jitted: ``(logits, sample_inputs, draft_ids [B])
    -> (SamplerOutput without prompt logprobs, accepted [B] bool)``
    (``jaxpaged.sampling.rejection.verify``). Built only when speculation is configured;
    it samples verification steps (finished synchronously: the next step's proposals need
    their tokens, so no ``prev_tokens``); every other step keeps ``sample``."""
    from jaxpaged.sampling.rejection import verify

    def verify_rows(logits, inputs: dict, draft_ids):
        return verify(logits, inputs["sampling"], inputs["with_logprobs"], inputs["adjust"],
                      inputs["token_bitmask"], draft_ids)

    return jax.jit(verify_rows, in_shardings=(replicated,) * 3,
                   out_shardings=(replicated, replicated))


def build_programs(graphdef: nnx.GraphDef, state_sharding, kv_sharding,
                   replicated: jax.sharding.Sharding, cpu_matmuls: bool = False,
                   state_def=None, cpu_argmax: bool = False,
                   leaf_index: tuple[int, ...] | None = None) -> StepPrograms:
    """Jit the runner's programs for a model split into ``graphdef`` and a state of
    ``state_sharding``, a KV pool of ``kv_sharding``, and per-step inputs and outputs
    ``replicated``; with ``cpu_matmuls`` the forward's few-row float32 projections use the C++
    kernel (:mod:`jaxpaged.layers.cpu_matmul`), and with ``cpu_argmax`` its greedy tokens the
    C++ argmax (:func:`greedy_step_rows`). With ``state_def`` (the state's treedef) the
    forward and prefill programs take the state as its flat list of leaves (and
    ``state_sharding`` is their list): flattening a model's NNX variables at every call cost
    host time each step (``docs/measurements.md``, "Step programs"). With
    ``leaf_index`` too, the list holds each distinct array once and leaf ``i`` of the state
    is ``state[leaf_index[i]]`` (weights stacked over the layers appear once per layer,
    :mod:`jaxpaged.layers.layer_stack`)."""

    def merged(state):
        if state_def is None:
            return nnx.merge(graphdef, state)
        leaves = state if leaf_index is None else [state[i] for i in leaf_index]
        return nnx.merge(graphdef, jax.tree.unflatten(state_def, leaves))

    def forward(state, kv_caches: list[KVPages], inputs: dict, prev_tokens: jax.Array):
        input_ids = inputs["input_ids"]
        index = inputs["prev_token_index"]
        input_ids = jnp.where(index >= 0, prev_tokens[index], input_ids)
        model = merged(state)
        # lora_slots: [T] int32 with --enable-lora
        with lora_token_slots(inputs.get("lora_slots")), small_rows_matmuls(cpu_matmuls), \
                valid_rows(inputs["attn_metadata"]["query_start_loc"][-1]):
            hidden, kv_caches = model(input_ids, inputs["positions"], kv_caches,
                                      inputs["attn_metadata"])
        logits, prompt, pooled = forward_outputs(model, hidden, inputs)
        greedy = greedy_step_rows(logits, inputs["num_rows"], prev_tokens, cpu_argmax)
        return logits, prompt, pooled, *greedy, kv_caches

    # Closures of this runner, not the module-level functions themselves: JAX's in-process
    # caches key on the function, and an executable shared with another runner may be one
    # that JAX's persistent cache served, which the executable store must not serialize.
    def sample_rows(logits, inputs, prev_tokens):    # (its name names the cache entries:
        return sample_step_rows(logits, inputs, prev_tokens)   # compile_cache.num_step_entries)

    def copy_pages(kv_caches, src, dst):
        return copy_kv_pages(kv_caches, src, dst)

    def prefill(state, kv_caches, input_ids, positions, attn_metadata):
        model = merged(state)
        hidden, kv_caches = model(input_ids, positions, kv_caches, attn_metadata)
        return model.compute_logits(hidden), kv_caches

    rep = replicated
    return StepPrograms(
        forward=jax.jit(forward, donate_argnums=(1,),
                        in_shardings=(state_sharding, kv_sharding, rep, rep),
                        out_shardings=(rep, rep, rep, rep, rep, kv_sharding)),
        sample=jax.jit(sample_rows, in_shardings=(rep, rep, rep), out_shardings=(rep, rep)),
        copy_pages=jax.jit(copy_pages, donate_argnums=(0,),
                           in_shardings=(kv_sharding, rep, rep), out_shardings=kv_sharding),
        # A scratch pool of any page count has the serving pool's per-array shardings.
        prefill=jax.jit(prefill, in_shardings=(state_sharding, kv_sharding, rep, rep, rep),
                        out_shardings=(rep, kv_sharding)))
