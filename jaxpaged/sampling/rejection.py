"""Verification of proposed tokens on the device: rejection sampling against the target
model's distribution, for proposals that are a point mass (prompt lookup).

Leviathan et al., "Fast Inference from Transformers via Speculative Decoding" (ICML 2023),
algorithm 1, and Chen et al., "Accelerating Large Language Model Decoding with Speculative
Sampling" (2023), algorithm 2: a proposal x drawn from q is accepted with probability
min(1, p(x) / q(x)); on rejection the token is drawn from the residual norm(max(0, p - q));
when every proposal is accepted one more (bonus) token is drawn from p. The emitted tokens
are then distributed exactly as p. Prompt-lookup proposals are deterministic, so q is a
point mass at x: accept with probability p(x); the residual is p with x removed,
renormalised.

For a point mass the two random choices can share one draw: t ~ p (the plain sampler's
draw for the row, with its key and transforms); accept iff t = x, and on rejection emit t.
Then P(accept) = p(x), and given a rejection t is distributed as p restricted to the other
tokens, renormalised: exactly the residual. (vLLM v1's ``RejectionSampler``,
``vllm/v1/sample/rejection_sampler.py``, draws a uniform for the test and a second sample
for the residual instead: the same distribution, another coupling.) Sharing the draw makes
every emitted token the one plain decoding draws at that position with the same seed
(its seed folded with the position), so a seeded request's tokens do not depend on whether, where
or how far it speculated: they equal its tokens without speculation, up to the last bits of
the logits (another step shape). Greedy rows reduce to the longest prefix of proposals
equal to the argmax, then the argmax.

Every row is decided independently; the host keeps a sequence's rows up to its first
rejection (``jaxpaged.runner.read_output``). p is the plain sampler's distribution
(``jaxpaged.sampling.sampler``): the grammar mask, logit adjustments, temperature, min-p,
top-k and top-p applied to the row's logits.
"""

from __future__ import annotations

import jax

from jaxpaged.sampling.logits_adjust import LogitsAdjustment
from jaxpaged.sampling.sampler import SamplerOutput, SamplingMetadata, sample


def verify(logits: jax.Array, meta: SamplingMetadata, with_logprobs: bool | jax.Array,
           adjust: LogitsAdjustment | None, token_bitmask: jax.Array | None,
           draft_ids: jax.Array) -> tuple[SamplerOutput, jax.Array]:
    """Decide every row: its token t ~ p, and whether its proposal was accepted (t equals
    it).

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
    """
    out = sample(logits, meta, with_logprobs, adjust, token_bitmask)
    return out, (draft_ids >= 0) & (out.token_ids == draft_ids)
