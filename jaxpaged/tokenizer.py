"""Tokenizer loading (Hugging Face transformers; local files only, never the network)."""

from __future__ import annotations

import os

from transformers import AutoTokenizer, PreTrainedTokenizerBase


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """Load the tokenizer stored in directory ``path``.

    Raises:
        FileNotFoundError: ``path`` is not a directory or holds no loadable tokenizer.
    """
    if not os.path.isdir(path):
        raise FileNotFoundError(f"tokenizer directory {path!r} does not exist")
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, TypeError) as e:
        raise FileNotFoundError(
            f"no usable tokenizer in {path!r} (it needs tokenizer.json or tokenizer_config.json "
            f"with its vocabulary files; pass --tokenizer DIR to use another): "
            f"{str(e).splitlines()[0]}") from e
