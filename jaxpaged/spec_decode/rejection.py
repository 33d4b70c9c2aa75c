"""Verification of proposed tokens on the device: rejection sampling against the target
model's distribution.

Leviathan et al., "Fast Inference from Transformers via Speculative Decoding" (ICML 2023),
algorithm 1, and Chen et al., "Accelerating Large Language Model Decoding with Speculative
Sampling" (2023), algorithm 2: a proposal x drawn from q is accepted with probability
min(1, p(x) / q(x)); on rejection the token is drawn from the residual
norm(max(0, p - q)); when every proposal is accepted one more (bonus) token is drawn from p.
The emitted tokens are then distributed exactly as p. Prompt-lookup proposals are
deterministic, so q is a point mass at x: accept with probability p(x), and the residual is p
with x removed, renormalised. Greedy rows (p a point mass at the argmax) accept exactly the
proposals equal to the argmax and emit the argmax at the first mismatch, the longest
matching prefix. vLLM v1's ``RejectionSampler`` (``vllm/v1/sample/rejection_sampler.py``)
does the same per row; here every row is decided independently and the host keeps the rows
up to the first rejection (``jaxpaged.runner.read_output``).

p is the distribution the plain sampler draws from (``jaxpaged.sampling.sampler``): the
grammar mask, logit adjustments, temperature, min-p, top-k and top-p applied to the row's
logits. A row without a proposal draws exactly the plain sampler's token (same key, same
transforms), so a sequence that finds no proposal decodes as without speculation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxpaged.sampling.logits_adjust import LogitsAdjustment, apply_if_any
from jaxpaged.sampling.sampler import (SamplerOutput, SamplingMetadata, apply_token_bitmask,
                                       argmax_first, processed_logits, row_key,
                                       token_logprobs, when)


def verify(logits: jax.Array, meta: SamplingMetadata, with_logprobs: bool | jax.Array,
           adjust: LogitsAdjustment | None, token_bitmask: jax.Array | None,
           draft_ids: jax.Array) -> tuple[SamplerOutput, jax.Array]:
    """Decide every row: accept its proposal, or emit a token drawn from the residual (a row
    without a proposal: from p itself).

    Args:
        logits: [B, V] float32, row j of a speculating sequence at its chunk's token j.
        meta: the rows' sampling parameters (``position``: of the token the row emits).
        with_logprobs: also return the emitted tokens' raw logprobs (see ``sample``).
        adjust, token_bitmask: as for ``jaxpaged.sampling.sampler.sample``.
        draft_ids: [B] int32, each row's proposal, -1 for none.

    Returns:
        (``SamplerOutput`` whose ``token_ids`` [B] int32 are each row's emitted token: the
        proposal where accepted, else the residual draw; ``accepted`` [B] bool, False
        for rows without a proposal).

    Randomness: the residual draw uses the plain sampler's key for the row
    (``row_key(seed, position)``), the acceptance test a uniform from that key folded with 1.
    """
    if token_bitmask is not None:
        logits = apply_token_bitmask(logits, token_bitmask)
    adjusted = logits if adjust is None else apply_if_any(logits, adjust)
    greedy_tokens = argmax_first(adjusted)
    has_draft = draft_ids >= 0
    safe_ids = jnp.maximum(draft_ids, 0)
    vocab_ids = jnp.arange(logits.shape[-1], dtype=jnp.int32)

    def greedy_rows():
        return greedy_tokens, has_draft & (greedy_tokens == draft_ids)

    def decide(lo, hi, pos, row, draft, has, p_draft):
        key = row_key(lo, hi, pos)
        accept = has & (jax.random.uniform(jax.random.fold_in(key, 1)) < p_draft)
        residual = jnp.where(has & (vocab_ids == draft), -jnp.inf, row)
        drawn = jax.random.categorical(key, residual).astype(jnp.int32)
        return jnp.where(accept, draft, drawn), accept

    def sampled_rows():
        masked = processed_logits(adjusted, meta)
        p_draft = jnp.take_along_axis(jax.nn.softmax(masked, axis=-1), safe_ids[:, None],
                                      axis=-1)[:, 0]
        tokens, accept = jax.vmap(decide)(meta.seed_lo, meta.seed_hi, meta.position, masked,
                                          safe_ids, has_draft, p_draft)
        return (jnp.where(meta.greedy, greedy_tokens, tokens),
                jnp.where(meta.greedy, has_draft & (greedy_tokens == draft_ids), accept))

    tokens, accepted = jax.lax.cond(jnp.all(meta.greedy), greedy_rows, sampled_rows)
    return (SamplerOutput(tokens, when(with_logprobs, token_logprobs, logits, tokens)),
            accepted)
