"""The tokenizer and chat template stored in a GGUF file, built by transformers.

transformers builds a tokenizer from a GGUF's ``tokenizer.*`` metadata
(``AutoTokenizer.from_pretrained(dir, gguf_file=...)``), but its GGUF file reader imports torch,
which jaxpaged does not depend on. So the metadata is read here
(:mod:`jaxpaged.gguf_file`) and handed to transformers' own converter
(``transformers.integrations.gguf.gguf_tokenizer_mapping``: the key mapping ``GGUF_TOKENIZER_MAPPING`` and ``convert_gguf_tokenizer``, which needs no torch);
the result is the ``TokenizersBackend`` that ``from_pretrained`` makes for a Llama GGUF, with the
same special tokens, BOS/EOS flags and ``chat_template`` (checked against it token for token by
``tests/test_gguf_smollm2.py``).

The conversion (and the import of transformers' GGUF mapping that it needs) is a large part
of a start-up (``docs/measurements.md``, "GGUF"); its result, the ``tokenizer.json`` text and the
tokenizer's arguments, is kept under ``<cache root>/tokenizers`` named by the file's metadata
digest (:attr:`jaxpaged.gguf_file.GGUFFile.metadata_digest`), and later loads build the
tokenizer from it (the same ids: ``tests/test_gguf_tokenizer_cache.py``), transformers
reading the ``tokenizer.json`` text from a file of its own beside the entry.
``JAXPAGED_DISABLE_COMPILE_CACHE=1`` turns the cache off, as it does the compile cache.
"""

from __future__ import annotations

import json
import logging
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

from jaxpaged.atomic_file import write_text_atomically
from jaxpaged.gguf_config import BadGGUFError, metadata, metadata_digest, open_gguf
from jaxpaged.gguf_header_cache import plain

logger = logging.getLogger(__name__)

#: transformers' tokenizer arguments named after the token *ids* the GGUF stores.
_SPECIAL_TOKEN_IDS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id",
                      "unk_token": "unknown_token_id", "pad_token": "padding_token_id"}


def gguf_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """The tokenizer of the GGUF file at ``path``, with its ``tokenizer.chat_template``
    (from the cache when this file's metadata was converted before).

    Raises:
        BadGGUFError / UnsupportedModelError: the file cannot be read (:func:`open_gguf`).
        FileNotFoundError: the file has no tokenizer transformers can build (no
            ``tokenizer.ggml.tokens``, or a ``tokenizer.ggml.model`` it does not know).
        BadGGUFError: tokenizer metadata that contradicts itself (a special-token id outside
            the vocabulary, a BPE tokenizer without merges or scores, merges of unknown
            tokens).
    """
    from tokenizers import Tokenizer
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    cache = _cache_path(metadata_digest(path))
    parts = _read_cached(cache)
    if parts is None:
        parts = _convert(path, metadata(open_gguf(path)))
        _write_cached(cache, parts)
    text, kwargs = parts
    file = _tokenizer_file(cache, text)
    if file is not None:    # (a tokenizer_object is deep-copied: slower, docs/measurements.md)
        return TokenizersBackend(tokenizer_file=file, **kwargs)
    return TokenizersBackend(tokenizer_object=Tokenizer.from_str(text), **kwargs)


def _tokenizer_file(entry: str | None, text: str) -> str | None:
    """The ``tokenizer.json`` beside cache entry ``entry``, holding ``text`` (written now if
    absent), which transformers reads itself; None while the cache is off or when it cannot
    be written."""
    if entry is None:
        return None
    path = entry.removesuffix(".json") + ".tokenizer.json"
    if not os.path.exists(path):
        try:
            write_text_atomically(path, text)
        except OSError as e:
            logger.warning("the GGUF's tokenizer.json is not cached (%s)", e)
            return None
    return path


def _convert(path: str, meta: dict) -> tuple[str, dict]:
    """transformers' conversion of the GGUF's tokenizer metadata: (``tokenizer.json`` text,
    the tokenizer's keyword arguments). Raises as :func:`gguf_tokenizer`."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (GGUF_TOKENIZER_MAPPING,
                                                                        convert_gguf_tokenizer)

    groups = {group: {ours: plain(meta[f"tokenizer.{key}"]) for key, ours in keys.items()
                      if f"tokenizer.{key}" in meta}
              for group, keys in GGUF_TOKENIZER_MAPPING.items()}
    vocab, init_kwargs = groups["tokenizer"], groups["tokenizer_config"]
    if "tokens" not in vocab:
        raise FileNotFoundError(f"{path!r} has no tokenizer (tokenizer.ggml.tokens); pass "
                                "--tokenizer DIR")
    if vocab.get("tokenizer_type") == "llama":   # sentencepiece files without the flag add BOS
        init_kwargs.setdefault("add_bos_token", True)
    for arg, key in _SPECIAL_TOKEN_IDS.items():
        token_id = meta.get(f"tokenizer.ggml.{key}")
        if token_id is not None and not 0 <= token_id < len(vocab["tokens"]):
            raise BadGGUFError(f"{path!r}: tokenizer.ggml.{key} = {token_id} is not one of its "
                               f"{len(vocab['tokens'])} tokens")
        init_kwargs[arg] = None if token_id is None else vocab["tokens"][token_id]
    try:
        backend, extra = convert_gguf_tokenizer(meta["general.architecture"], vocab)
        return backend.to_str(), {**init_kwargs, **extra}
    except ValueError as e:     # transformers' converter: a tokenizer model it does not know
        raise FileNotFoundError(f"no usable tokenizer in {path!r}: {e}; pass --tokenizer "
                                "DIR") from e
    except Exception as e:     # noqa: BLE001 - missing keys, merges naming unknown tokens, ...
        raise BadGGUFError(f"{path!r}: its tokenizer metadata does not make a tokenizer "
                           f"({type(e).__name__}: {e}); pass --tokenizer DIR") from e


def _cache_path(digest: str) -> str | None:
    """The cache entry of a GGUF whose metadata digest is ``digest``; None while the cache
    is off."""
    from jaxpaged.constants import DISABLE_ENV, cache_root

    if os.environ.get(DISABLE_ENV, "").strip().lower() in ("1", "true", "yes"):
        return None
    return os.path.join(cache_root(), "tokenizers", f"gguf-{digest[:32]}.json")


def _read_cached(path: str | None) -> tuple[str, dict] | None:
    """A cache entry's (``tokenizer.json`` text, keyword arguments), or None (no entry, or one
    that cannot be read: it is converted again)."""
    if path is None or not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            entry = json.load(f)
        return entry["tokenizer"], entry["kwargs"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        logger.warning("ignoring the cached tokenizer %s: %s", path, e)
        return None


def _write_cached(path: str | None, parts: tuple[str, dict]) -> None:
    """Store ``parts`` at ``path`` (atomically); skipped when the cache is off or the
    arguments are not JSON."""
    if path is None:
        return
    try:
        write_text_atomically(path, json.dumps({"tokenizer": parts[0], "kwargs": parts[1]}))
    except (OSError, TypeError, ValueError) as e:
        logger.warning("the GGUF's tokenizer is not cached (%s)", e)
