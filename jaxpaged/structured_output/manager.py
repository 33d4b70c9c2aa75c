"""Grammar compilation off the engine thread, one matcher per sequence, and the step's token
bitmask.

vLLM's design (``vllm/v1/structured_output/__init__.py``, ``StructuredOutputManager``): a
request's grammar is compiled in a thread pool while the request waits in the scheduler;
compiled grammars are cached by their spec, and every sequence gets its own copy of the
matcher (``LLMatcher.deep_copy``), which advances by each token the sequence appends. Before
a step the host fills an int32 bitmask of ``[rows, ceil(V / 32)]`` words (bit ``t % 32`` of
word ``t // 32`` set: token ``t`` allowed; llguidance's layout, ``llguidance/numpy.py``),
with every bit set in the rows of free sequences; the jitted sampler applies it
(``jaxpaged.sampling.sampler.apply_token_bitmask``).

The matcher follows exactly the tokens appended to the sequence (``Scheduler.
update_from_output``), so it survives recompute preemption as it is: the sequence resumes
with the same output tokens and the matcher already consumed them.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import TYPE_CHECKING

import numpy as np

from jaxpaged.errors import SamplingParamsError
from jaxpaged.structured_output.params import StructuredOutputsParams
from jaxpaged.structured_output.grammar import cache_key, serialize

if TYPE_CHECKING:   # llguidance is imported when a request asks for a grammar
    import llguidance

logger = logging.getLogger(__name__)

#: Compiled grammars kept (least recently used ones are dropped beyond this).
MAX_CACHED_GRAMMARS = 256


class StructuredOutputRequest:
    """One sequence's grammar state (vLLM's ``StructuredOutputRequest``).

    Args:
        compiled: a future of the grammar's compiled matcher (a template, never advanced).
        words: int32 words of the matcher's bitmask rows (its tokenizer's vocabulary).
        eos_token_ids: the only tokens allowed if the compilation failed.

    Attributes:
        failed: why the compilation failed (logged; the sequence may then only end), or None.
    """

    def __init__(self, compiled: Future, words: int, eos_token_ids: tuple[int, ...]):
        self._compiled = compiled
        self.words = words
        self._eos = eos_token_ids
        self._matcher: llguidance.LLMatcher | None = None
        self._logged_error = False
        self.failed: str | None = None

    def is_ready(self) -> bool:
        """Whether the grammar is compiled (the sequence may be scheduled); never blocks."""
        if self._matcher is None and self.failed is None:
            if not self._compiled.done():
                return False
            error = self._compiled.exception()
            if error is not None:
                self.failed = f"{type(error).__name__}: {error}"
                logger.error("structured output: the grammar did not compile (%s); the "
                             "sequence may only end (EOS)", self.failed)
            else:
                self._matcher = self._compiled.result().deep_copy()
        return True

    def fill_eos_only(self, row: np.ndarray) -> None:
        """Write the bitmask row of a failed grammar: EOS alone."""
        row[:] = 0
        for t in self._eos:
            row[t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))

    def wait(self, timeout: float | None = None) -> None:
        """Block until the grammar is compiled (or ``timeout`` seconds pass)."""
        wait_futures([self._compiled], timeout)

    @property
    def matcher(self) -> llguidance.LLMatcher:
        """The sequence's matcher (only once :meth:`is_ready`)."""
        assert self._matcher is not None, "the grammar is not compiled yet"
        return self._matcher

    def accept(self, token_id: int) -> bool:
        """Advance by the sequence's next token; False (logged once) when the grammar refuses
        it, after which only EOS stays allowed (llguidance's error state)."""
        if self.failed is not None:
            return False
        matcher = self.matcher
        if matcher.is_stopped():
            return True         # the grammar is complete; EOS (or a stop) ends the sequence
        ok = matcher.consume_token(token_id)
        if not ok and not self._logged_error:
            self._logged_error = True
            logger.warning("structured output: the grammar refused token %d: %s", token_id,
                           matcher.get_error())
        return ok

    def fork(self) -> StructuredOutputRequest:
        """A copy for a parallel-sampling sequence forked from this one (same state)."""
        child = StructuredOutputRequest(self._compiled, self.words, self._eos)
        child.failed = self.failed
        child._matcher = None if self.failed is not None else self.matcher.deep_copy()
        return child


class StructuredOutputManager:
    """Compiles grammars for one engine's tokenizer and vocabulary.

    Args:
        tokenizer: the engine's (fast) Hugging Face tokenizer.
        vocab_size: the model's vocabulary V (logits per row): ids at or past the
            tokenizer's own tokens are never allowed in a constrained row.
        eos_token_ids: the model's EOS ids, the tokens allowed once the grammar is complete.
        max_workers: compilation threads.

    The llguidance tokenizer (seconds for a large vocabulary, ``docs/measurements.md``,
    "Structured outputs") is built in the pool at the first structured request, never at
    start-up.
    """

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: frozenset[int],
                 max_workers: int = 1):
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos = sorted(eos_token_ids) or None
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="jaxpaged-grammar")
        self._lock = threading.Lock()
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._grammars: OrderedDict[str, Future] = OrderedDict()
        self._words = num_words(max(vocab_size, len(tokenizer)))

    def _ll(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance.hf    # (imports transformers: not at jaxpaged's import)
                n_vocab = max(self.vocab_size, len(self._tokenizer))
                self._ll_tokenizer = llguidance.hf.from_tokenizer(
                    self._tokenizer, n_vocab=n_vocab, eos_token=self._eos)
            return self._ll_tokenizer

    def _compile(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        import llguidance

        matcher = llguidance.LLMatcher(self._ll(), serialize(params), log_level=0)
        if matcher.is_error():      # validated before; a tokenizer-specific failure
            logger.warning("structured output: grammar failed to compile: %s",
                           matcher.get_error())
        return matcher

    def request(self, params: StructuredOutputsParams) -> StructuredOutputRequest:
        """A new sequence's grammar state; its grammar compiles in the pool unless a
        request with the same spec compiled it already (:func:`cache_key`).

        Raises:
            SamplingParamsError: the engine's tokenizer is not a fast (``tokenizer.json``)
                one, which llguidance needs.
        """
        import transformers     # loaded with the tokenizer already
        if not isinstance(self._tokenizer, transformers.PreTrainedTokenizerFast):
            raise SamplingParamsError("structured_outputs", "needs a fast tokenizer (one with "
                                      "tokenizer.json); this model's is "
                                      f"{type(self._tokenizer).__name__}")
        key = cache_key(params)
        compiled = self._grammars.get(key)
        if compiled is None or (compiled.done() and compiled.exception() is not None):
            compiled = self._pool.submit(self._compile, params)
            self._grammars[key] = compiled
            while len(self._grammars) > MAX_CACHED_GRAMMARS:
                self._grammars.popitem(last=False)
        self._grammars.move_to_end(key)
        return StructuredOutputRequest(compiled, self._words, tuple(self._eos or ()))


@functools.lru_cache(maxsize=1)
def _mask_executor() -> llguidance.LLExecutor:
    import llguidance

    return llguidance.LLExecutor()


def num_words(vocab_size: int) -> int:
    """int32 words of one bitmask row for a vocabulary of ``vocab_size`` tokens."""
    return (vocab_size + 31) // 32


@functools.lru_cache(maxsize=64)
def all_allowed(rows: int, words: int) -> np.ndarray:
    """A read-only ``[rows, words]`` int32 bitmask with every bit set (no row constrained)."""
    mask = np.full((rows, words), -1, np.int32)
    mask.flags.writeable = False
    return mask


def grammar_bitmask(rows: list[tuple[StructuredOutputRequest, int]], padded: int,
                    words: int) -> np.ndarray:
    """The step's ``[padded, words]`` int32 bitmask: each ``(sequence, row)`` of ``rows``
    gets its matcher's allowed tokens (computed in parallel by llguidance's executor; a
    complete grammar allows only EOS), every other row all bits set."""
    ll_words = max(s.words for s, _ in rows)      # more than ``words`` only when the
    mask = np.full((padded, ll_words), -1, np.int32)    # tokenizer outgrows the model
    first: dict[int, int] = {}      # a prompt's n rows before its fork share one matcher
    for s, r in rows:
        first.setdefault(id(s), r)
    matchers = [(s.matcher, r) for s, r in rows if first[id(s)] == r and s.failed is None]
    if matchers:
        import llguidance.numpy

        llguidance.numpy.fill_next_token_bitmask_par(_mask_executor(), matchers, mask)
    for s, r in rows:
        if s.failed is not None:
            s.fill_eos_only(mask[r])
        elif first[id(s)] != r:
            mask[r] = mask[first[id(s)]]
    return mask if ll_words == words else np.ascontiguousarray(mask[:, :words])
