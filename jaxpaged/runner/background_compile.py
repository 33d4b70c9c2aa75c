"""Start-up in two parts: the step shapes a first short request needs, then the rest on a
background thread while the server already answers.

A server's ``/health`` waited for every step shape to compile (27 executables for SmolLM2 on
the 2-core CPU: 30 s of a 38 s start with an empty compile cache). :func:`split_shapes` keeps
for the start-up two forward shapes: the decode step of the smallest sequence bucket and the
prompt step of the widest token bucket up to :data:`FIRST_PROMPT_TOKENS` tokens (with their
samplers: 6 executables, 4.6 s for SmolLM2 on a Zen 4 core, where the four shapes of every
prompt bucket up to 64 tokens took 9.3 s); :func:`precompile_in_background` compiles the others
on a daemon thread, smallest first. Until a step's own shape is ready, the runner pads it to
the smallest ready shape that holds it (``ModelRunner.ready_pad_sizes``: a 20-token prompt
runs in the 64-token program), and only a step that no ready shape holds compiles its own on
the spot, after the compilation in progress (``ModelRunner._compiled`` holds one lock), so
requests wait but never fail. (vLLM compiles its CUDA graphs before serving; its start-up
on a GPU is dominated by other work.)
"""

from __future__ import annotations

import logging
import threading
import time

logger = logging.getLogger(__name__)

#: The longest prompt step the start-up compiles before serving (tokens, bucketed).
FIRST_PROMPT_TOKENS = 64


def split_shapes(shapes: list[tuple]) -> tuple[list[tuple], list[tuple]]:
    """``(T, B, P, decode_only, ...)`` step shapes -> (the start-up's: the decode step of the
    smallest sequence bucket and the prompt step of the widest token bucket up to
    :data:`FIRST_PROMPT_TOKENS` tokens (the smallest token bucket if none is that small),
    each with the widest page bucket and the fewest rows; the rest, smallest token count
    first, decode steps before prompt steps of as many tokens)."""
    decodes = [s for s in shapes if s[3]]
    prompts = [s for s in shapes if not s[3] and len(s) == 4]
    first = []
    if decodes:
        smallest = min(s[1] for s in decodes)
        first.append(max((s for s in decodes if s[1] == smallest), key=lambda s: s[2]))
    if prompts:
        short = [s for s in prompts if s[0] <= FIRST_PROMPT_TOKENS]
        tokens = max(s[0] for s in short) if short else min(s[0] for s in prompts)
        first.append(min((s for s in prompts if s[0] == tokens), key=lambda s: (s[1], -s[2])))
    rest = sorted((s for s in shapes if s not in first), key=lambda s: (s[0], not s[3], s[1]))
    return first, rest


def precompile_in_background(runner, shapes: list[tuple]) -> threading.Thread:
    """Compile ``shapes`` (:meth:`ModelRunner.precompile`) on a daemon thread, steps of
    those shapes running in wider compiled ones meanwhile (:meth:`ModelRunner.defer_shapes`);
    returns the thread."""
    def run():
        t0 = time.perf_counter()
        try:
            runner.precompile(shapes=shapes, progress=False)
        except Exception:  # noqa: BLE001 - a shape that fails compiles again when needed
            logger.exception("background compilation stopped; the remaining step shapes "
                             "compile when a step needs them")
            runner.defer_shapes([])
            return
        logger.info("background compilation of %d step shapes done in %.1f s", len(shapes),
                    time.perf_counter() - t0)

    logger.info("compiling %d more step shapes in the background", len(shapes))
    runner.defer_shapes(shapes)
    thread = threading.Thread(target=run, name="jaxpaged-background-compile", daemon=True)
    thread.start()
    return thread
