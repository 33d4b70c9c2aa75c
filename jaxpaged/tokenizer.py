"""Tokenizer loading (Hugging Face transformers; local files only, never the network; a
tokenizer's own Python code runs only with ``trust_remote_code``)."""

from __future__ import annotations

import logging
import os
import threading
import weakref
from typing import TYPE_CHECKING


from jaxpaged.gguf_config import is_gguf
from jaxpaged.models.gguf_tokenizer import gguf_tokenizer

if TYPE_CHECKING:   # transformers is imported when a tokenizer is loaded, not with jaxpaged
    from transformers import PreTrainedTokenizerBase


def _not_the_torch_notice(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("PyTorch was not found")


# transformers says at import, on its own logger, that without PyTorch "models won't be
# available": jaxpaged uses only its tokenizers and configs, so that notice (printed by every
# run) is dropped; transformers' other warnings stay. (The CLI also sets
# TRANSFORMERS_VERBOSITY=error for its own runs.)
logging.getLogger("transformers").addFilter(_not_the_torch_notice)


def load_tokenizer(path: str, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """Load the tokenizer stored in directory ``path``.

    Args:
        path: the tokenizer's directory, or a GGUF file (its tokenizer and chat template:
            :func:`jaxpaged.models.gguf_tokenizer.gguf_tokenizer`).
        trust_remote_code: allow a tokenizer class shipped as Python code in the directory
            (``auto_map`` in ``tokenizer_config.json``) to be imported and run (vLLM's
            ``--trust-remote-code``). Off, such a tokenizer is refused; transformers is never
            left to ask on standard input.

    A tokenizer still in use is handed out again, not loaded twice: ``jaxpaged serve``'s
    HTTP layer and its engine (each loading on its own thread at start-up) share one. Its
    state is not changed after loading (no truncation or padding is set), and the fast
    tokenizer's encode and decode may run on two threads at once.

    Raises:
        FileNotFoundError: ``path`` is not a directory or holds no loadable tokenizer (or
            only one that needs ``trust_remote_code``).
        jaxpaged.gguf_config.BadGGUFError: an unreadable GGUF file.
    """
    key = (os.path.realpath(path), _mtime(path), trust_remote_code)
    with _LOADING:
        tokenizer = _LOADED.get(key)
        if tokenizer is None:
            tokenizer = _LOADED[key] = _load(path, trust_remote_code)
        return tokenizer


def _mtime(path: str) -> int | None:
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return None


#: One tokenizer load at a time: transformers' lazy imports are not thread-safe (two threads
#: importing it at once failed with "cannot import name 'AutoTokenizer'"), and a server asks
#: for its tokenizer while its engine thread loads it.
_LOADING = threading.Lock()
#: Tokenizers loaded and still referenced, by (real path, modification time, remote code).
_LOADED: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def _load(path: str, trust_remote_code: bool) -> PreTrainedTokenizerBase:
    if is_gguf(path):
        return gguf_tokenizer(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"tokenizer directory {path!r} does not exist")
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True,
                                             trust_remote_code=trust_remote_code)
    except (OSError, ValueError, TypeError) as e:
        needs_code = "trust_remote_code" in str(e)
        raise FileNotFoundError(
            f"no usable tokenizer in {path!r} (it needs tokenizer.json or tokenizer_config.json "
            f"with its vocabulary files; pass --tokenizer DIR to use another): "
            f"{str(e).splitlines()[0]}"
            + (" Pass --trust-remote-code to run it." if needs_code else "")) from e


def longest_token_chars(tokenizer: PreTrainedTokenizerBase) -> int:
    """The most characters one token of ``tokenizer`` stands for (its vocabulary's longest
    piece; 1 for an empty vocabulary), computed once per tokenizer: the vocabulary's dict is
    slow to build (``docs/measurements.md``, "Tokenizer"), and a server's four OpenAI
    handlers ask."""
    chars = _LONGEST.get(tokenizer)
    if chars is None:       # (two threads at once both compute the same value)
        chars = _LONGEST[tokenizer] = max(map(len, tokenizer.get_vocab()), default=1)
    return chars


#: :func:`longest_token_chars` by tokenizer, for as long as it is referenced.
_LONGEST: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
