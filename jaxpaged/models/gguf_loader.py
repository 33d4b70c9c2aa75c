"""Read a GGUF file (llama.cpp's checkpoint format) as a Llama checkpoint.

A GGUF file holds metadata (key/value pairs: the architecture, its sizes, the tokenizer and its
chat template) and tensors under llama.cpp's names, each stored as F32, F16, BF16 or in one of
ggml's block quantizations. This module turns one into what the rest of the loader reads from a
Hugging Face directory:

- :func:`gguf_config`: the ``config.json`` dict of the model, from the ``llama.*`` keys;
- :class:`GGUFCheckpoint`: the tensors under the Hugging Face Llama names, ``[out, in]`` float32,
  dequantized on the host by the ``gguf`` package (maintained with llama.cpp,
  ``gguf.quants.dequantize``), with the Q/K row permutation undone (below);
- :func:`gguf_tokenizer` (:mod:`jaxpaged.models.gguf_tokenizer`): the tokenizer and chat template.

The Q/K permutation: llama.cpp's converter (``convert_hf_to_gguf.py``, ``LlamaModel.permute``)
reorders the output rows of ``q_proj`` and ``k_proj`` so that ggml's RoPE, which rotates
adjacent pairs (0, 1), (2, 3), ..., sees what transformers' RoPE sees rotating the halves
(i, i + head_dim/2): within each head, row ``2i + j`` of the GGUF tensor is row
``i + j * head_dim/2`` of the Hugging Face one. :func:`unpermute_rows` inverts it (per query head
for ``attn_q``, per KV head for ``attn_k``), as transformers' GGUF loader does.

Only the ``llama`` architecture is read (llama.cpp also files Mistral-style models under it);
any other, an unsupported tensor type, a truncated file or a vocabulary that does not match the
embedding is refused with a typed error naming the problem.
"""

from __future__ import annotations

import functools
import os
import re
import struct

import numpy as np

from jaxpaged.config import UnsupportedModelError
from jaxpaged.layers.packed_layout import PACKED_LEAVES, pack_weight
from jaxpaged.models.gguf_blocks import PACKABLE_TYPES, decode_blocks
from jaxpaged.models.gguf_file import GGUFFile, GGUFFormatError, read_gguf
from jaxpaged.models.gguf_packed_cache import PackedWeightCache

#: GGUF ``general.architecture`` -> the Hugging Face class jaxpaged builds for it.
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM"}
#: ggml tensor types the loader dequantizes (``gguf.GGMLQuantizationType`` names).
SUPPORTED_TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")
#: llama.cpp tensor names -> Hugging Face Llama names (``{i}``: the layer).
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                 "output": "lm_head"}
_LAYER_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_LAYER = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


class BadGGUFError(ValueError):
    """A GGUF file that cannot be read (truncated, corrupt) or contradicts itself (e.g. a
    vocabulary whose size is not the embedding's row count)."""


def is_gguf(path: str) -> bool:
    """Whether ``path`` names a GGUF file (vLLM's rule: a file ending in ``.gguf``)."""
    return path.endswith(".gguf") and not os.path.isdir(path)


def keeps_packed(path: str) -> bool:
    """Whether the GGUF file's projections and token embedding (and LM head, if any) can all
    stay packed: each stored in one of :data:`PACKABLE_TYPES` (a file with F32/F16/BF16
    projections loads dequantized, as before)."""
    kinds = {t.name: t.tensor_type.name for t in open_gguf(path).tensors}
    weights = [n for n in kinds if n.endswith(".weight") and
               (n.split(".")[-2] in _LAYER_NAMES and n.split(".")[-2].startswith(("attn_", "ffn_"))
                and not n.endswith("_norm.weight") or n in ("token_embd.weight", "output.weight"))]
    return bool(weights) and all(kinds[n] in PACKABLE_TYPES for n in weights)


def hf_tensor_name(gguf_name: str) -> str | None:
    """The Hugging Face Llama name of a llama.cpp tensor (``blk.3.attn_q.weight`` ->
    ``model.layers.3.self_attn.q_proj.weight``), or None for a name outside the mapping."""
    base, _, leaf = gguf_name.rpartition(".")
    if base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{leaf}"
    m = _LAYER.match(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    return None


def unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation.

    Args:
        w: [n_heads * head_dim, ...] rows as the GGUF stores them (a weight's rows or a bias).
        n_heads: query heads for ``attn_q``, KV heads for ``attn_k``.

    Returns:
        The same rows in Hugging Face order: within each head, GGUF row ``2i + j`` goes to
        row ``i + j * head_dim / 2``.
    """
    head_dim = w.shape[0] // n_heads
    return (w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))


def open_gguf(path: str) -> GGUFFile:
    """The file's metadata and tensor table (:func:`jaxpaged.models.gguf_file.read_gguf`:
    memory-mapped; the last two files opened are kept, so the config, tokenizer and weights
    of one start-up read the header once).

    Raises:
        FileNotFoundError: no such file.
        UnsupportedModelError: a tensor type id ``gguf`` does not know.
        BadGGUFError: anything else that stops the file from being read (no GGUF magic, a
            truncated file whose tensors run past its end).
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file {path!r} does not exist")
    stat = os.stat(path)
    return _open_gguf(os.path.realpath(path), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=2)
def _open_gguf(path: str, mtime_ns: int, size: int) -> GGUFFile:
    """:func:`open_gguf` of one version of a file (``mtime_ns`` and ``size`` key the cache)."""
    try:
        return read_gguf(path)
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
    """The ``config.json`` dict (transformers' Llama keys) of the GGUF model at ``path``.

    Read: ``general.architecture``; ``llama.{block_count, embedding_length, feed_forward_length,
    attention.head_count, attention.head_count_kv, attention.key_length, rope.freq_base,
    rope.dimension_count, attention.layer_norm_rms_epsilon, context_length, vocab_size}``; the
    tokenizer's BOS/EOS ids; the tensor names (``output.weight`` absent: tied embeddings;
    ``blk.0.attn_q.bias`` present: attention biases).

    Raises:
        UnsupportedModelError: an architecture other than ``llama``, RoPE scaling, a partial
            rotary dimension, or a tensor type outside :data:`SUPPORTED_TENSOR_TYPES` (all
            named).
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
    bad = sorted({t.tensor_type.name for t in reader.tensors} - set(SUPPORTED_TENSOR_TYPES))
    if bad:
        names = [t.name for t in reader.tensors if t.tensor_type.name in bad]
        raise UnsupportedModelError(f"{path!r} stores tensors as {bad} (e.g. {names[0]}), "
                                    f"which jaxpaged cannot dequantize; supported: "
                                    f"{list(SUPPORTED_TENSOR_TYPES)}")
    for key in ("rope.scaling.type", "rope.scaling.factor"):
        if meta.get(f"{arch}.{key}") not in (None, "none", 1.0):
            raise UnsupportedModelError(f"GGUF {arch}.{key}={meta[f'{arch}.{key}']!r}: RoPE "
                                        "scaling from GGUF metadata is not supported")
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
    if rotary != head_dim:
        raise UnsupportedModelError(f"GGUF {arch}.rope.dimension_count={rotary} rotates part of "
                                    f"each head (head_dim {head_dim}); not supported")
    rows = int(tensors["token_embd.weight"].shape[-1])    # ggml dims: [hidden, vocab]
    vocab = int(meta.get(f"{arch}.vocab_size", rows))
    tokens = len(meta["tokenizer.ggml.tokens"]) if "tokenizer.ggml.tokens" in meta else None
    if vocab != rows or (tokens is not None and tokens != rows):
        raise BadGGUFError(f"{path!r}: the vocabulary ({arch}.vocab_size {vocab}, "
                           f"{'no' if tokens is None else tokens} tokenizer tokens) does not "
                           f"match the embedding's {rows} rows (token_embd.weight)")
    return {
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
    }


class GGUFCheckpoint:
    """A GGUF file's tensors under Hugging Face Llama names, read lazily (the loader's
    checkpoint-reader interface: :meth:`get` and :meth:`unread`).

    Args:
        path: the ``.gguf`` file.
        num_heads, num_kv_heads: the model's query and KV heads (the Q/K permutation's).
        packed_cache_dir: where :meth:`get_packed` keeps the laid-out weights for the next
            load (:class:`jaxpaged.models.gguf_packed_cache.PackedWeightCache`); None: not
            kept.

    Raises:
        BadGGUFError / UnsupportedModelError: as :func:`open_gguf`.
    """

    def __init__(self, path: str, num_heads: int, num_kv_heads: int,
                 packed_cache_dir: str | None = None):
        self._path = path
        self._packed_cache = PackedWeightCache(packed_cache_dir, path)
        self._tensors = {}
        self._unmapped = []
        for t in open_gguf(path).tensors:
            name = hf_tensor_name(t.name)
            if name is None:
                self._unmapped.append(t.name)
            else:
                self._tensors[name] = t
        self._heads = {"self_attn.q_proj": num_heads, "self_attn.k_proj": num_kv_heads}
        self._read: set[str] = set()

    def unread(self) -> list[str]:
        """Tensors no :meth:`get` asked for (llama.cpp's names for those outside the mapping),
        sorted."""
        return sorted((set(self._tensors) - self._read) | set(self._unmapped))

    def get_packed(self, name: str) -> dict[str, np.ndarray] | None:
        """Tensor ``name`` (a ``[out, in]`` weight of a :data:`PACKABLE_TYPES` type) kept in
        its integers, laid out for :class:`jaxpaged.layers.packed_linear.PackedLinear`
        (``blocks``, ``block_scale``, ``block_min``; Q/K rows unpermuted), or None if the file
        lacks it.

        Raises:
            UnsupportedModelError: the tensor is stored in a type that does not pack (F32,
                F16, BF16: such files load dequantized, :func:`keeps_packed`).
        """
        t = self._tensor(name, PACKABLE_TYPES, ", which is not kept packed")
        if t is None:
            return None
        packed = self._packed_cache.get(name, PACKED_LEAVES)
        if packed is None:
            cols = int(t.shape[0])                  # ggml lists dimensions fastest first
            parts = decode_blocks(np.asarray(t.data), t.tensor_type.name, cols)
            q, scale, offset = (self._hf_rows(name, a) for a in parts)
            packed = pack_weight(q, scale, offset, PACKABLE_TYPES[t.tensor_type.name][0])
            self._packed_cache.put(name, packed)
        return packed

    def _tensor(self, name: str, allowed, refusal: str):
        """The file's tensor ``name`` (marked read), or None if it lacks it.

        Raises:
            UnsupportedModelError: its type is not in ``allowed`` (``refusal`` says why).
        """
        t = self._tensors.get(name)
        if t is None:
            return None
        self._read.add(name)
        if t.tensor_type.name not in allowed:
            raise UnsupportedModelError(f"tensor {t.name} in {self._path!r} is stored as "
                                        f"{t.tensor_type.name}{refusal}")
        return t

    def _hf_rows(self, name: str, rows: np.ndarray) -> np.ndarray:
        """A weight's per-row array (values, integers or scales) in Hugging Face row order
        (the Q/K permutation undone for ``q_proj`` and ``k_proj``)."""
        module = name.rsplit(".", 1)[0].split(".", 3)[-1]   # e.g. "self_attn.q_proj"
        return unpermute_rows(rows, self._heads[module]) if module in self._heads else rows

    def get(self, name: str) -> np.ndarray | None:
        """Tensor ``name`` (Hugging Face naming and layout: a weight ``[out, in]``) as float32,
        or None if the file lacks it.

        Raises:
            UnsupportedModelError: a tensor type outside :data:`SUPPORTED_TENSOR_TYPES`.
        """
        import gguf

        t = self._tensor(name, SUPPORTED_TENSOR_TYPES,
                         f"; supported: {list(SUPPORTED_TENSOR_TYPES)}")
        if t is None:
            return None
        # ggml lists dimensions fastest first: [in, out] is numpy's [out, in].
        shape = tuple(int(d) for d in reversed(t.shape))
        w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32).reshape(shape)
        return self._hf_rows(name, w)
