"""Read a GGUF file (llama.cpp's checkpoint format) as a Hugging Face checkpoint.

A GGUF file holds metadata (key/value pairs: the architecture, its sizes, the tokenizer and its
chat template) and tensors under llama.cpp's names, each stored as F32, F16, BF16 or in one of
ggml's block quantizations. This module turns one into what the rest of the loader reads from a
Hugging Face directory:

- :func:`jaxpaged.gguf_config.gguf_config`: the ``config.json`` dict of the model, from the
  ``{arch}.*`` keys (a leaf module, read by ``ModelConfig.from_pretrained``; the families'
  keys in :mod:`jaxpaged.gguf_arch`);
- :class:`GGUFCheckpoint`: the tensors under the Hugging Face names
  (:mod:`jaxpaged.models.gguf_names`), ``[out, in]`` float32, dequantized on the host by the
  ``gguf`` package (maintained with llama.cpp, ``gguf.quants.dequantize``), with the Q/K row
  permutation undone (below), Gemma 3's and Qwen3-Next's ``1 +`` on their norms taken off,
  each expert read from its layer's stacked tensor (gpt-oss's MXFP4 ones dequantized by
  ``gguf`` too) and Qwen3-Next's DeltaNet tensors restored
  (:mod:`jaxpaged.models.gguf_deltanet`);
- :func:`gguf_tokenizer` (:mod:`jaxpaged.models.gguf_tokenizer`): the tokenizer and chat template.

The Q/K permutation: llama.cpp's converter (``convert_hf_to_gguf.py``, ``LlamaModel.permute``,
also for SmolLM3 and Granite: :data:`jaxpaged.gguf_arch.PERMUTED_QK`) reorders the output rows
of ``q_proj`` and ``k_proj`` so that ggml's RoPE, which rotates adjacent pairs (0, 1), (2, 3),
..., sees what transformers' RoPE sees rotating the halves (i, i + head_dim/2): within each
head, row ``2i + j`` of the GGUF tensor is row ``i + j * head_dim/2`` of the Hugging Face one.
:func:`unpermute_rows` inverts it (per query head for ``attn_q``, per KV head for ``attn_k``),
as transformers' GGUF loader does.

The architectures of :data:`jaxpaged.gguf_arch.GGUF_ARCHITECTURES` are read (llama.cpp also
files Mistral-style models under ``llama``); any other, an unsupported tensor type, a truncated
file or a vocabulary that does not match the embedding is refused with a typed error naming
the problem.
"""

from __future__ import annotations

import numpy as np

from jaxpaged.errors import UnsupportedModelError
from jaxpaged.gguf_arch import PERMUTED_QK
from jaxpaged.gguf_config import BadGGUFError, SUPPORTED_TENSOR_TYPES, open_gguf  # noqa: F401
from jaxpaged.layers.packed_layout import PACKED_LEAVES, pack_weight
from jaxpaged.models.gguf_blocks import PACKABLE_TYPES, decode_blocks
from jaxpaged.models.gguf_deltanet import fused_parts, qkvz_rows, restore
from jaxpaged.models.gguf_names import (LAYER_NAMES, MODULE_NAMED, expert_slice,  # noqa: F401
                                        hf_tensor_name, is_config_tensor, norm_offset)
from jaxpaged.models.gguf_packed_cache import PackedWeightCache

#: Architectures whose projections may stay packed (:func:`keeps_packed`; the others load
#: dequantized: their fused and stacked tensors have no packed reader).
PACKED_ARCHITECTURES = ("llama",)


def keeps_packed(path: str) -> bool:
    """Whether the GGUF file's projections and token embedding (and LM head, if any) can all
    stay packed: a :data:`PACKED_ARCHITECTURES` file whose weights are each stored in one of
    :data:`PACKABLE_TYPES` (a file with F32/F16/BF16 projections loads dequantized, as
    before)."""
    opened = open_gguf(path)
    if opened.metadata.get("general.architecture") not in PACKED_ARCHITECTURES:
        return False
    kinds = {t.name: t.type_name for t in opened.tensors}
    layer_names = LAYER_NAMES["llama"]
    weights = [n for n in kinds if n.endswith(".weight") and
               (n.split(".")[-2] in layer_names and n.split(".")[-2].startswith(("attn_", "ffn_"))
                and not n.endswith("_norm.weight") or n in ("token_embd.weight", "output.weight"))]
    return bool(weights) and all(kinds[n] in PACKABLE_TYPES for n in weights)
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


class GGUFCheckpoint:
    """A GGUF file's tensors under Hugging Face names, read lazily (the loader's
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
        opened = open_gguf(path)
        self._arch = opened.metadata.get("general.architecture", "llama")
        self._tensors = {}
        self._unmapped = []
        for t in opened.tensors:
            name = hf_tensor_name(t.name, self._arch)
            if name is not None:
                self._tensors[name] = t
            elif not is_config_tensor(t.name):
                self._unmapped.append(t.name)
        self._heads = ({"self_attn.q_proj": num_heads, "self_attn.k_proj": num_kv_heads}
                       if self._arch in PERMUTED_QK else {})
        #: Whether the names are those the modules ask for (no family checkpoint view).
        self.module_names = self._arch in MODULE_NAMED
        #: Qwen3-Next's DeltaNet key heads and their width (:func:`qkvz_rows`).
        self._deltanet = self._arch == "qwen3next" and tuple(
            int(opened.metadata.get(f"qwen3next.ssm.{k}", 0))
            for k in ("group_count", "state_size"))
        self._read: set[str] = set()
        self._stack: tuple[str, np.ndarray] | None = None   # the last expert stack read

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
            parts = decode_blocks(np.asarray(t.data), t.type_name, cols)
            q, scale, offset = (self._hf_rows(name, a) for a in parts)
            packed = pack_weight(q, scale, offset, PACKABLE_TYPES[t.type_name][0])
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
        if t.type_name not in allowed:
            raise UnsupportedModelError(f"tensor {t.name} in {self._path!r} is stored as "
                                        f"{t.type_name}{refusal}")
        return t

    def _hf_rows(self, name: str, rows: np.ndarray) -> np.ndarray:
        """A weight's per-row array (values, integers or scales) in Hugging Face row order
        (the Q/K permutation undone for ``q_proj`` and ``k_proj``)."""
        module = name.rsplit(".", 1)[0].split(".", 3)[-1]   # e.g. "self_attn.q_proj"
        return unpermute_rows(rows, self._heads[module]) if module in self._heads else rows

    def get(self, name: str) -> np.ndarray | None:
        """Tensor ``name`` (Hugging Face naming and layout: a weight ``[out, in]``) as float32,
        or None if the file lacks it; an expert's weight
        (``model.layers.{i}.mlp.experts.{e}.gate_proj.weight``) is its slice of the layer's
        stacked tensor; Qwen3-Next's DeltaNet tensors as transformers stores them
        (:mod:`jaxpaged.models.gguf_deltanet`).

        Raises:
            UnsupportedModelError: a tensor type outside :data:`SUPPORTED_TENSOR_TYPES`.
            ValueError: Qwen3-Next ``attn_qkv`` / ``attn_gate`` rows that do not fit its
                ``ssm.*`` heads.
        """
        parts = self._deltanet and fused_parts(name)
        if parts:
            qkv, z = (self.get(p) for p in parts)
            return None if qkv is None or z is None else qkvz_rows(qkv, z, *self._deltanet)
        expert = expert_slice(name)
        if expert is not None and name not in self._tensors:
            stack, e = expert
            if self._stack is None or self._stack[0] != stack:
                whole = self._dequantized(stack)
                if whole is None:
                    return None
                self._stack = (stack, whole)
            return self._stack[1][e] if e < len(self._stack[1]) else None
        w = self._dequantized(name)
        if w is None:
            return None
        offset = norm_offset(self._arch, name)
        w = self._hf_rows(name, w - offset if offset else w)
        return restore(name, w) if self._deltanet else w

    def _dequantized(self, name: str) -> np.ndarray | None:
        """The file's tensor ``name`` as float32 in numpy order (``[out, in]``, a stack of
        experts ``[experts, out, in]``), or None if it lacks it."""
        t = self._tensor(name, SUPPORTED_TENSOR_TYPES,
                         f"; supported: {list(SUPPORTED_TENSOR_TYPES)}")
        if t is None:
            return None
        # ggml lists dimensions fastest first: [in, out] is numpy's [out, in].
        shape = tuple(int(d) for d in reversed(t.shape))
        if t.type_name in ("F32", "F16"):       # (a packed model's norms: no gguf import)
            return np.asarray(t.data, np.float32).reshape(shape)
        import gguf

        return np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32).reshape(shape)
