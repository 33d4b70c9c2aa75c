"""``jaxpaged serve``: its flags and the process that runs the engine behind uvicorn.

The HTTP server starts listening at once; the engine loads and warms up on its own thread
meanwhile (``/health`` answers 503 until it is ready). If the engine cannot load, the error is
printed and the process exits with status 1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import socket
import sys
import threading
import time

import httpx
import jinja2
import uvicorn

from jaxpaged.config import ModelConfig
from jaxpaged.distributed.multihost import abandon, job_formed, leave_failed_job
from jaxpaged.distributed.step_sync import request_job_stop
from jaxpaged.engine.arg_utils import DEFAULT_MODEL, EngineArgs, cli_error_message
from jaxpaged.engine.async_engine import AsyncEngine
from jaxpaged.engine.follower import run_follower
from jaxpaged.metrics.loggers import LoggingStatLogger, PrometheusStatLogger
from jaxpaged.models.gguf_loader import is_gguf
from jaxpaged.server.app import build_app
from jaxpaged.server.multi_model import load_models_config, make_multi_server
from jaxpaged.server.reasoning import REASONING_PARSERS
from jaxpaged.server.serving import ServerConfig
from jaxpaged.server.serving_models import (RUNTIME_LORA_ENV, LoRAModulePath,
                                            check_lora_modules)
from jaxpaged.server.tool_parsers import TOOL_PARSERS
from jaxpaged.tokenizer import load_tokenizer

logger = logging.getLogger("server")

#: Environment variable read when ``--api-key`` is not given.
API_KEY_ENV = "JAXPAGED_API_KEY"


def add_server_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The HTTP-layer flags (vLLM's names; ``docs/reliability.md`` for the limits)."""
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default: 127.0.0.1, this machine only)")
    g.add_argument("--port", type=_port, default=8000)
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize and "
                        f"/detokenize (default: ${API_KEY_ENV})")
    g.add_argument("--served-model-name", nargs="+", default=None,
                   help="names clients use as 'model' (default: the model path; a GGUF's file "
                        "name; 'stories260K' for the bundled model)")
    g.add_argument("--chat-template", default=None,
                   help="Jinja chat template: a file, or the template itself")
    g.add_argument("--trust-request-chat-template", action="store_true",
                   help="accept a chat_template field in chat requests (default: refused)")
    g.add_argument("--enable-log-requests", action="store_true",
                   help="log each request's prompt and sampling parameters (default: off)")
    g.add_argument("--disable-log-requests", action="store_true",
                   help="deprecated, no effect: requests are not logged unless "
                        "--enable-log-requests")
    g.add_argument("--disable-log-stats", action="store_true",
                   help="no periodic throughput / KV-usage log line")
    g.add_argument("--disable-uvicorn-access-log", action="store_true")
    g.add_argument("--max-request-body-bytes", type=_positive,
                   default=ServerConfig.max_request_body_bytes,
                   help="larger request bodies get HTTP 413")
    g.add_argument("--max-pending-requests", type=_positive, default=None,
                   help="most sequences waiting to be scheduled (n counts n); beyond it new "
                        "requests get HTTP 429 with Retry-After (default: no limit)")
    g.add_argument("--request-timeout", type=_positive_seconds, default=None,
                   help="seconds a generation request may take before it is aborted with "
                        "HTTP 504 (default: no limit)")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='parse tool calls for tool_choice "auto" (needs --tool-call-parser)')
    g.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS), default=None,
                   help="the model's tool-call format (docs/tool_calling.md)")
    g.add_argument("--reasoning-parser", choices=sorted(REASONING_PARSERS), default=None,
                   help="return the model's <think> block as message.reasoning")
    g.add_argument("--default-chat-template-kwargs", type=_json_object, default=None,
                   help='chat template variables of every request, a JSON object (e.g. '
                        '\'{"enable_thinking": false}\'); a request\'s chat_template_kwargs '
                        'override them')
    g.add_argument("--models-config", default=None, metavar="FILE",
                   help="serve several models, one engine each: a JSON file listing each "
                        "model, its served names, its share of the KV memory and its engine "
                        "flags (docs/deployment.md)")
    g.add_argument("--shutdown-timeout", type=_seconds, default=0.0,
                   help="on SIGTERM or Ctrl-C, seconds to let the running requests finish "
                        "while new ones get HTTP 503 and /ready turns 503 (default 0: end "
                        "them at once)")
    g.add_argument("--responses-store-size", type=_positive, default=0,
                   help="keep the last N /v1/responses answers in memory (LRU) for GET "
                        "/v1/responses/{id}, previous_response_id and background (default: "
                        "no store; those get HTTP 400)")
    g.add_argument("--lora-modules", nargs="+", type=LoRAModulePath.parse, default=None,
                   help="LoRA adapters to serve (with --enable-lora): name=path, or JSON "
                        '\'{"name": ..., "path": ..., "base_model_name": ...}\'; requests '
                        "pick one by 'model'")
    g.add_argument("--allow-runtime-lora-updating", action="store_true",
                   help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter "
                        f"(also ${RUNTIME_LORA_ENV}=True)")
    return parser


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text}")
    return value


def _port(text: str) -> int:
    value = int(text)
    if not 0 < value < 65536:
        raise argparse.ArgumentTypeError(f"a TCP port is in 1..65535, got {value}")
    return value


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _positive_seconds(text: str) -> float:
    value = float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def _seconds(text: str) -> float:
    value = float(text)
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {text}")
    return value


def server_config(args: argparse.Namespace) -> ServerConfig:
    """The :class:`ServerConfig` of parsed ``serve`` flags.

    Raises:
        FileNotFoundError: ``--chat-template`` names a missing ``.jinja`` file.
        ValueError: an invalid template, empty or repeated served model names, an empty
            ``--api-key`` / ``$JAXPAGED_API_KEY``, ``--enable-auto-tool-choice`` without
            ``--tool-call-parser``, or ``--lora-modules`` entries that repeat a name, take
            the base model's or do not load (``check_lora_modules``).
    """
    names = args.served_model_name or [
        "stories260K" if args.model == DEFAULT_MODEL else
        os.path.basename(args.model) if is_gguf(args.model) else args.model]
    if not all(names) or len(set(names)) != len(names):
        raise ValueError(f"--served-model-name needs distinct non-empty names, got {names}")
    template = args.chat_template
    if template is not None:
        if os.path.isfile(template):
            with open(template) as f:
                template = f.read()
        elif template.endswith((".jinja", ".j2")):
            raise FileNotFoundError(f"chat template file {template!r} does not exist")
        try:
            jinja2.Environment().parse(template)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"--chat-template is not a valid Jinja template: {e}") from None
    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV)
    if api_key is not None and not api_key.strip():
        source = "--api-key" if args.api_key is not None else f"${API_KEY_ENV}"
        raise ValueError(f"{source} is empty: give a key, or leave it out to serve without "
                         "one (an empty key would turn authentication off unnoticed)")
    if api_key is None and args.host not in ("127.0.0.1", "localhost", "::1"):
        logger.warning("serving on %s without an API key: anyone who can reach this address "
                       "can use the model (give --api-key)", args.host)
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")
    if args.lora_modules and not getattr(args, "enable_lora", False):
        raise ValueError("--lora-modules needs --enable-lora")
    check_lora_modules(args.lora_modules or [], names, args.model, args.max_lora_rank)
    runtime_lora = args.allow_runtime_lora_updating or os.environ.get(
        RUNTIME_LORA_ENV, "0").strip().lower() in ("1", "true")
    if args.disable_log_requests:
        logger.warning("--disable-log-requests is deprecated and has no effect: requests are "
                       "not logged unless --enable-log-requests")
    return ServerConfig(served_model_names=names, chat_template=template,
                        api_key=api_key or None,
                        max_request_body_bytes=args.max_request_body_bytes,
                        enable_log_requests=args.enable_log_requests,
                        max_pending_requests=args.max_pending_requests,
                        request_timeout=args.request_timeout,
                        trust_request_chat_template=args.trust_request_chat_template,
                        enable_auto_tool_choice=args.enable_auto_tool_choice,
                        tool_call_parser=args.tool_call_parser,
                        reasoning_parser=args.reasoning_parser,
                        default_chat_template_kwargs=args.default_chat_template_kwargs,
                        shutdown_timeout=args.shutdown_timeout,
                        responses_store_size=args.responses_store_size,
                        lora_modules=args.lora_modules or [],
                        allow_runtime_lora_updating=runtime_lora)


def make_server(engine_args: EngineArgs, config: ServerConfig, log_stats: bool = True):
    """The engine (not started) and the ASGI app serving it, with Prometheus and (if
    ``log_stats``) log-line stat loggers.

    Raises:
        FileNotFoundError / ValueError: an unusable model or tokenizer directory.
    """
    engine, app, _ = make_model_server(engine_args, config, log_stats)
    return engine, app


def make_model_server(engine_args: EngineArgs, config: ServerConfig, log_stats: bool = True,
                      manage_engine: bool = True):
    """:func:`make_server`'s engine and app, and the app's Prometheus registry; with
    ``manage_engine`` False the app's lifespan leaves the engine to the caller
    (``jaxpaged.server.multi_model``).

    Raises:
        FileNotFoundError / ValueError: as :func:`make_server`.
    """
    model_config = ModelConfig.from_pretrained(engine_args.model)   # fails fast on a bad dir
    tokenizer = load_tokenizer(engine_args.tokenizer or engine_args.model,
                               engine_args.trust_remote_code)
    prometheus = PrometheusStatLogger(
        config.served_model_names[0],
        engine_args.max_model_len or model_config.max_position_embeddings,
        max_num_batched_tokens=engine_args.max_num_batched_tokens)
    loggers = [prometheus] + ([LoggingStatLogger()] if log_stats else [])
    engine = AsyncEngine(engine_args, loggers, config.max_pending_requests)
    prometheus.watch_device_memory(
        lambda: engine.engine.device_memory_used() if engine.is_ready else {})
    return engine, build_app(engine, config, tokenizer, prometheus.registry,
                             manage_engine), prometheus.registry


def run_server(args: argparse.Namespace) -> int:
    """Serve until interrupted; returns the exit status. In a multi-host job only process 0
    serves HTTP; the others run the engine on process 0's commands
    (:func:`jaxpaged.engine.follower.run_follower`) until it stops."""
    try:
        engine_args = EngineArgs.from_cli_args(args)
        config = server_config(args)
        follower = engine_args.num_processes > 1 and engine_args.process_id != 0
        if args.models_config and engine_args.num_processes > 1:
            raise ValueError("--models-config serves several models in one process; it "
                             "cannot be combined with --num-processes")
        if args.models_config:
            engine, app = make_multi_server(load_models_config(args.models_config),
                                            engine_args, config, make_model_server,
                                            not args.disable_log_stats)
        elif not follower:
            engine, app = make_server(engine_args, config, not args.disable_log_stats)
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
    logger.info("serving %s as %s on http://%s:%d", engine_args.model,
                config.served_model_names, args.host, args.port)
    try:
        server.run()
    except KeyboardInterrupt:   # uvicorn re-raises the signal after its graceful shutdown
        pass
    if multihost and engine.is_loading:
        _stop_the_starting_job(engine)
    status = 1 if engine.error is not None else 0
    if multihost and engine.error is not None and engine.engine is not None:
        leave_failed_job(engine.error)     # a step failed, a peer is gone: skip JAX's barrier
    if engine.is_loading:
        # Interrupted while the engine thread is inside XLA (loading or compiling): leave
        # without finalizing the interpreter around it, which can crash in native code.
        abandon(status)
    return status


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
