"""``--block-size auto``: the KV page size chosen at start-up.

Two things decide it:

- what the device's attention does best at the model's head shape: per page size, the time
  of a few representative attention steps of one layer (decodes, and decodes mixed with a
  prefill chunk), measured once per device kind and attention backend by
  ``python -m jaxpaged.benchmarks.kernels.page_size_table`` and kept in
  :data:`TABLE_PATH` (a JSON file in the package; ``--write`` replaces the entries it
  measured and keeps the others);
- internal fragmentation: a sequence's last page is on average half empty, so a page of
  ``p`` tokens wastes about ``p / 2`` slots per sequence, i.e. a fraction ``p /
  max_model_len`` of a sequence of half the maximum length (vLLM's paper, Kwon et al. 2023,
  section 4.2, on the block size trade-off: larger blocks read faster, waste more).

The score of a page size is ``relative_time(p) * (1 + p / max_model_len)`` and the lowest
wins (ties: the smaller page); page sizes above ``max_model_len`` are not considered. With
no table entry for the device and backend the default, 16, is kept. Pure Python (no JAX):
the caller passes what it knows about the device.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

#: The page sizes ``auto`` chooses from (powers of two, as ``--block-size`` requires).
CANDIDATES = (16, 32, 64, 128)
#: The page size without a table entry (vLLM's default ``--block-size``).
DEFAULT_PAGE_SIZE = 16
#: The tuning table (see the module docstring).
TABLE_PATH = os.path.join(os.path.dirname(__file__), "page_size_table.json")


@dataclass(frozen=True)
class PageSizeChoice:
    """The chosen page size and why.

    Attributes:
        page_size: tokens per page.
        reason: one line for the start-up log (the entry used and every candidate's score).
        scores: candidate -> score (empty without a table entry).
    """

    page_size: int
    reason: str
    scores: dict[int, float]


def load_table(path: str = TABLE_PATH) -> list[dict]:
    """The table's entries (``[]`` when the file is missing)."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return json.load(f)["entries"]


def find_entry(entries: list[dict], *, platform: str, device_kind: str, backend: str,
               head_dim: int, dtype: str) -> dict | None:
    """The entry measured for this device and attention shape: same platform, backend and
    KV dtype; the same device kind if there is one, else any of the platform; then the
    closest head_dim. None if no entry matches the platform, backend and dtype."""
    fits = [e for e in entries if e["platform"] == platform and e["backend"] == backend
            and e["dtype"] == dtype]
    same_kind = [e for e in fits if e["device_kind"] == device_kind]
    fits = same_kind or fits
    if not fits:
        return None
    return min(fits, key=lambda e: (abs(e["head_dim"] - head_dim), e["head_dim"]))


def choose_page_size(*, platform: str, device_kind: str, backend: str, head_dim: int,
                     dtype: str, max_model_len: int, entries: list[dict] | None = None
                     ) -> PageSizeChoice:
    """The page size for ``--block-size auto`` (see the module docstring).

    Args:
        platform: ``jax.devices()[0].platform`` (``cpu``, ``gpu``).
        device_kind: its ``device_kind`` (e.g. ``NVIDIA H200``).
        backend: the attention backend's name (``xla``, ``pallas``, ``cpu``).
        head_dim: the model's head width.
        dtype: the KV cache's dtype name (``float32``, ``bfloat16``, ``float8_e4m3fn``).
        max_model_len: the longest sequence.
        entries: the table (default: :func:`load_table`).
    """
    entries = load_table() if entries is None else entries
    entry = find_entry(entries, platform=platform, device_kind=device_kind, backend=backend,
                       head_dim=head_dim, dtype=dtype)
    if entry is None:
        return PageSizeChoice(DEFAULT_PAGE_SIZE, f"no tuning entry for {backend} attention on "
                              f"{device_kind} ({dtype}, head_dim {head_dim}) in "
                              f"{os.path.basename(TABLE_PATH)}; the default", {})
    times = {int(p): t for p, t in entry["ms"].items()
             if int(p) in CANDIDATES and (int(p) <= max_model_len or int(p) == CANDIDATES[0])}
    best = min(times.values())
    scores = {p: times[p] / best * (1 + p / max_model_len) for p in sorted(times)}
    page = min(scores, key=lambda p: (round(scores[p], 6), p))
    detail = ", ".join(f"{p}: {times[p] / best:.3f} x (1 + {p}/{max_model_len}) = {s:.3f}"
                       for p, s in scores.items())
    nearest = ("" if entry["head_dim"] == head_dim else
               f", the nearest measured to this model's head_dim {head_dim}")
    return PageSizeChoice(page, f"{backend} attention on {entry['device_kind']} ({dtype}, "
                          f"head_dim {entry['head_dim']}{nearest}) relative step time x "
                          f"internal waste: {detail}", scores)
