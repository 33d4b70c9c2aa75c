"""gpt-oss checkpoint tensors as :mod:`jaxpaged.models.gpt_oss`'s modules ask for them, MXFP4
experts dequantized on load.

transformers stores each layer's experts stacked: ``mlp.experts.gate_up_proj`` [E, H, 2I]
(gate and up interleaved: gate in the even columns, up in the odd ones, as
``GptOssExperts._apply_gate`` splits them), ``gate_up_proj_bias`` [E, 2I], ``down_proj``
[E, I, H] and ``down_proj_bias`` [E, H]; the attention sinks are ``self_attn.sinks``
[num_heads]. The loader asks for Mixtral-style per-expert weights
(``mlp.experts.{e}.w1.weight`` [I, H], ``w3`` the up columns, ``w2`` [H, I]), their biases as
``mlp.experts.{e}.w1_bias.weight`` and the sinks as ``self_attn.sinks.weight``; this view answers
those from the stacked tensors (each read once per layer, not once per expert; MXFP4 ones
dequantized an expert at a time).

OpenAI's checkpoints store the expert kernels in MXFP4 (OCP Microscaling Formats v1.0,
section 5.3.3: blocks of 32 FP4 E2M1 values sharing one E8M0 power-of-two scale):
``gate_up_proj_blocks`` [E, 2I, H / 32, 16] uint8 (two values a byte, the low nibble first),
``gate_up_proj_scales`` [E, 2I, H / 32] uint8 (exponent + 127), likewise ``down_proj_*`` with
rows H and columns I; :func:`dequantize_mxfp4` turns them into the float layout above, as
transformers' ``convert_moe_packed_tensors`` does. They are dequantized on load: jaxpaged
keeps no packed MXFP4 weights on the device yet.
"""

from __future__ import annotations

import re

import numpy as np

#: The 16 FP4 E2M1 values by their 4-bit code (sign bit 3).
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)

_EXPERT = re.compile(r"^(.*\.experts\.)(\d+)\.(w[123])(_bias)?\.weight$")
#: Which stacked tensor each expert weight comes from, and its columns (gate even, up odd).
_SOURCE = {"w1": ("gate_up_proj", slice(0, None, 2)), "w3": ("gate_up_proj", slice(1, None, 2)),
           "w2": ("down_proj", slice(None))}


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """MXFP4 blocks -> float32 (module docstring).

    Args:
        blocks: [..., R, G, 16] uint8, 32 FP4 codes of each of the G blocks of R rows.
        scales: [..., R, G] uint8 E8M0 exponents (biased by 127).

    Returns:
        [..., G * 32, R] float32: the rows' values, transposed (the stacked experts' [in, out]
        layout).

    Raises:
        ValueError: shapes that do not fit or dtypes other than uint8 (named).
    """
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8 or blocks.shape[-1] != 16 \
            or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {blocks.shape} {blocks.dtype} and scales {scales.shape} "
                         f"{scales.dtype} must be uint8 [..., R, G, 16] and [..., R, G]")
    values = np.stack([FP4_VALUES[blocks & 0x0F], FP4_VALUES[blocks >> 4]], axis=-1)
    values = np.ldexp(values.reshape(*blocks.shape[:-1], 32),
                      scales.astype(np.int32)[..., None] - 127)
    return np.swapaxes(values.reshape(*blocks.shape[:-2], -1), -1, -2)


class GptOssCheckpoint:
    """A checkpoint reader seen through gpt-oss's names (module docstring); other attributes
    (``unread``) are the reader's.

    Raises (from ``get``):
        ValueError: MXFP4 blocks and scales that do not fit (:func:`dequantize_mxfp4`).
    """

    def __init__(self, reader):
        self._reader = reader
        #: The stacked tensors of the layer being read (the loader reads a layer's experts in
        #: turn): float arrays, or MXFP4 (blocks, scales) dequantized an expert at a time.
        self._layer: dict[str, np.ndarray | tuple[np.ndarray, np.ndarray] | None] = {}

    def __getattr__(self, name):
        return getattr(self._reader, name)

    def get(self, name: str) -> np.ndarray | None:
        """Tensor ``name`` as the modules ask for it; None when the checkpoint lacks it."""
        if name.endswith(".self_attn.sinks.weight"):
            return self._reader.get(name.removesuffix(".weight"))
        m = _EXPERT.match(name)
        if m is None:
            return self._reader.get(name)
        source, columns = _SOURCE[m.group(3)]
        bias = m.group(4) is not None
        expert = self._expert(m.group(1) + source + ("_bias" if bias else ""), int(m.group(2)))
        if expert is None:
            return None
        return expert[columns] if bias else expert[:, columns].T

    def _expert(self, name: str, e: int) -> np.ndarray | None:
        """Expert ``e``'s slice of the stacked tensor ``name`` (a kernel's [in, out], a bias's
        [out]), stored as it is or, for a kernel, as MXFP4 ``_blocks`` and ``_scales``."""
        if name not in self._layer:
            prefix = name.rpartition("experts.")[0]
            self._layer = {k: v for k, v in self._layer.items() if k.startswith(prefix)}
            stored = self._reader.get(name)
            if stored is None and not name.endswith("_bias"):
                blocks, scales = (self._reader.get(f"{name}_{p}") for p in ("blocks", "scales"))
                stored = None if blocks is None or scales is None else (blocks, scales)
            self._layer[name] = stored
        stored = self._layer[name]
        if isinstance(stored, tuple):
            return dequantize_mxfp4(stored[0][e], stored[1][e])
        return None if stored is None else stored[e]
