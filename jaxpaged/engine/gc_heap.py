"""Keeps CPython's cyclic garbage collector off the objects that start-up leaves behind.

A loaded engine holds a few hundred thousand GC-tracked objects (JAX, Flax, the model, the
compiled steps). A full (generation-2) collection walks all of them, a pause that lands in
whichever engine step happens to trigger it (``docs/measurements.md``, "Garbage collection").
vLLM moves them out of the collector's reach once start-up is done (``freeze_gc_heap`` in
``vllm/utils/gc_utils.py``, called at the end of ``compile_or_warm_up_model``: collect, then
``gc.freeze()``), so that collections while serving walk only the objects made since. jaxpaged
does the same at the end of ``Engine.__init__`` (after ``precompile``), and again after any
step that compiled a new step shape (``--enforce-eager``, or a shape ``precompile`` leaves out:
logprobs), since compiling is what makes start-up's garbage. The collection before each freeze
walks only the objects that are not frozen yet (tens of milliseconds, next to a compile's
hundreds).

Frozen objects are still freed when their reference count drops to zero (a dropped engine
is); only reference cycles among them are never collected.

Start-up itself runs with automatic collection off (:func:`collector_paused` around
``Engine.__init__``; ``jaxpaged serve`` from its first line until the warm-up request is done,
:func:`pause_for_start_up`): importing JAX, Flax, transformers and the server and building
the model allocate millions of objects and almost no cyclic garbage, yet CPython walked the
growing heap ~600 times doing it, a sixth of a warm start's single-threaded Python
(``docs/measurements.md``, "Garbage collection"). The freeze that ends start-up collects
once.

The first freeze also raises the youngest generation's threshold to at least
:data:`GEN0_THRESHOLD`. CPython collects generation 0 once GC-tracked allocations exceed
deallocations by its threshold (700 by default), and a step of a large batch holds a few
objects per sequence at once (its plan, the outputs it returns): at 256 sequences that
crosses 700 in every step, and each collection walks every young object, the growing token
lists of cumulative outputs included (``docs/measurements.md``, "Garbage collection", has
the counts with and without the raised threshold). The engine's
own objects die by reference count, so a higher threshold only delays reclaiming reference
cycles, which the engine does not make per step.
"""

from __future__ import annotations

import functools
import gc

#: The least generation-0 threshold the engine runs with (see the module docstring).
GEN0_THRESHOLD = 20_000


def freeze_gc_heap() -> None:
    """Collect garbage, then move every object still alive into the permanent generation,
    which collections skip (``gc.freeze``)."""
    gc.collect()
    gc.freeze()


def collector_paused(fn):
    """Decorate ``fn`` to run with automatic collection off, turned back on when it returns
    or raises (left off if it was off already, e.g. by :func:`pause_for_start_up`)."""

    @functools.wraps(fn)
    def paused(*args, **kwargs):
        if not gc.isenabled():
            return fn(*args, **kwargs)
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            gc.enable()

    return paused


_start_up_pause = False


def pause_for_start_up() -> None:
    """Turn automatic collection off until :func:`end_start_up_pause` (a server process, from
    its first line to its first served request; nothing if collection is off already)."""
    global _start_up_pause
    if gc.isenabled():
        gc.disable()
        _start_up_pause = True


def end_start_up_pause() -> None:
    """Turn automatic collection back on if :func:`pause_for_start_up` turned it off."""
    global _start_up_pause
    if _start_up_pause:
        _start_up_pause = False
        gc.enable()


def raise_gen0_threshold(minimum: int = GEN0_THRESHOLD) -> None:
    """Make generation 0's threshold at least ``minimum`` (never lowers it; the older
    generations' thresholds are kept). A threshold of 0, CPython's way of switching
    automatic collection off, is left as it is."""
    gen0, gen1, gen2 = gc.get_threshold()
    if 0 < gen0 < minimum:
        gc.set_threshold(minimum, gen1, gen2)


class CompileAwareHeapFreezer:
    """Freezes the GC heap whenever the engine's count of compiled step shapes has moved
    since the last freeze (the first call always freezes, and raises generation 0's
    threshold: :func:`raise_gen0_threshold`)."""

    def __init__(self) -> None:
        self._num_compilations: int | None = None

    def update(self, num_compilations: int) -> bool:
        """Freeze the heap if ``num_compilations`` (the runner's count of compiled step
        shapes) differs from the count at the last freeze; returns whether it froze."""
        if num_compilations == self._num_compilations:
            return False
        if self._num_compilations is None:
            raise_gen0_threshold()
        freeze_gc_heap()
        self._num_compilations = num_compilations
        return True
