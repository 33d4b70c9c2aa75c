"""Keeps CPython's cyclic garbage collector off the objects that start-up leaves behind.

A loaded engine holds a few hundred thousand GC-tracked objects (JAX, Flax, the model, the
compiled steps). A full (generation-2) collection walks all of them: about 150 ms on a
2-core EPYC, landing in whichever engine step happens to trigger it. vLLM moves them out of
the collector's reach once start-up is done (``freeze_gc_heap`` in ``vllm/utils/gc_utils.py``,
called at the end of ``compile_or_warm_up_model``: collect, then ``gc.freeze()``), so that
collections while serving walk only the objects made since. jaxpaged does the same at the end
of ``Engine.__init__`` (after ``precompile``), and again after any step that compiled a new
step shape (``--enforce-eager``, or a shape ``precompile`` leaves out: logprobs), since
compiling is what makes start-up's garbage. The collection before each freeze walks only the
objects that are not frozen yet (tens of milliseconds, next to a compile's hundreds).

Frozen objects are still freed when their reference count drops to zero (a dropped engine
is); only reference cycles among them are never collected.
"""

from __future__ import annotations

import gc


def freeze_gc_heap() -> None:
    """Collect garbage, then move every object still alive into the permanent generation,
    which collections skip (``gc.freeze``)."""
    gc.collect()
    gc.freeze()


class CompileAwareHeapFreezer:
    """Freezes the GC heap whenever the engine's count of compiled step shapes has moved
    since the last freeze (the first call always freezes)."""

    def __init__(self) -> None:
        self._num_compilations: int | None = None

    def update(self, num_compilations: int) -> bool:
        """Freeze the heap if ``num_compilations`` (the runner's count of compiled step
        shapes) differs from the count at the last freeze; returns whether it froze."""
        if num_compilations == self._num_compilations:
            return False
        freeze_gc_heap()
        self._num_compilations = num_compilations
        return True
