"""The model description a GGUF file carries (its ``config.json`` dict), read without loading any
weights: a leaf module, so that :meth:`jaxpaged.config.ModelConfig.from_pretrained` reads a
``.gguf`` file's config without importing the weight loader (``jaxpaged.models.gguf_loader``),
which imports it back.

The header is read once by :func:`jaxpaged.gguf_file.read_gguf` (memory-mapped; the last two
files opened are kept, so the config, tokenizer and weights of one start-up share it), and
kept for the next start-up (``jaxpaged.gguf_header_cache``).
"""

from __future__ import annotations

import functools
import os
import struct

from jaxpaged.errors import UnsupportedModelError
from jaxpaged import gguf_header_cache as header_cache
from jaxpaged.gguf_arch import (GGUF_ARCHITECTURES, LINEAR_ROPE_SCALING, PARTIAL_ROTARY,
                                YARN_ROPE_SCALING, family_config)
from jaxpaged.gguf_file import GGUFFile, GGUFFormatError, read_gguf
#: ggml tensor types the loader dequantizes (``gguf.GGMLQuantizationType`` names).
SUPPORTED_TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K",
                          "MXFP4")


class BadGGUFError(ValueError):
    """A GGUF file that cannot be read (truncated, corrupt) or contradicts itself (e.g. a
    vocabulary whose size is not the embedding's row count)."""


def is_gguf(path: str) -> bool:
    """Whether ``path`` names a GGUF file (vLLM's rule: a file ending in ``.gguf``)."""
    return path.endswith(".gguf") and not os.path.isdir(path)


def open_gguf(path: str) -> GGUFFile:
    """The file's metadata and tensor table (:func:`jaxpaged.gguf_file.read_gguf`:
    memory-mapped; the last two files opened are kept, so the config, tokenizer and weights
    of one start-up read the header once).

    Raises:
        FileNotFoundError: no such file.
        UnsupportedModelError: a tensor type id ``gguf`` does not know.
        BadGGUFError: anything else that stops the file from being read (no GGUF magic, a
            truncated file whose tensors run past its end).
    """
    return _open_gguf(*_version(path))


def _version(path: str) -> tuple[str, int, int]:
    """(real path, modification time in ns, size) of the GGUF file at ``path``: one version
    of a file, the key of what this module keeps.

    Raises:
        FileNotFoundError: no such file.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file {path!r} does not exist")
    stat = os.stat(path)
    return os.path.realpath(path), stat.st_mtime_ns, stat.st_size


def metadata_digest(path: str) -> str:
    """:attr:`GGUFFile.metadata_digest` of the GGUF file at ``path``, remembered for each
    version of a file the process has opened, also after :func:`forget_gguf_files`: a
    start-up's tokenizer needs only the digest to find its cached conversion, and reading
    the metadata again slowed the warm start's Python (``docs/measurements.md``, "GGUF").

    Raises:
        As :func:`open_gguf`.
    """
    key = _version(path)
    digest = _DIGESTS.get(key)
    return digest if digest is not None else _open_gguf(*key).metadata_digest


#: :func:`metadata_digest` by (real path, modification time, size).
_DIGESTS: dict[tuple, str] = {}


@functools.lru_cache(maxsize=2)
def _open_gguf(path: str, mtime_ns: int, size: int) -> GGUFFile:
    """:func:`open_gguf` of one version of a file (``mtime_ns`` and ``size`` key the cache)."""
    key = (path, mtime_ns, size)
    try:
        opened = header_cache.load(key)
        if opened is None:
            opened = read_gguf(path)
            header_cache.store(key, opened)
        _DIGESTS[key] = opened.metadata_digest
        return opened
    except GGUFFormatError as e:
        if "unknown ggml type" in str(e):
            raise UnsupportedModelError(f"{path!r} holds a tensor of unknown ggml type ({e}); "
                                        f"supported: {list(SUPPORTED_TENSOR_TYPES)}") from e
        raise BadGGUFError(f"{path!r} is not a readable GGUF file (truncated or corrupt): "
                           f"{e}") from e
    except (OSError, ValueError, struct.error, EOFError) as e:
        raise BadGGUFError(f"{path!r} is not a readable GGUF file (truncated or corrupt): "
                           f"{type(e).__name__}: {e}") from e


def forget_gguf_files() -> None:
    """Drop the files :func:`open_gguf` keeps, so that each one's mapping closes once nothing
    else holds its tensors (after the weights are copied out: SmolLM2's 93 MB of mapped
    file pages no longer count in the process's resident memory)."""
    _open_gguf.cache_clear()


def metadata(reader: GGUFFile) -> dict:
    """The file's key/value metadata as Python values (strings, numbers, lists)."""
    return reader.metadata


def gguf_config(path: str) -> dict:
    """The ``config.json`` dict (transformers' keys) of the GGUF model at ``path``.

    Read: ``general.architecture`` (one of :data:`GGUF_ARCHITECTURES`);
    ``{arch}.{block_count, embedding_length, feed_forward_length, attention.head_count,
    attention.head_count_kv, attention.key_length, rope.freq_base, rope.dimension_count,
    attention.layer_norm_rms_epsilon, context_length, vocab_size}``; the tokenizer's BOS/EOS
    ids; the tensor names (``output.weight`` absent: tied embeddings; ``blk.0.attn_q.bias``
    present: attention biases); each family's own keys
    (:func:`jaxpaged.gguf_arch.family_config`).

    Raises:
        UnsupportedModelError: an architecture outside :data:`GGUF_ARCHITECTURES`, RoPE
            scaling (but Gemma 3's linear and gpt-oss's YaRN), a partial rotary dimension (but
            Phi-3's and Qwen3-Next's), a
            family setting jaxpaged does not have, or a tensor type outside
            :data:`SUPPORTED_TENSOR_TYPES` (all named).
        BadGGUFError: unreadable file, missing size keys, or a vocabulary (``vocab_size`` or the
            tokenizer's token list) that does not match the embedding's rows.
    """
    reader = open_gguf(path)
    meta = reader.metadata
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedModelError(f"GGUF architecture {arch!r} is not supported; supported: "
                                    f"{list(GGUF_ARCHITECTURES)}")
    tensors = {t.name: t for t in reader.tensors}
    bad = sorted({t.type_name for t in reader.tensors} - set(SUPPORTED_TENSOR_TYPES))
    if bad:
        names = [t.name for t in reader.tensors if t.type_name in bad]
        raise UnsupportedModelError(f"{path!r} stores tensors as {bad} (e.g. {names[0]}), "
                                    f"which jaxpaged cannot dequantize; supported: "
                                    f"{list(SUPPORTED_TENSOR_TYPES)}")
    for key in ("rope.scaling.type", "rope.scaling.factor"):
        value = meta.get(f"{arch}.{key}")
        kind = meta.get(f"{arch}.rope.scaling.type")
        read = (arch in LINEAR_ROPE_SCALING and kind == "linear"
                or arch in YARN_ROPE_SCALING and kind == "yarn")
        if value not in (None, "none", 1.0) and not read:
            raise UnsupportedModelError(f"GGUF {arch}.{key}={value!r}: RoPE scaling from GGUF "
                                        f"metadata is not supported for {arch}")
    if "rope_freqs.weight" in tensors:
        raise UnsupportedModelError("the GGUF holds rope_freqs.weight (Llama 3 RoPE frequency "
                                    "scaling), which the GGUF loader does not read")
    need = ["block_count", "embedding_length", "feed_forward_length", "attention.head_count"]
    missing = [f"{arch}.{k}" for k in need if f"{arch}.{k}" not in meta]
    if missing or "token_embd.weight" not in tensors:
        raise BadGGUFError(f"{path!r} lacks {missing or ['token_embd.weight']}")
    hidden, heads = int(meta[f"{arch}.embedding_length"]), int(meta[f"{arch}.attention.head_count"])
    head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // heads))
    rotary = int(meta.get(f"{arch}.rope.dimension_count", head_dim))
    if rotary != head_dim and arch not in PARTIAL_ROTARY:
        raise UnsupportedModelError(f"GGUF {arch}.rope.dimension_count={rotary} rotates part of "
                                    f"each head (head_dim {head_dim}); not supported")
    rows = int(tensors["token_embd.weight"].shape[-1])    # ggml dims: [hidden, vocab]
    vocab = int(meta.get(f"{arch}.vocab_size", rows))
    tokens = len(meta["tokenizer.ggml.tokens"]) if "tokenizer.ggml.tokens" in meta else None
    if vocab != rows or (tokens is not None and tokens != rows):
        raise BadGGUFError(f"{path!r}: the vocabulary ({arch}.vocab_size {vocab}, "
                           f"{'no' if tokens is None else tokens} tokenizer tokens) does not "
                           f"match the embedding's {rows} rows (token_embd.weight)")
    return family_config(arch, meta, tensors, {
        "architectures": [GGUF_ARCHITECTURES[arch]],
        "vocab_size": rows,
        "hidden_size": hidden,
        "intermediate_size": int(meta[f"{arch}.feed_forward_length"]),
        "num_hidden_layers": int(meta[f"{arch}.block_count"]),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get(f"{arch}.attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rope_theta": float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        "rms_norm_eps": float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        "max_position_embeddings": int(meta.get(f"{arch}.context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    })
