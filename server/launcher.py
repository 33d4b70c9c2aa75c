"""``jaxpaged serve``: the process that runs the engine behind uvicorn (its flags:
:mod:`jaxpaged.server.server_args`).

The HTTP server starts listening at once; the engine loads and warms up on its own thread
meanwhile (``/health`` answers 503 until it is ready). If the engine cannot load, the error is
printed and the process exits with status 1.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket
import sys
import threading
import time

import uvicorn

from jaxpaged.config import ModelConfig
from jaxpaged.distributed.multihost import abandon, job_formed, leave_failed_job
from jaxpaged.distributed.step_sync import request_job_stop
from jaxpaged.arg_utils import EngineArgs, cli_error_message
from jaxpaged.engine.async_engine import AsyncEngine
from jaxpaged.engine.follower import run_follower
from jaxpaged.metrics.loggers import LoggingStatLogger, PrometheusStatLogger
from jaxpaged.runner.host_memory import limit_malloc_arenas
from jaxpaged.server.app import build_app
from jaxpaged.server.multi_model import (ModelEntry, kv_memory_note, load_models_config,
                                         make_multi_server)
from jaxpaged.server.serving import ServerConfig
from jaxpaged.server.server_args import server_config
from jaxpaged.spec_decode.draft_model import check_draft_model
from jaxpaged.tokenizer import load_tokenizer

logger = logging.getLogger("server")

def make_server(engine_args: EngineArgs, config: ServerConfig, log_stats: bool = True,
                start_loading: bool = False):
    """The engine and the ASGI app serving it, with Prometheus and (if ``log_stats``)
    log-line stat loggers. The engine starts with the app's lifespan, or with
    ``start_loading`` at once, so that the model loads while the server's own tokenizer
    loads and uvicorn starts (``docs/measurements.md``, "Server start-up").

    Raises:
        FileNotFoundError / ValueError: an unusable model or tokenizer directory.
    """
    engine, app, _ = make_model_server(engine_args, config, log_stats,
                                       start_loading=start_loading)
    return engine, app


def make_model_server(engine_args: EngineArgs, config: ServerConfig, log_stats: bool = True,
                      manage_engine: bool = True, start_loading: bool = False):
    """:func:`make_server`'s engine and app, and the app's Prometheus registry; with
    ``manage_engine`` False the app's lifespan leaves the engine to the caller
    (``jaxpaged.server.multi_model``); ``start_loading`` as :func:`make_server`'s.

    Raises:
        FileNotFoundError / ValueError: as :func:`make_server` (a tokenizer that cannot
            load stops an engine already loading first).
    """
    model_config = ModelConfig.from_pretrained(engine_args.model,   # fails fast on a bad dir
                                               engine_args.hf_overrides)
    prometheus = PrometheusStatLogger(
        config.served_model_names[0],
        engine_args.max_model_len or model_config.max_position_embeddings,
        max_num_batched_tokens=engine_args.max_num_batched_tokens)
    loggers = [prometheus] + ([LoggingStatLogger()] if log_stats else [])
    engine = AsyncEngine(engine_args, loggers, config.max_pending_requests)
    if start_loading:
        engine.start_loading()
    try:
        tokenizer = load_tokenizer(engine_args.tokenizer or engine_args.model,
                                   engine_args.trust_remote_code)
    except BaseException:
        if start_loading:       # not left loading in native code while the process exits
            engine.shutdown()
            engine.join()
        raise
    prometheus.watch_device_memory(
        engine.device_memory_used)
    return engine, build_app(engine, config, tokenizer, prometheus.registry,
                             manage_engine), prometheus.registry


def run_server(args: argparse.Namespace) -> int:
    """Serve until interrupted; returns the exit status. In a multi-host job only process 0
    serves HTTP; the others run the engine on process 0's commands
    (:func:`jaxpaged.engine.follower.run_follower`) until it stops."""
    # Two malloc arenas: the engine, background-compilation, tokenizer and event-loop
    # threads otherwise each grow an arena of their own (jaxpaged.runner.host_memory).
    limit_malloc_arenas(2)
    try:
        engine_args = EngineArgs.from_cli_args(args)
        check_draft_model(engine_args)
        config = server_config(args)
        follower = engine_args.num_processes > 1 and engine_args.process_id != 0
        if args.models_config and engine_args.num_processes > 1:
            raise ValueError("--models-config serves several models in one process; it "
                             "cannot be combined with --num-processes")
        entries = load_models_config(args.models_config) if args.models_config else None
        if entries:
            engine, app = make_multi_server(entries, engine_args, config, make_model_server,
                                            not args.disable_log_stats)
        elif not follower:
            engine, app = make_server(engine_args, config, not args.disable_log_stats,
                                      start_loading=engine_args.num_processes == 1)
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"jaxpaged: error: {cli_error_message(e)}", file=sys.stderr)
        return 2
    if follower:
        try:
            return run_follower(engine_args)
        except (ValueError, TypeError, FileNotFoundError) as e:   # as process 0 reports it
            print(f"jaxpaged: error: the engine failed to start: {cli_error_message(e)}",
                  file=sys.stderr)
            return 1
    server = GracefulServer(engine, uvicorn.Config(
        app, host=args.host, port=args.port, log_level="info",
        access_log=not args.disable_uvicorn_access_log, timeout_graceful_shutdown=5),
        config.shutdown_timeout)
    multihost = engine_args.num_processes > 1

    def stop_if_load_fails():
        if not engine.wait_ready():
            print(f"jaxpaged: error: the engine failed to start: "
                  f"{cli_error_message(engine.error)}", file=sys.stderr)
            server.should_exit = True

    def stop_when_the_job_ends():
        # A multi-host engine ends by itself when another process is stopped or dies; one
        # process cannot serve alone, so the server stops too.
        engine.wait_ready()
        engine.join()
        server.should_exit = True

    threading.Thread(target=stop_if_load_fails, daemon=True).start()
    if multihost:
        threading.Thread(target=stop_when_the_job_ends, daemon=True).start()
        # uvicorn re-raises SIGTERM after its graceful shutdown; as an exception (not the
        # default action) it lets the process pass JAX's shutdown barrier with the others.
        signal.signal(signal.SIGTERM, signal.default_int_handler)
    for line in serving_lines(engine_args, config, entries, args.host, args.port):
        logger.info("%s", line)
    try:
        server.run()
    except KeyboardInterrupt:   # uvicorn re-raises the signal after its graceful shutdown
        pass
    if multihost and engine.is_loading:
        _stop_the_starting_job(engine)
    status = 1 if engine.error is not None else 0
    if multihost and engine.error is not None and engine.was_built:
        leave_failed_job(engine.error)     # a step failed, a peer is gone: skip JAX's barrier
    if engine.is_loading:
        # Interrupted while the engine thread is inside XLA (loading or compiling): leave
        # without finalizing the interpreter around it, which can crash in native code.
        abandon(status)
    return status


def serving_lines(engine_args: EngineArgs, config: ServerConfig,
                  entries: list[ModelEntry] | None, host: str, port: int) -> list[str]:
    """The start-up log's ``serving`` lines: the model and the names clients use for it,
    one line per model of ``--models-config`` (``entries``, each with what its
    ``kv_cache_memory_share`` applies to; None: the one model of ``engine_args`` under
    ``config.served_model_names``)."""
    if not entries:
        return [f"serving {engine_args.model} as {config.served_model_names} "
                f"on http://{host}:{port}"]
    return [f"serving {entry.model} as {entry.served_model_name} on http://{host}:{port} "
            f"({kv_memory_note(engine_args, entry)})" for entry in entries]


def _stop_the_starting_job(engine: AsyncEngine) -> None:
    """Stopped while the multi-host engine is still starting: the other processes cannot be
    told at a step yet, so post the stop (every process cuts its precompile short) and wait
    until the engine reaches its first step and sends them the stop command. A second
    signal leaves at once (the others are then ended by JAX)."""
    if not job_formed():        # still waiting for the others: nobody to tell yet
        logger.warning("stopping before the other processes joined")
        abandon(0)
    logger.warning("stopping: the other processes stop when the engine has started "
                   "(precompile cut short); press Ctrl-C again to leave now")
    try:
        request_job_stop()
        engine.join()
    except KeyboardInterrupt:
        abandon(130)


class GracefulServer(uvicorn.Server):
    """uvicorn's server with a drain before it stops: for up to ``shutdown_timeout`` seconds
    the running requests go on while new ones get 503 (and ``/ready`` 503, ``/health`` still
    200), the listening socket still open; then every request still running ends (streams
    close with an error event and ``[DONE]``, waiting clients get a 503 in time, instead of
    being cut when uvicorn's graceful-shutdown period runs out). vLLM's
    ``--shutdown-timeout`` (vllm-project/vllm#36666) behaves the same way."""

    def __init__(self, engine: AsyncEngine, config: uvicorn.Config,
                 shutdown_timeout: float = 0.0):
        super().__init__(config)
        self._engine = engine
        self.shutdown_timeout = shutdown_timeout

    async def shutdown(self, sockets=None) -> None:
        engine = self._engine
        if self.shutdown_timeout > 0 and engine.is_ready:
            engine.begin_drain()
            deadline = time.monotonic() + self.shutdown_timeout
            logger.info("draining: %d requests running, waiting up to %.0f s",
                        engine.num_open_streams, self.shutdown_timeout)
            while (engine.num_open_streams and time.monotonic() < deadline
                   and not self.force_exit):    # a second Ctrl-C: stop now
                await asyncio.sleep(0.05)
            if engine.num_open_streams:
                logger.warning("drain timed out: ending %d running requests",
                               engine.num_open_streams)
        engine.stop_requests()
        await super().shutdown(sockets)


class ServerThread:
    """:func:`make_server`'s engine and app served by uvicorn on a free local port, in a
    background thread of this process (the server tests, ``benchmarks/soak.py``).

    Args:
        engine_args: the engine's settings.
        config: the HTTP layer's settings.
        host: the address to listen on.
        models: serve these models instead, one engine each (``--models-config``'s
            entries; ``engine`` is then their :class:`EngineGroup`).
    """

    def __init__(self, engine_args: EngineArgs, config: ServerConfig, host: str = "127.0.0.1",
                 models: list | None = None):
        self.config = config
        if models:
            self.engine, app = make_multi_server(models, engine_args, config, make_model_server,
                                                 log_stats=False)
        else:
            self.engine, app = make_server(engine_args, config, log_stats=False)
        self.sock = socket.socket()
        self.sock.bind((host, 0))
        self.url = f"http://{host}:{self.sock.getsockname()[1]}"
        self.server = GracefulServer(self.engine, uvicorn.Config(
            app, log_level="warning", timeout_graceful_shutdown=2), config.shutdown_timeout)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True)

    def start(self, timeout: float = 180.0):
        """Start serving and wait until ``/health`` answers 200; returns ``self``.

        Raises:
            RuntimeError: not healthy within ``timeout`` seconds (the engine's error, if any).
        """
        import httpx        # (only this in-process server needs a client: not at start-up)

        self.thread.start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"server did not become healthy: {self.engine.error!r}")

    def stop(self) -> None:
        """Shut the server down (running requests end at once) and wait for its thread."""
        self.server.should_exit = True
        self.thread.join(30)
