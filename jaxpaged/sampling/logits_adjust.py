"""Per-request logit adjustments before sampling: logit bias, banned tokens, allowed tokens and
the repetition / frequency / presence penalties.

The host sends only sparse lists (a few token ids per row), padded to a bucket; the device
scatters them into the [B, V] logits. Order, as vLLM v1's sampler applies them
(``vllm/v1/sample/sampler.py``, ``vllm/model_executor/layers/utils.py::apply_penalties``):

1. allowed-token mask (``allowed_token_ids``), then additive ``pre`` terms: ``logit_bias`` and
   -inf for banned tokens (``bad_words`` completions, and EOS / ``stop_token_ids`` while fewer
   than ``min_tokens`` tokens exist);
2. repetition penalty over prompt + output tokens (Keskar et al., "CTRL", 2019, section 4.1):
   a positive logit is divided by the penalty, a negative one multiplied;
3. additive ``post`` terms over output tokens only: ``-frequency_penalty * count -
   presence_penalty`` (OpenAI's definition).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

#: Padding token id: out of range for any vocabulary, so scatters drop it.
_PAD_ID = 2**30


@jax.tree_util.register_dataclass
@dataclass
class LogitsAdjustment:
    """Sparse per-row adjustments, B rows, K and A entries per row (padded with ``_PAD_ID``).

    Attributes:
        ids: [B, K] int32 token ids with adjustments.
        pre: [B, K] float32 added before penalties (logit bias; -inf bans).
        repeat: [B, K] bool; the token is in the prompt or output (repetition penalty applies).
        post: [B, K] float32 added after the repetition penalty (frequency/presence).
        repetition_penalty: [B] float32 (1 = off).
        allowed_ids: [B, A] int32; only these may be sampled where ``has_allowed``.
        has_allowed: [B] bool.
    """

    ids: jax.Array
    pre: jax.Array
    repeat: jax.Array
    post: jax.Array
    repetition_penalty: jax.Array
    allowed_ids: jax.Array
    has_allowed: jax.Array


@dataclass
class RowAdjustment:
    """One row's adjustments on the host."""

    pre: dict[int, float]
    repeat: set[int]
    post: dict[int, float]
    repetition_penalty: float
    allowed: list[int] | None


def needs_adjustment(params) -> bool:
    """Whether ``params`` can adjust logits at all (cheap; checked before building a row)."""
    return bool(params.logit_bias or params.min_tokens or params.bad_words
                or params.allowed_token_ids or params.repetition_penalty != 1.0
                or params.frequency_penalty or params.presence_penalty)


def row_adjustment(params, prompt_ids: list[int], output_ids: list[int],
                   eos_ids: frozenset[int], bad_words_ids: list[list[int]]) -> RowAdjustment | None:
    """The adjustments of one request's next token, or None if it has none.

    Args:
        params: the request's ``SamplingParams``.
        prompt_ids, output_ids: its tokens so far.
        eos_ids: the model's EOS ids (banned, with ``stop_token_ids``, before ``min_tokens``).
        bad_words_ids: token sequences of its bad words; a sequence's last token is banned
            when the output ends with the rest of it.
    """
    pre: dict[int, float] = {}
    for token, bias in (params.logit_bias or {}).items():
        pre[int(token)] = pre.get(int(token), 0.0) + float(bias)
    banned = set()
    if len(output_ids) < params.min_tokens:
        banned |= set(params.stop_token_ids or ()) | (set() if params.ignore_eos else set(eos_ids))
    for word in bad_words_ids:
        if len(word) <= len(output_ids) + 1 and output_ids[len(output_ids) - len(word) + 1:] == \
                word[:-1]:
            banned.add(word[-1])
    for token in banned:
        pre[token] = -np.inf
    repeat = set(prompt_ids) | set(output_ids) if params.repetition_penalty != 1.0 else set()
    post: dict[int, float] = {}
    if params.frequency_penalty or params.presence_penalty:
        for token, count in Counter(output_ids).items():
            post[token] = -params.frequency_penalty * count - params.presence_penalty
    allowed = list(params.allowed_token_ids) if params.allowed_token_ids else None
    if not (pre or repeat or post or allowed):
        return None
    return RowAdjustment(pre, repeat, post, float(params.repetition_penalty), allowed)


def _bucket(n: int) -> int:
    return max(16, 1 << (max(n, 1) - 1).bit_length())


def pack(rows: list[RowAdjustment | None], padded: int) -> LogitsAdjustment:
    """Numpy arrays for ``padded`` rows (entry counts padded to a power of two >= 16)."""
    entries = []
    for r in rows:
        if r is None:
            entries.append([])
            continue
        tokens = sorted(set(r.pre) | r.repeat | set(r.post))
        entries.append([(t, r.pre.get(t, 0.0), t in r.repeat, r.post.get(t, 0.0)) for t in tokens])
    k = _bucket(max((len(e) for e in entries), default=0))
    a = _bucket(max((len(r.allowed) for r in rows if r and r.allowed), default=0))
    ids = np.full((padded, k), _PAD_ID, np.int32)
    pre = np.zeros((padded, k), np.float32)
    repeat = np.zeros((padded, k), bool)
    post = np.zeros((padded, k), np.float32)
    penalty = np.ones(padded, np.float32)
    allowed_ids = np.full((padded, a), _PAD_ID, np.int32)
    has_allowed = np.zeros(padded, bool)
    for i, (r, e) in enumerate(zip(rows, entries)):
        if r is None:
            continue
        for j, (t, p_, rep, po) in enumerate(e):
            ids[i, j], pre[i, j], repeat[i, j], post[i, j] = t, p_, rep, po
        penalty[i] = r.repetition_penalty
        if r.allowed:
            allowed_ids[i, :len(r.allowed)] = r.allowed
            has_allowed[i] = True
    return LogitsAdjustment(ids, pre, repeat, post, penalty, allowed_ids, has_allowed)


def apply(logits: jax.Array, adj: LogitsAdjustment) -> jax.Array:
    """logits: [B, V] float32 -> adjusted [B, V] float32 (see the module docstring)."""
    b, v = logits.shape
    rows = jnp.arange(b)[:, None]
    allowed = jnp.zeros((b, v), bool).at[rows, adj.allowed_ids].set(True, mode="drop")
    logits = jnp.where(adj.has_allowed[:, None] & ~allowed, -jnp.inf, logits)
    logits = logits.at[rows, adj.ids].add(adj.pre, mode="drop")
    repeat = jnp.zeros((b, v), bool).at[rows, adj.ids].set(adj.repeat, mode="drop")
    r = adj.repetition_penalty[:, None]
    logits = jnp.where(repeat, jnp.where(logits > 0, logits / r, logits * r), logits)
    return logits.at[rows, adj.ids].add(adj.post, mode="drop")
