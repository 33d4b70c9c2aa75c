"""Qwen3-Next's Gated DeltaNet tensors as llama.cpp's converter stores them, given back in
transformers' layout (``Qwen3NextModel.modify_tensors`` of ``convert_hf_to_gguf.py``, which
this undoes; the layout it restores is transformers' ``Qwen3NextGatedDeltaNet``'s):

- ``in_proj_qkvz`` [Hk * (2 * Dk + 2 * r * Dv), H] holds, per key head, its q rows, its k
  rows, then the v and z rows of its ``r = Hv / Hk`` value heads; the converter writes
  ``attn_qkv`` (every q row, then every k row, then every v row) and ``attn_gate`` (every z
  row), which :func:`qkvz_rows` interleaves back per key head;
- ``A_log`` [Hv] is stored as ``ssm_a = -exp(A_log)``, given back as ``log(-ssm_a)``;
- ``conv1d.weight`` [C, 1, K] is stored squeezed (``ssm_conv1d``, [C, K]).

The names are :mod:`jaxpaged.models.gguf_names`' (``attn_qkv`` and ``attn_gate`` read as
``linear_attn.in_proj_qkv`` / ``linear_attn.in_proj_z``, which no module asks for).
"""

from __future__ import annotations

import numpy as np

#: The fused tensor the modules ask for, and the two stored tensors it is made of.
FUSED = "linear_attn.in_proj_qkvz.weight"
PARTS = ("linear_attn.in_proj_qkv.weight", "linear_attn.in_proj_z.weight")


def fused_parts(name: str) -> list[str] | None:
    """The stored tensors (Hugging Face-style names) that ``name`` is made of, if it is a
    layer's ``in_proj_qkvz``; else None."""
    if not name.endswith(FUSED):
        return None
    base = name[:-len(FUSED)]
    return [base + part for part in PARTS]


def qkvz_rows(qkv: np.ndarray, z: np.ndarray, num_k_heads: int, k_head_dim: int) -> np.ndarray:
    """transformers' ``in_proj_qkvz`` rows from the converter's ``attn_qkv`` and ``attn_gate``.

    Args:
        qkv: [2 * Hk * Dk + Hv * Dv, H]: every q row, every k row, every v row.
        z: [Hv * Dv, H] the output gate's rows.
        num_k_heads, k_head_dim: Hk and Dk (``ssm.group_count``, ``ssm.state_size``).

    Returns:
        [Hk * (2 * Dk + 2 * r * Dv), H]: per key head its q, k, v and z rows.

    Raises:
        ValueError: rows that do not split into Hk groups (named).
    """
    key = num_k_heads * k_head_dim
    if qkv.shape[0] <= 2 * key or (qkv.shape[0] - 2 * key) % num_k_heads or \
            z.shape[0] % num_k_heads or qkv.shape[1:] != z.shape[1:]:
        raise ValueError(f"attn_qkv {qkv.shape} and attn_gate {z.shape} do not split into "
                         f"{num_k_heads} key heads of {k_head_dim}")
    group = lambda rows: rows.reshape(num_k_heads, -1, *rows.shape[1:])
    parts = [group(qkv[:key]), group(qkv[key:2 * key]), group(qkv[2 * key:]), group(z)]
    return np.concatenate(parts, axis=1).reshape(-1, *qkv.shape[1:])


def restore(name: str, w: np.ndarray) -> np.ndarray:
    """Tensor ``name`` (Hugging Face naming) in transformers' values and shape: ``A_log``
    from ``-exp(A_log)``, the convolution's ``[C, K]`` as ``[C, 1, K]``; others as given."""
    if name.endswith("linear_attn.A_log"):
        return np.log(-w)
    if name.endswith("linear_attn.conv1d.weight"):
        return w[:, None, :]
    return w
