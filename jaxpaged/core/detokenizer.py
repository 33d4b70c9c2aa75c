"""Incremental detokenization and stop-string matching for one request.

The text of a request is the decode of (the prompt's last few tokens + every generated token)
minus the decode of those prompt tokens alone. Decoding with the prompt's tail as context
keeps sentencepiece's leading-space handling right (its decoder strips a space only at the
start of the text it is given). Trailing U+FFFD characters — a character whose bytes have not
all arrived — are held back until it completes, and released as the full decode renders them
when generation ends (:meth:`IncrementalDetokenizer.flush`). Sentencepiece byte-fallback
tokens (``<0xNN>``) are decoded a run at a time and a run that is not valid UTF-8 turns into
one U+FFFD per byte, so a trailing run of them is held back whole until a non-byte token
closes it.

Fast tokenizers (a ``tokenizers.Tokenizer`` backend with a known decoder) decode only a short
window per token, vLLM's prefix/read-offset algorithm (``detokenize_incrementally`` in
``vllm/transformers_utils/detokenizer_utils.py``): the window starts at the token after the
second-to-last point where the text was complete (no trailing U+FFFD, no open byte run), and
the new text is the window's decode minus the decode of its already-emitted part. That part's
decode is kept from the token before, where it is usually one token's lone decode, cached per
tokenizer, and the usual window (the token before and the new one) is looked up in a cache of
id-pair decodes first: a token costs at most one backend decode, and its cost does not grow
with the output. The window is decoded by the Rust backend directly, without ``transformers``' ``decode`` wrapper. Where the window's decode does not start with
the text already emitted for it (a decoder that rewrites earlier text), that token falls back
to decoding the whole output, which is what every token of a slow tokenizer does. The text
is kept as a list of per-token pieces, joined when read, and stop strings are searched for in
the last characters only, so no per-token step copies the whole text. Both paths
give the same text as the whole-output decode; ``tokenizers``' own ``DecodeStream`` is not
used because it emits a byte-fallback token's character before its run is closed
(``<0x41>`` gives ``"A"``, but ``<0x41><0xE4>`` decodes as two U+FFFD).
"""

from __future__ import annotations

import re
import weakref
from typing import TYPE_CHECKING

if TYPE_CHECKING:   # transformers comes with the tokenizer (jaxpaged.tokenizer), not jaxpaged
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerBase

#: Prompt tokens decoded before the generated ones as context (vLLM's initial offset).
INITIAL_OFFSET = 5

#: Most id-pair decodes kept per tokenizer and ``skip_special_tokens`` value.
PAIR_CACHE_SIZE = 1 << 16

_REPLACEMENT = "\ufffd"
_BYTE_TOKEN = re.compile(r"^<0x[0-9A-Fa-f]{2}>$")
#: ``tokenizers`` decoders (and the pattern types in their reprs) whose output for a token
#: depends only on its neighbours, so a window starting at a complete character decodes as
#: the same part of the whole decode does.
_LOCAL_DECODER_PARTS = frozenset({"Sequence", "ByteLevel", "Metaspace", "Replace",
                                  "ByteFallback", "Fuse", "Strip", "WordPiece", "BPEDecoder",
                                  "String", "Regex"})


class _TokenizerTables:
    """What the detokenizer derives from one tokenizer once: the ids of its byte-fallback
    pieces, of its special tokens, and their union (frozensets of ids); its
    :func:`fast_backend`; and, for the fast path, the decodes of single ids and of id pairs
    (the usual decode window: the token before and the new one) as they are first needed,
    one dict per ``skip_special_tokens`` value (a fast backend's decode depends on nothing
    but the ids), the pairs' keyed ``first << 32 | second`` and emptied when they reach
    :data:`PAIR_CACHE_SIZE` entries. Generated text repeats its bigrams, so most windows
    are found there and skip the backend."""

    __slots__ = ("byte_ids", "special", "byte_or_special", "backend", "single_texts",
                 "pair_texts")

    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        self.byte_ids = frozenset(i for piece, i in tokenizer.get_vocab().items()
                                  if _BYTE_TOKEN.match(piece))
        self.special = frozenset(tokenizer.all_special_ids) | frozenset(
            i for i, t in tokenizer.added_tokens_decoder.items() if t.special)
        self.byte_or_special = self.byte_ids | self.special
        self.backend = fast_backend(tokenizer)
        self.single_texts: tuple[dict[int, str], dict[int, str]] = ({}, {})
        self.pair_texts: tuple[dict[int, str], dict[int, str]] = ({}, {})


#: Each live tokenizer's tables, keyed weakly: an entry goes with its tokenizer, so it keeps
#: no tokenizer alive and a later tokenizer never finds another's tables.
_tables: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _tables_of(tokenizer: PreTrainedTokenizerBase) -> _TokenizerTables:
    """The tokenizer's :class:`_TokenizerTables`, computed on its first use."""
    tables = _tables.get(tokenizer)
    if tables is None:
        tables = _tables[tokenizer] = _TokenizerTables(tokenizer)
    return tables


def byte_fallback_ids(tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """Ids of the tokenizer's ``<0xNN>`` byte-fallback pieces (empty for byte-level BPE)."""
    return _tables_of(tokenizer).byte_ids


def special_ids(tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """Ids that ``decode(..., skip_special_tokens=True)`` drops: the special tokens and the
    added tokens marked special."""
    return _tables_of(tokenizer).special


def fast_backend(tokenizer: PreTrainedTokenizerBase) -> Tokenizer | None:
    """The ``tokenizers.Tokenizer`` whose ``decode`` gives exactly ``tokenizer.decode``'s text,
    or None (a slow tokenizer, a subclass with its own ``_decode``, text clean-up on, or a
    decoder not known to be local)."""
    from transformers import TokenizersBackend
    if (not isinstance(tokenizer, TokenizersBackend)
            or type(tokenizer)._decode is not TokenizersBackend._decode
            or tokenizer.clean_up_tokenization_spaces):
        return None
    backend = tokenizer.backend_tokenizer
    parts = set(re.findall(r"(\w+)\(", repr(backend.decoder))) if backend.decoder else set()
    return backend if parts <= _LOCAL_DECODER_PARTS else None


class IncrementalDetokenizer:
    """Turns one request's generated ids into text, token by token.

    Args:
        tokenizer: the model's tokenizer.
        prompt_token_ids: the prompt ids (only the last few are used as context).
        skip_special_tokens: drop special tokens from the text.
        stop: stop strings; the text is cut at the first one found.
        include_stop_str_in_output: keep the matched stop string in the text.
        spaces_between_special_tokens: passed to the tokenizer's ``decode`` (fast tokenizers
            ignore it, as they do in vLLM).
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: list[int],
                 skip_special_tokens: bool, stop: tuple[str, ...] = (),
                 include_stop_str_in_output: bool = False,
                 spaces_between_special_tokens: bool = True):
        self._tok = tokenizer
        self._skip_special = skip_special_tokens
        self._decode_kwargs = {"skip_special_tokens": skip_special_tokens,
                               "spaces_between_special_tokens": spaces_between_special_tokens}
        tables = _tables_of(tokenizer)
        self._backend = tables.backend
        self._single_texts = tables.single_texts[skip_special_tokens]
        self._pair_texts = tables.pair_texts[skip_special_tokens]
        self._ids = list(prompt_token_ids[-INITIAL_OFFSET:])   # context, then generated ids
        self._num_context = len(self._ids)
        self._context_text = self._decode(self._ids)
        # Tokens that leave a run of byte-fallback pieces open: byte pieces, and special
        # tokens when they are skipped (the decode then joins the runs on either side).
        self._run_ids = (tables.byte_or_special if skip_special_tokens and tables.byte_ids
                         else tables.byte_ids)
        self._closed = self._num_context     # ids before any open run of byte tokens
        self._stop = stop
        self._include_stop = include_stop_str_in_output
        self._pieces: list[str] = []   # the text, joined when read (see :attr:`text`)
        self._num_chars = 0
        self._hold = max((len(s) for s in stop), default=1) - 1   # chars a stop may share
        # The decode window (fast path): ids[_prefix:_read] are emitted and decode to
        # _prefix_text; the text of ids[:_read] after the context is _read_chars long. Until
        # the first advance the window holds the whole context, so its check is the context
        # rule's own; once output tokens have closed the context's last character and byte
        # run, later tokens cannot change the context's text.
        self._windowed = self._backend is not None
        self._prefix, self._read = 0, self._num_context
        self._prefix_text, self._read_chars = self._context_text, 0

    def add_token(self, token_id: int, check_stop: bool = True) -> str | None:
        """Append one generated id and extend :attr:`text`.

        Args:
            token_id: the new token.
            check_stop: look for stop strings in the new text (off before ``min_tokens``).

        Returns:
            The stop string that matched (``text`` is then cut), else None.
        """
        ids = self._ids
        ids.append(token_id)
        if token_id not in self._run_ids:
            self._closed = len(ids)    # an open run of byte tokens may be re-rendered
        new = self._new_text(self._closed, final=False)
        if not new:
            return None
        if not (check_stop and self._stop):
            self._pieces.append(new)
            self._num_chars += len(new)
            return None
        before = self._last_chars(self._hold)
        self._append(new)
        return self._match_stop(before + new)

    def add_tokens(self, token_ids: list[int], final: bool) -> None:
        """Append ids at once (no stop strings looked for) with one decode of the whole
        output: the text :meth:`add_token` for each, then :meth:`flush` if ``final``, would
        give (the rule :attr:`text` follows: the decode after the context of the ids up to
        any open byte-fallback run, trailing U+FFFD held back unless ``final``). For an
        output that nobody reads while it runs and no stop string can cut (final-only
        outputs): one backend decode at the end instead of one per token."""
        ids = self._ids
        ids.extend(token_ids)
        if final:
            self._closed = len(ids)
        else:
            for i in range(len(ids) - 1, self._closed - 1, -1):
                if ids[i] not in self._run_ids:
                    self._closed = i + 1
                    break
        text = self._decoded(self._closed)
        self._windowed = False     # (the window no longer follows the ids)
        self._append((text if final else text.rstrip(_REPLACEMENT))[self._num_chars:])

    def flush(self) -> None:
        """At the end of generation, release text held back for an incomplete UTF-8
        character, rendered as the full decode renders it (with U+FFFD)."""
        self._append(self._new_text(len(self._ids), final=True))

    @property
    def text(self) -> str:
        """The text so far: stop strings applied, trailing partial characters held back.
        Pieces are appended per token and joined here, so that a token costs the same
        however long the text is."""
        pieces = self._pieces
        if len(pieces) > 1:
            text = "".join(pieces)
            pieces.clear()
            pieces.append(text)
            return text
        return pieces[0] if pieces else ""

    def visible_text(self, finished: bool) -> str:
        """The text to report: while generation goes on, the last ``len(longest stop) - 1``
        characters are held back (they might still become a stop string, which would cut
        them), so reported text only ever grows; all of it once finished."""
        if finished or not self._stop:
            return self.text
        return self.text[:max(self._num_chars - self._hold, 0)]

    def _decode(self, ids: list[int]) -> str:
        if self._backend is not None:
            return self._backend.decode(ids, self._skip_special)   # (ids, skip_special_tokens)
        return self._tok.decode(ids, **self._decode_kwargs)

    def _new_text(self, end: int, final: bool) -> str:
        """What :attr:`text` lacks of the text of ``ids[:end]`` after the context: with
        trailing U+FFFD held back unless ``final``; empty when ``text`` is not shorter."""
        base = self._read_chars
        if self._windowed and self._num_chars >= base:
            prefix_text = self._prefix_text
            start = self._prefix
            if end - start == 2:    # the usual window: the token before and the new one
                ids = self._ids
                key = ids[start] << 32 | ids[start + 1]
                window = self._pair_texts.get(key)
                if window is None:
                    if len(self._pair_texts) >= PAIR_CACHE_SIZE:
                        self._pair_texts.clear()
                    window = self._pair_texts[key] = self._decode(ids[start:end])
            else:
                window = self._decode(self._ids[start:end])
            if window.startswith(prefix_text):
                tail = window[len(prefix_text):]
                if final:
                    return tail[self._num_chars - base:]
                read = self._read
                if end > read and not window.endswith(_REPLACEMENT):
                    self._advance(read, end, window, len(tail))
                return tail.rstrip(_REPLACEMENT)[self._num_chars - base:]
        whole = self._decoded(end)
        if not final:
            whole = whole.rstrip(_REPLACEMENT)
        return whole[self._num_chars:]

    def _advance(self, read: int, end: int, window: str, num_new_chars: int) -> None:
        """Mark ``ids[:end]`` emitted (called when its text is complete: the window's decode
        ends in no U+FFFD, which also keeps the window on a context that ends inside a
        character); the window then starts at the previous read offset ``read``, unless the
        ids since it decode to nothing (a skipped special token), whose decode would drop
        the next token's leading space. ``num_new_chars``: the text ``ids[read:end]`` added."""
        if end - read == 1:    # one token since (the common case): its lone decode, cached
            token = self._ids[read]
            since = self._single_texts.get(token)
            if since is None:
                since = self._single_texts[token] = self._decode([token])
        else:
            since = self._decode(self._ids[read:end])
        if since:
            self._prefix, self._prefix_text = read, since
        else:
            self._prefix_text = window
        self._read, self._read_chars = end, self._read_chars + num_new_chars

    def _decoded(self, end: int) -> str:
        """The text of ``ids[:end]`` as it reads after the context (the whole-output decode)."""
        full = self._decode(self._ids[:end])
        if full.startswith(self._context_text):
            return full[len(self._context_text):]
        return self._decode(self._ids[self._num_context:end])

    def _append(self, piece: str) -> None:
        if piece:
            self._pieces.append(piece)
            self._num_chars += len(piece)

    def _last_chars(self, n: int) -> str:
        """The last ``n`` characters of the text (all of it if shorter)."""
        out, count = [], 0
        for piece in reversed(self._pieces):
            if count >= n:
                break
            out.append(piece)
            count += len(piece)
        return "".join(reversed(out))[max(count - n, 0):]

    def _match_stop(self, recent: str) -> str | None:
        """Cut the text at the first stop string in ``recent`` (the text's last characters:
        the new ones and the ``len(longest stop) - 1`` before them); the stop matched."""
        best = None
        for s in self._stop:
            i = recent.find(s)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        i, s = best
        end = self._num_chars - len(recent) + i + (len(s) if self._include_stop else 0)
        self._pieces[:] = [self.text[:end]]
        self._num_chars = end
        return s
