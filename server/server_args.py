"""``jaxpaged serve``'s HTTP-layer flags and the :class:`ServerConfig` they make.

The engine's flags are :class:`jaxpaged.arg_utils.EngineArgs`'; these are the server's
(vLLM's names), checked when parsed or in :func:`server_config`, before anything loads.
"""

from __future__ import annotations

import argparse
import json
import logging
import os

import jinja2

from jaxpaged.arg_utils import DEFAULT_MODEL
from jaxpaged.gguf_config import is_gguf
from jaxpaged.server.reasoning import REASONING_PARSERS
from jaxpaged.server.serving import ServerConfig
from jaxpaged.server.serving_models import (RUNTIME_LORA_ENV, LoRAModulePath,
                                            check_lora_modules)
from jaxpaged.server.tool_parsers import TOOL_PARSERS

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
    g.add_argument("--reasoning-budget", type=_reasoning_budget, default=-1, metavar="N",
                   help="thinking_token_budget of chat, Responses and Messages requests that "
                        "set none: at most N tokens inside <think>, then </think> is forced "
                        "(0: no reasoning; default -1: no limit)")
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
    g.add_argument("--enable-rl-endpoints", action="store_true",
                   help="serve the RL control routes: /pause, /resume, /sleep, /wake_up, "
                        "/is_sleeping, /reset_prefix_cache, /update_weights_from_disk, "
                        "/weight_version (also VLLM_SERVER_DEV_MODE=1; docs/rl.md)")
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


def _reasoning_budget(text: str) -> int:
    value = int(text)
    if value < -1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, or -1 for no limit, got "
                                         f"{value}")
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
    rl_endpoints = getattr(args, "enable_rl_endpoints", False) or os.environ.get(
        "VLLM_SERVER_DEV_MODE", "0").strip().lower() in ("1", "true")
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
                        reasoning_budget=args.reasoning_budget,
                        shutdown_timeout=args.shutdown_timeout,
                        responses_store_size=args.responses_store_size,
                        lora_modules=args.lora_modules or [],
                        allow_runtime_lora_updating=runtime_lora,
                        enable_rl_endpoints=rl_endpoints)
