"""The fields of a transformers ``config.json`` that need more than a lookup: RoPE (both
transformers 4's and 5's layouts, Llama 3 scaling), per-layer sliding windows, and a
checkpoint's own quantization. :meth:`jaxpaged.config.ModelConfig.from_dict` calls them.
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxpaged.errors import UnsupportedModelError

#: AWQ group size when a float checkpoint is quantized with ``--quantization awq``.
DEFAULT_AWQ_GROUP_SIZE = 128


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3's RoPE frequency scaling (``rope_type: llama3``).

    Frequencies whose wavelength exceeds ``original_max_position_embeddings /
    low_freq_factor`` are divided by ``factor``, those shorter than ``... /
    high_freq_factor`` are kept, and the band between is interpolated (Meta's Llama 3.1
    release, as implemented by transformers' ``_compute_llama3_parameters``).
    """

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


def rope_parameters(cfg: dict) -> tuple[float, RopeScaling | None]:
    """RoPE theta and scaling from either layout.

    transformers < 5 writes ``rope_theta`` and ``rope_scaling``; transformers 5 writes one
    ``rope_parameters`` dict holding ``rope_theta``, ``rope_type`` and the scaling fields.

    Raises:
        UnsupportedModelError: a non-positive theta, a scaling type other than ``default``
            and ``llama3``, or a llama3 scaling that lacks a field or has
            ``high_freq_factor <= low_freq_factor``.
    """
    params = cfg.get("rope_parameters")
    if isinstance(params, dict):
        theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    else:
        params = cfg.get("rope_scaling") if isinstance(cfg.get("rope_scaling"), dict) else {}
        theta = cfg.get("rope_theta", 10000.0)
    rope_type = params.get("rope_type", params.get("type"))
    if not float(theta) > 0:
        raise UnsupportedModelError(f"rope_theta must be positive, got {theta!r}")
    if rope_type in (None, "default"):
        return float(theta), None
    if rope_type != "llama3":
        raise UnsupportedModelError(f"unsupported rope scaling type {rope_type!r}; "
                                    "supported: default, llama3")
    fields = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [f for f in fields if f not in params]
    if missing:
        raise UnsupportedModelError(f"llama3 rope scaling lacks {missing}")
    if not float(params["high_freq_factor"]) > float(params["low_freq_factor"]):
        raise UnsupportedModelError("llama3 rope scaling needs high_freq_factor > "
                                    f"low_freq_factor, got {params['high_freq_factor']!r} and "
                                    f"{params['low_freq_factor']!r}")
    return float(theta), RopeScaling(float(params["factor"]), float(params["low_freq_factor"]),
                                     float(params["high_freq_factor"]),
                                     int(params["original_max_position_embeddings"]))


def sliding_windows(cfg: dict, arch: str) -> tuple[int | None, ...]:
    """Each layer's sliding window (None: full attention).

    transformers 5 writes ``layer_types`` (``sliding_attention`` / ``full_attention``) for the
    families that mix them; older configs are read as transformers did: Qwen2/3 slide only
    with ``use_sliding_window`` and from layer ``max_window_layers`` on, Gemma 2 slides on
    even layers, Mistral and Mixtral on every layer whenever ``sliding_window`` is set.

    Raises:
        UnsupportedModelError: ``layer_types`` of the wrong length or with unknown kinds, or
            a ``sliding_window`` that is not a positive integer.
    """
    n = int(cfg["num_hidden_layers"])
    window = cfg.get("sliding_window")
    if arch.startswith("Qwen") and not cfg.get("use_sliding_window", False):
        window = None
    if window is None:
        return (None,) * n
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise UnsupportedModelError(f"sliding_window must be a positive integer, got {window!r}")
    kinds = cfg.get("layer_types")
    if kinds is None:
        if arch.startswith("Qwen"):
            first = int(cfg.get("max_window_layers", n))
            kinds = ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
        elif arch == "Gemma2ForCausalLM":
            kinds = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
        else:
            kinds = ["sliding_attention"] * n
    if len(kinds) != n or not set(kinds) <= {"sliding_attention", "full_attention"}:
        raise UnsupportedModelError(f"layer_types {kinds!r} must name sliding_attention or "
                                    f"full_attention for each of the {n} layers")
    return tuple(window if k == "sliding_attention" else None for k in kinds)


def optional_float(cfg: dict, key: str) -> float | None:
    return None if cfg.get(key) is None else float(cfg[key])


def checkpoint_quantization(qc: dict | None) -> tuple[str | None, int]:
    """The quantization a checkpoint is stored in and its AWQ group size, from ``config.json``'s
    ``quantization_config``: None for a float checkpoint, ``"fp8"`` for fp8 weights with
    per-tensor or per-channel scales (``quant_method`` ``"fp8"``, or ``"compressed-tensors"``
    in its ``float-quantized`` format), ``"awq"`` for AutoAWQ's format (``bits`` 4,
    ``zero_point`` true, ``version`` ``gemm``; its ``group_size``).

    Raises:
        UnsupportedModelError: any other layout, naming its ``quant_method``.
    """
    if qc is None:
        return None, DEFAULT_AWQ_GROUP_SIZE
    method = qc.get("quant_method")
    if method == "awq":
        settings = (qc.get("bits", qc.get("w_bit")), qc.get("zero_point", True),
                    str(qc.get("version", "gemm")).lower())
        group = qc.get("group_size", qc.get("q_group_size"))
        if settings != (4, True, "gemm") or not isinstance(group, int) or group < 8:
            raise UnsupportedModelError(
                f"AWQ checkpoint with bits/zero_point/version {settings} and group_size "
                f"{group!r} is not supported; jaxpaged reads AutoAWQ's 4-bit GEMM format "
                "with zero points and a positive group size")
        return "awq", group
    if method == "fp8":
        block = qc.get("weight_block_size")
        problem = f"block-wise scales (weight_block_size {block})" if block else None
    elif method == "compressed-tensors":
        schemes = [g.get("weights") or {} for g in (qc.get("config_groups") or {}).values()]
        fp8 = schemes and all((w.get("type"), w.get("num_bits")) == ("float", 8)
                              and w.get("strategy") in ("tensor", "channel") for w in schemes)
        problem = (f"format {qc.get('format')!r}" if qc.get("format") != "float-quantized" else
                   None if fp8 else f"weight schemes {schemes}")
    else:
        problem = "this method"
    if problem is None:
        return "fp8", DEFAULT_AWQ_GROUP_SIZE
    raise UnsupportedModelError(
        f"quantized checkpoint with quant_method {method!r} is not supported ({problem}); "
        "jaxpaged loads fp8 checkpoints with per-tensor or per-channel scales (quant_method "
        "'fp8', or 'compressed-tensors' in format 'float-quantized') and AutoAWQ checkpoints "
        "(quant_method 'awq'), and quantizes float checkpoints itself with --quantization "
        "int8, fp8 or awq")
