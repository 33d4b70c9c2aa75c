"""The tokenizer and chat template stored in a GGUF file, built by transformers.

transformers builds a tokenizer from a GGUF's ``tokenizer.*`` metadata
(``AutoTokenizer.from_pretrained(dir, gguf_file=...)``), but its GGUF file reader imports torch,
which jaxpaged does not depend on. So the metadata is read here with the ``gguf`` package and
handed to transformers' own converter (``transformers.integrations.gguf.gguf_tokenizer_mapping``:
the key mapping ``GGUF_TOKENIZER_MAPPING`` and ``convert_gguf_tokenizer``, which needs no torch);
the result is the ``TokenizersBackend`` that ``from_pretrained`` makes for a Llama GGUF, with the
same special tokens, BOS/EOS flags and ``chat_template`` (checked against it token for token by
``tests/test_gguf_smollm2.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

from jaxpaged.models.gguf_loader import BadGGUFError, metadata, open_gguf

#: transformers' tokenizer arguments named after the token *ids* the GGUF stores.
_SPECIAL_TOKEN_IDS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id",
                      "unk_token": "unknown_token_id", "pad_token": "padding_token_id"}


def gguf_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """The tokenizer of the GGUF file at ``path``, with its ``tokenizer.chat_template``.

    Raises:
        BadGGUFError / UnsupportedModelError: the file cannot be read (:func:`open_gguf`).
        FileNotFoundError: the file has no tokenizer transformers can build (no
            ``tokenizer.ggml.tokens``, or a ``tokenizer.ggml.model`` it does not know).
        BadGGUFError: tokenizer metadata that contradicts itself (a special-token id outside
            the vocabulary, a BPE tokenizer without merges or scores, merges of unknown
            tokens).
    """
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (GGUF_TOKENIZER_MAPPING,
                                                                        convert_gguf_tokenizer)
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    meta = metadata(open_gguf(path))
    groups = {group: {ours: meta[f"tokenizer.{key}"] for key, ours in keys.items()
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
        return TokenizersBackend(tokenizer_object=backend, **init_kwargs, **extra)
    except ValueError as e:     # transformers' converter: a tokenizer model it does not know
        raise FileNotFoundError(f"no usable tokenizer in {path!r}: {e}; pass --tokenizer "
                                "DIR") from e
    except Exception as e:     # noqa: BLE001 - missing keys, merges naming unknown tokens, ...
        raise BadGGUFError(f"{path!r}: its tokenizer metadata does not make a tokenizer "
                           f"({type(e).__name__}: {e}); pass --tokenizer DIR") from e
