"""Tokenizer loading (Hugging Face transformers; local files only, never the network)."""

from __future__ import annotations

import os

from transformers import AutoTokenizer, PreTrainedTokenizerBase


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """Load the tokenizer stored in directory ``path``.

    Raises:
        FileNotFoundError: ``path`` is not a directory.
    """
    if not os.path.isdir(path):
        raise FileNotFoundError(f"tokenizer directory {path!r} does not exist")
    return AutoTokenizer.from_pretrained(path, local_files_only=True)
