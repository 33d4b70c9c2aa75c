"""The HTTP layer's settings (``jaxpaged serve`` flags beyond the engine's)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ServerConfig:
    """Settings of the HTTP layer.

    Attributes:
        served_model_names: names accepted as ``model``; the first is reported in responses.
        chat_template: Jinja source replacing the tokenizer's template (None: the tokenizer's).
        api_key: required as ``Authorization: Bearer <key>`` on ``/v1/*``, ``/tokenize`` and
            ``/detokenize`` when set.
        max_request_body_bytes: larger request bodies get 413.
        enable_log_requests: log each request's id, prompt (text or token ids) and sampling
            parameters; off by default, so prompts and outputs never reach the log.
        max_pending_requests: most sequences waiting to be scheduled; beyond it new
            requests get 429 (None: no limit). Enforced by the :class:`AsyncEngine`.
        request_timeout: seconds a generation request may take from its arrival to its
            last output before it is aborted with 504 (None: no limit).
        trust_request_chat_template: accept a ``chat_template`` in chat requests (otherwise
            400: only ``--chat-template`` or the tokenizer's template render).
        enable_auto_tool_choice: ``tool_choice: "auto"`` (the default with ``tools``) parses
            the output with ``tool_call_parser``; without it such requests get 400.
        tool_call_parser: a :data:`~jaxpaged.server.tool_parsers.TOOL_PARSERS` name.
        reasoning_parser: a :data:`~jaxpaged.server.reasoning.REASONING_PARSERS` name: chat
            output's ``<think>`` block returned as ``reasoning``.
        default_chat_template_kwargs: template variables of every chat request (the
            request's ``chat_template_kwargs`` override them).
        reasoning_budget: the ``thinking_token_budget`` of chat, Responses and Messages
            requests that set none (llama.cpp's ``--reasoning-budget``): -1 no limit, 0 no
            reasoning, N at most N tokens inside ``<think>``.
        shutdown_timeout: seconds a shutdown (SIGTERM, Ctrl-C) waits for the running requests
            to finish while new ones get 503; 0: end them at once (vLLM's
            ``--shutdown-timeout``).
        responses_store_size: how many ``/v1/responses`` answers the in-memory store keeps
            (LRU) for ``GET /v1/responses/{id}``, ``previous_response_id`` and
            ``background``; 0: no store, and those are refused with a 400.
        lora_modules: LoRA adapters served from the start (``--lora-modules``), each a
            ``jaxpaged.server.serving_models.LoRAModulePath``; ``model`` names them.
        allow_runtime_lora_updating: serve ``POST /v1/load_lora_adapter`` and
            ``/v1/unload_lora_adapter`` (``--allow-runtime-lora-updating`` or
            ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``).
        enable_rl_endpoints: serve the RL control routes (``server/serving_rl.py``;
            ``--enable-rl-endpoints`` or ``VLLM_SERVER_DEV_MODE=1``).
    """

    served_model_names: list[str]
    chat_template: str | None = None
    api_key: str | None = None
    max_request_body_bytes: int = 32 * 2**20
    enable_log_requests: bool = False
    max_pending_requests: int | None = None
    request_timeout: float | None = None
    trust_request_chat_template: bool = False
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    default_chat_template_kwargs: dict | None = None
    reasoning_budget: int = -1
    shutdown_timeout: float = 0.0
    responses_store_size: int = 0
    lora_modules: list = field(default_factory=list)
    allow_runtime_lora_updating: bool = False
    enable_rl_endpoints: bool = False
