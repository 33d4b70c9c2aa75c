"""Start-up in two parts: the step shapes a first short request needs, then the rest on a
background thread while the server already answers.

A server's ``/health`` waited for every step shape to compile (27 executables for SmolLM2 on
the 2-core CPU: 30 s of a 38 s start with an empty compile cache). :func:`split_shapes` keeps
for the start-up the shapes of one short request (its prompt step of up to
:data:`FIRST_PROMPT_TOKENS` tokens and its decode steps in the smallest sequence bucket);
:func:`precompile_in_background` compiles the others on a daemon thread, smallest first. A step
that needs a shape not compiled yet compiles it on the spot, after the compilation in
progress (``ModelRunner._compiled`` holds one lock), so requests wait but never fail. (vLLM
compiles its CUDA graphs before serving; its start-up on a GPU is dominated by other work.)
"""

from __future__ import annotations

import logging
import threading
import time

logger = logging.getLogger(__name__)

#: The longest prompt step the start-up compiles before serving (tokens, bucketed).
FIRST_PROMPT_TOKENS = 64


def split_shapes(shapes: list[tuple]) -> tuple[list[tuple], list[tuple]]:
    """``(T, B, P, decode_only, ...)`` step shapes -> (the start-up's: decode steps of the
    smallest sequence bucket and prompt steps of up to :data:`FIRST_PROMPT_TOKENS` tokens,
    the rest, smallest token count first)."""
    smallest = min((s[1] for s in shapes if s[3]), default=None)
    first = [s for s in shapes if (s[3] and s[1] == smallest) or
             (not s[3] and len(s) == 4 and s[0] <= FIRST_PROMPT_TOKENS)]
    rest = sorted((s for s in shapes if s not in first), key=lambda s: (s[0], s[1]))
    return first, rest


def precompile_in_background(runner, shapes: list[tuple]) -> threading.Thread:
    """Compile ``shapes`` (:meth:`ModelRunner.precompile`) on a daemon thread; returns it."""
    def run():
        t0 = time.perf_counter()
        try:
            runner.precompile(shapes=shapes, progress=False)
        except Exception:  # noqa: BLE001 - a shape that fails compiles again when needed
            logger.exception("background compilation stopped; the remaining step shapes "
                             "compile when a step needs them")
            return
        logger.info("background compilation of %d step shapes done in %.1f s", len(shapes),
                    time.perf_counter() - t0)

    logger.info("compiling %d more step shapes in the background", len(shapes))
    thread = threading.Thread(target=run, name="jaxpaged-background-compile", daemon=True)
    thread.start()
    return thread
