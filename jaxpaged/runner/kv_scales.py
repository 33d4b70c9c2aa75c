"""Per-layer KV scales of the fp8 KV cache: 1.0 by default, or calibrated at start-up.

Each layer's pool stores ``K / k_scale`` and ``V / v_scale`` in float8_e4m3fn (the layout is
in ``jaxpaged.layers.attention.base``, the rounding rule in ``pallas_kernels.kv_quant``). vLLM
takes the scales from a quantized checkpoint, or computes them with ``--calculate-kv-scales``,
and otherwise uses 1.0. jaxpaged does the same, minus checkpoint scales:

- default: 1.0 for every layer;
- ``--calculate-kv-scales``: at start-up, one prefill of :data:`CALIBRATION_TEXT` in the
  model's own dtype (no quantization) gives each layer's largest |K| and |V|, and the scales
  become ``amax(|K|) / K_SCALE_CONSTANT`` and ``amax(|V|) / V_SCALE_CONSTANT``, vLLM's rule and
  constants (``Attention.calc_kv_scales``; ``K_SCALE_CONSTANT = 200`` and
  ``V_SCALE_CONSTANT = 100`` in ``vllm/envs.py``). The calibration maximum then lands at 200
  (K) or 100 (V) of e4m3's 448, leaving 2.2x and 4.5x headroom for larger values in real
  requests before they saturate, while small values move out of the subnormal range (below
  2**-6) where e4m3 loses relative precision. vLLM calibrates on the first batch it serves;
  calibrating on a fixed text at start-up instead keeps the scales, and so every output,
  independent of which request happens to come first, and lets them be compiled into the step
  as constants.

Measured on the bundled stories260K (64 reference positions; the full table is in
``tests/test_kv_cache_fp8.py``): its K magnitudes reach about 26 and its V about 3, and at
scale 1.0 2-4% of V sits below 2**-6. With a float32 model both settings keep all 64 top-1
choices of the float32 reference and its greedy text; calibration cuts the mean logit error
from 0.31 to 0.21 and the largest from 2.97 to 1.70. With a bfloat16 model, scale 1.0 keeps the
first 16 greedy tokens and then departs from the reference; calibrated scales keep all 60.

The scales reach attention as static floats on each layer's backend
(:meth:`jaxpaged.layers.attention.AttentionBackend.with_kv_scales`), set here on the model's
attention modules.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import jax.numpy as jnp
from flax import nnx

from jaxpaged.distributed.multihost import to_host
from jaxpaged.layers.attention import AttentionBackend
from pallas_kernels.kv_quant import is_fp8


class PrefillRunner(Protocol):
    """What calibration needs of a runner (``ModelRunner`` has it; the runner imports this
    module for :func:`set_kv_scales`, so this one names no runner class)."""

    def run_prefill(self, token_ids: list[int]) -> tuple[Any, list]:
        """One prefill of ``token_ids`` on a scratch pool: (logits, ``[(k_pages, v_pages)]``
        per layer), as :meth:`jaxpaged.runner.model_runner.ModelRunner.run_prefill`."""

#: vLLM's ``K_SCALE_CONSTANT``: a calibrated key scale maps the largest |K| seen to this value.
K_SCALE_CONSTANT = 200.0
#: vLLM's ``V_SCALE_CONSTANT``: a calibrated value scale maps the largest |V| seen to this value.
V_SCALE_CONSTANT = 100.0

#: The calibration prompt (plain English prose, not taken from any test or benchmark input).
CALIBRATION_TEXT = (
    "The little boat rocked on the lake while the children watched from the shore. They "
    "laughed, pointed at the ducks and asked their mother why the water was so cold. She "
    "smiled, wrapped them in a warm blanket and told them a story about the sun, the wind "
    "and a brave fish who wanted to see the sea. When the story ended, the sky had turned "
    "orange and it was time to walk home for dinner."
)

KVScales = list[tuple[float, float]]


def calibration_token_ids(tokenizer, max_tokens: int, vocab_size: int) -> list[int]:
    """:data:`CALIBRATION_TEXT` as token ids (with the tokenizer's BOS), at most
    ``max_tokens`` of them (the model's trained context; no engine limit enters, so the
    scales depend on the model and tokenizer alone).

    Raises:
        ValueError: the tokenizer yields ids outside the model's ``vocab_size`` (a tokenizer
            that does not belong to the model).
    """
    ids = tokenizer.encode(CALIBRATION_TEXT)[:max_tokens]
    if max(ids) >= vocab_size:
        raise ValueError(f"the tokenizer gives the KV-scale calibration text token ids up to "
                         f"{max(ids)}, outside the model's vocabulary of {vocab_size}: it does "
                         "not belong to this model (--calculate-kv-scales needs the model's "
                         "own tokenizer)")
    return ids


def calibrate_kv_scales(runner: PrefillRunner, token_ids: list[int]) -> KVScales:
    """Per-layer ``(k_scale, v_scale)`` from one prefill of ``token_ids``.

    Args:
        runner: a runner whose pool is in the model's dtype (unquantized, scales 1.0), so
            the scratch pool holds the prompt's K and V exactly.
        token_ids: the calibration prompt.

    Returns:
        One ``(amax|K| / K_SCALE_CONSTANT, amax|V| / V_SCALE_CONSTANT)`` per layer, maxima
        over every token and head of the layer (on every device under tensor parallelism);
        1.0 for a tensor that is all zeros.

    Raises:
        ValueError: the runner's pool is fp8 (it would report clipped values), or the
            prefill's K or V is not finite.
    """
    _, pool = runner.run_prefill(token_ids)
    if is_fp8(pool[0][0].dtype):
        raise ValueError("calibrate KV scales on a pool in the model's dtype, not fp8")

    def scale(pages, constant):
        amax = float(to_host(jnp.max(jnp.abs(pages.astype(jnp.float32)))))
        if not math.isfinite(amax):
            raise ValueError(f"the calibration prefill produced non-finite K/V ({amax})")
        return amax / constant if amax > 0 else 1.0

    return [(scale(k, K_SCALE_CONSTANT), scale(v, V_SCALE_CONSTANT)) for k, v in pool]


def attention_modules(model: nnx.Module) -> list[nnx.Module]:
    """The model's modules that call an attention backend (attribute ``backend``), in graph
    order, which is layer order: every model in ``jaxpaged.models`` walks its
    ``layers`` list in order and layer i uses pool entry i."""
    return [module for _, module in nnx.iter_modules(model)
            if isinstance(getattr(module, "backend", None), AttentionBackend)]


def set_kv_scales(model: nnx.Module, scales: KVScales) -> None:
    """Give layer i's attention the backend for ``scales[i]`` (in place, before the model
    is split for the runner).

    Raises:
        ValueError: the model has a different number of attention layers, or a scale is not
            a finite positive number.
    """
    modules = attention_modules(model)
    if len(modules) != len(scales):
        raise ValueError(f"{len(scales)} KV scale pairs for a model with {len(modules)} "
                         "attention layers")
    for module, (k_scale, v_scale) in zip(modules, scales):
        module.backend = module.backend.with_kv_scales(k_scale, v_scale)

