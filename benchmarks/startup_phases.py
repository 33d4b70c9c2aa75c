"""Where ``jaxpaged serve`` spends its start-up, phase by phase.

Runs ``jaxpaged serve ARGS...`` in this process with the start-up's steps timed (seconds from
this script's start, on stderr, with the thread doing each): the server's imports, reading
the model config, each tokenizer load, the attention backend's choice (kernel build,
self-check), loading the weights, allocating the KV pool, each step program compiled or
loaded, the warm-up request, and the first ``GET /health`` 200 with the process's peak resident memory
(``VmHWM``). The process exits at that point. For example, with an empty compile cache and
then a warm one::

    python -m jaxpaged.benchmarks.startup_phases MODEL.gguf --port 8124 \\
        --compilation-cache-dir /tmp/cc        # run twice

The timing wraps module attributes the start-up calls by name; it changes nothing they do.
"""

from __future__ import annotations

import functools
import os
import runpy
import sys
import threading
import time
import urllib.request

T0 = time.perf_counter()


def stamp(message: str) -> None:
    """Print ``message`` with the seconds since start and the calling thread's name."""
    print(f"[{time.perf_counter() - T0:7.2f} s {threading.current_thread().name[:20]:20}] "
          f"{message}", file=sys.stderr, flush=True)


def timed(owner, name: str, label: str | None = None) -> None:
    """Replace ``owner.name`` (a function or method) by one that stamps its start and end."""
    fn = getattr(owner, name)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        stamp(f"> {label or name}")
        try:
            return fn(*args, **kwargs)
        finally:
            stamp(f"< {label or name} {time.perf_counter() - t:.2f} s")

    setattr(owner, name, wrapper)


def instrument() -> None:
    """Wrap the start-up's phases (see the module docstring)."""
    from jaxpaged.config import ModelConfig
    from jaxpaged.engine import async_engine, startup
    from jaxpaged.runner import model_runner, worker
    from jaxpaged.server import launcher

    stamp("imported the server")
    timed(launcher, "load_tokenizer", "tokenizer (server)")
    timed(startup, "load_tokenizer", "tokenizer (engine)")
    for name in ("get_attention_backend", "load_model", "allocate_kv_pool"):
        timed(worker, name)
    timed(model_runner.ModelRunner, "precompile")
    timed(async_engine, "warm_up", "warm-up request")
    from_pretrained = ModelConfig.from_pretrained.__func__
    ModelConfig.from_pretrained = classmethod(
        lambda cls, *a, **k: _stamped(f"config of {a[0]}", from_pretrained, cls, *a, **k))
    compiled = model_runner.ModelRunner._compiled
    model_runner.ModelRunner._compiled = lambda self, key, *a, **k: _stamped(
        f"step program {key}", compiled, self, key, *a, **k)


def _stamped(label: str, fn, *args, **kwargs):
    t = time.perf_counter()
    out = fn(*args, **kwargs)
    if time.perf_counter() - t > 0.02:
        stamp(f"{label}: {time.perf_counter() - t:.2f} s")
    return out


def exit_at_health(port: int) -> None:
    """On a daemon thread: poll ``/health`` on ``port``; at the first 200 stamp it with
    ``VmHWM`` and end the process."""
    def poll():
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    if r.status == 200:
                        with open("/proc/self/status") as f:
                            hwm = next(int(line.split()[1]) for line in f
                                       if line.startswith("VmHWM"))
                        stamp(f"/health 200, VmHWM {hwm // 1024} MiB")
                        os._exit(0)
            except OSError:
                pass
            time.sleep(0.05)

    threading.Thread(target=poll, name="health-poll", daemon=True).start()


def main(argv: list[str]) -> int:
    """``jaxpaged serve`` with ``argv``, timed; returns its exit status if it ends first.

    The command runs as ``python -m jaxpaged.cli serve ...`` would run it, in this process
    (``runpy``), so the benchmark times the program users start and imports nothing from the
    CLI that lists it."""
    instrument()
    port = int(argv[argv.index("--port") + 1]) if "--port" in argv else 8000
    exit_at_health(port)
    sys.argv = ["jaxpaged", "serve", *argv]
    try:
        runpy.run_module("jaxpaged.cli", run_name="__main__", alter_sys=True)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 0
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
