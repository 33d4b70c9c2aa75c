"""Start-up without waiting for every step program: the shapes a first short request
needs first, the rest on a background thread while the engine already runs steps.

A server's ``/health`` waited for every step shape to compile, most of a start with an empty
compile cache (``docs/measurements.md``, "Background compile"). :func:`split_shapes` picks
two forward shapes a first short request needs: the decode step of the smallest sequence
bucket and the prompt step of the widest token bucket up to :data:`FIRST_PROMPT_TOKENS`
tokens. :func:`compile_plan` says what compiles before the engine is handed out and what
:class:`BackgroundCompile` compiles on a daemon thread afterwards, smallest first:

- ``"serve"`` (``jaxpaged serve``): those two forwards before ``/health``; their samplers
  (a plain greedy step never runs one) and then every other shape in the background. Until a
  step's own shape is ready, the runner pads it to the smallest ready shape that holds it
  (``ModelRunner.ready_pad_sizes``: a 20-token prompt runs in the 64-token program), and only
  a step that no ready shape holds compiles its own on the spot, after the compilation in
  progress (``ModelRunner._compiled`` holds one lock), so requests wait but never fail.
- ``"offline"`` (``LLM()``): nothing before ``LLM()`` returns (its programs were most of a
  cold ``LLM()``: ``docs/measurements.md``, "Background compile"); the same order in the
  background, and a step whose program is not ready compiles it itself (no padding: its
  tokens never depend on how far the background got).
- None: every shape, forward and sampler, before the engine is handed out (multi-host jobs,
  whose processes must pick the same shapes).

(vLLM compiles its CUDA graphs before serving; its start-up on a GPU is dominated by other
work.)
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref

logger = logging.getLogger(__name__)

#: The longest prompt step the start-up compiles before serving (tokens, bucketed).
FIRST_PROMPT_TOKENS = 64


#: :func:`compile_plan`'s modes.
SERVE, OFFLINE = "serve", "offline"


def compile_plan(shapes: list[tuple], mode: str | None
                 ) -> tuple[list[tuple], list[tuple[list[tuple], bool, bool]]]:
    """``(T, B, P, decode_only, ...)`` step shapes -> (the shapes whose forwards compile
    before the engine is handed out, the :class:`BackgroundCompile` plan of the rest) for
    ``mode`` (None, :data:`SERVE` or :data:`OFFLINE`; see the module's docstring). With
    ``mode`` None the first list's shapes compile their samplers too.

    Raises:
        ValueError: an unknown mode.
    """
    if mode is None:
        return shapes, []
    if mode not in (SERVE, OFFLINE):
        raise ValueError(f"unknown compile mode {mode!r}")
    first, rest = split_shapes(shapes)
    later = [(first, False, True), (rest, True, True)]
    return (first, later) if mode == SERVE else ([], [(first, True, False)] + later)


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


class BackgroundCompile:
    """Compile step programs on a daemon thread while the engine already runs steps.

    Args:
        runner: the :class:`~jaxpaged.runner.model_runner.ModelRunner` to compile for.
        plan: ``(shapes, forwards, samplers)`` parts, compiled in order
            (:meth:`ModelRunner.precompile`'s arguments of those names).
        pad: how a step whose forward is not compiled yet runs. True (a server): padded in
            the smallest compiled shape that holds it (:meth:`ModelRunner.defer_shapes`), so
            it neither waits nor compiles. False (``LLM``): it compiles its own shape on the
            spot, after the compilation in progress, so the tokens never depend on how far
            the background got.
        start: start the thread now; False: at :meth:`start` (a server starts it after its
            warm-up request, which would otherwise wait behind the first background shape
            for the runner's compile lock: ``docs/measurements.md``, "Background compile").

    The thread stops after its current shape when :meth:`stop` is called, when the engine
    that started it is collected, and at interpreter exit (which waits for it: a
    compilation cut off by the interpreter's shutdown could crash it).
    """

    def __init__(self, runner, plan: list[tuple[list[tuple], bool, bool]], pad: bool,
                 start: bool = True):
        self._stop = threading.Event()
        self._pad = pad
        if pad:
            runner.defer_shapes([s for shapes, forwards, _ in plan if forwards for s in shapes])
        self._count = sum(len(shapes) for shapes, _, _ in plan)
        _live.add(self)
        self.thread = threading.Thread(target=self._run, args=(runner, plan), daemon=True,
                                       name="jaxpaged-background-compile")
        self._started = threading.Lock()
        if start:
            self.start()

    def start(self) -> None:
        """Start compiling (once; later calls do nothing)."""
        if self._started.acquire(blocking=False):
            logger.info("compiling %d more step shapes in the background", self._count)
            self.thread.start()

    def _run(self, runner, plan) -> None:
        t0 = time.perf_counter()
        try:
            for shapes, forwards, samplers in plan:
                if self._stop.is_set():
                    break
                runner.precompile(should_stop=self._stop.is_set, progress=False, shapes=shapes,
                                  forwards=forwards, samplers=samplers)
        except Exception:  # noqa: BLE001 - a shape that fails compiles again when needed
            logger.exception("background compilation stopped; the remaining step shapes "
                             "compile when a step needs them")
            self._stop.set()
        if self._stop.is_set():
            if self._pad:
                runner.defer_shapes([])
            return
        logger.info("background compilation of %d step shapes done in %.1f s", self._count,
                    time.perf_counter() - t0)

    def stop(self) -> None:
        """Stop after the shape being compiled (the rest compile when a step needs them)."""
        self._stop.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the thread to end (``timeout`` seconds at most; None: no limit);
        whether it has. A thread not started yet starts now, unless stopped."""
        if not self._started.locked():
            if self._stop.is_set():
                return True
            self.start()
        self.thread.join(timeout)
        return not self.thread.is_alive()


#: Background compilations still running (each held by its thread while it runs).
_live: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    """At interpreter exit: stop every background compilation and wait for each to finish
    its current shape."""
    for job in list(_live):
        job.stop()
    for job in list(_live):
        job.wait()
