"""Prompt-lookup (n-gram) proposals on the host, in numpy.

The sequence's last ``n`` tokens (``prompt_lookup_min <= n <= prompt_lookup_max``, the
longest that occurs earlier) are looked up in its own earlier tokens (prompt and output); the
tokens that followed that earlier occurrence are the proposal. Saxena, "Prompt Lookup
Decoding" (2023, github.com/apoorvumang/prompt-lookup-decoding), and vLLM v1's
``NgramProposer`` (``vllm/v1/spec_decode/ngram_proposer.py``) propose the same way; where
several earlier occurrences match, this one takes the most recent (repetitive text then
continues from its latest round). No JAX.
"""

from __future__ import annotations

import numpy as np


class NgramProposer:
    """Proposes up to ``k`` tokens from a sequence's own tokens.

    Args:
        num_speculative_tokens: k, the most tokens proposed.
        prompt_lookup_min, prompt_lookup_max: the n-gram lengths tried (longest first).
    """

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int,
                 prompt_lookup_max: int):
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, token_ids: list[int], limit: int) -> list[int]:
        """The proposal for the sequence ``token_ids`` (prompt + output, its last token
        the one the step decodes): at most ``min(k, limit)`` ids, ``[]`` when no n-gram of
        at least ``prompt_lookup_min`` tokens recurs.

        Matching grows the suffix one token at a time over the candidate end positions
        (O(len(token_ids)) for the first token, then only the survivors).
        """
        limit = min(self.k, limit)
        total = len(token_ids)
        if limit <= 0 or total <= self.min_n:
            return []
        tokens = np.asarray(token_ids, np.int64)
        # ends[i]: an earlier position whose token equals the last one (the end of a match).
        ends = np.flatnonzero(tokens[:-1] == tokens[-1])
        length, best = 1, ends
        while ends.size and length < self.max_n and length < total - 1:
            ends = ends[ends >= length]
            ends = ends[tokens[ends - length] == tokens[total - 1 - length]]
            if ends.size:
                length += 1
                best = ends
        if length < self.min_n or not best.size:
            return []
        start = int(best[-1]) + 1
        return tokens[start:start + limit].tolist()
