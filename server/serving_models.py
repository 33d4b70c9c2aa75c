"""`ServingModels`: the names a server answers to — its base model names and its LoRA
adapters — for ``/v1/models``, the ``model`` field of every route, and
``/v1/load_lora_adapter`` / ``/v1/unload_lora_adapter`` (vLLM's ``OpenAIServingModels``,
``vllm/entrypoints/openai/serving_models.py``: the same cards, messages and statuses).

An adapter is checked when it is registered (its files read and matched against the model,
off the event loop); the engine loads it into its own host cache at its first request.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from dataclasses import dataclass

from jaxpaged.server.api_model import ApiModel
from jaxpaged.lora.peft import LoRAAdapterNotFoundError, load_adapter
from jaxpaged.lora.request import LoRARequest
from jaxpaged.server.errors import APIError


class LoadLoRAAdapterRequest(ApiModel):
    """``POST /v1/load_lora_adapter``'s body (vLLM's)."""

    lora_name: str | None = None
    lora_path: str | None = None


class UnloadLoRAAdapterRequest(ApiModel):
    """``POST /v1/unload_lora_adapter``'s body (vLLM's; ``lora_int_id`` is accepted and
    ignored, as there)."""

    lora_name: str | None = None
    lora_int_id: int | None = None

#: vLLM's switch of the runtime load/unload routes (``--allow-runtime-lora-updating`` too).
RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


@dataclass(frozen=True)
class LoRAModulePath:
    """One ``--lora-modules`` entry: ``name=path`` or ``{"name", "path", "base_model_name"}``."""

    name: str
    path: str
    base_model_name: str | None = None

    @classmethod
    def parse(cls, text: str) -> "LoRAModulePath":
        """Parse a ``--lora-modules`` value.

        Raises:
            ValueError: neither ``name=path`` nor a JSON object with ``name`` and ``path``.
        """
        if text.lstrip().startswith("{"):
            try:
                data = json.loads(text)
                return cls(str(data["name"]), str(data["path"]), data.get("base_model_name"))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"--lora-modules {text!r}: a JSON entry needs 'name' and "
                                 f"'path' ({e})") from None
        name, sep, path = text.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules {text!r} must be name=path or JSON")
        return cls(name, path)


def check_lora_modules(modules: list[LoRAModulePath], served: list[str], model: str,
                       max_lora_rank: int) -> None:
    """Check ``--lora-modules`` at start-up, as vLLM loads them before it serves: each name
    once and none of the base model's ``served`` names, and every adapter's files readable
    and fitting ``model``'s checkpoint and ``max_lora_rank``.

    Raises:
        ValueError: a repeated name, a name of the base model, or an adapter that does not
            load (``jaxpaged.lora.peft.load_adapter``'s errors, whose messages name it).
    """
    from jaxpaged.config import ModelConfig

    names = [m.name for m in modules]
    for name in names:
        if names.count(name) > 1:
            raise ValueError(f"--lora-modules: the name {name!r} is given {names.count(name)} "
                             "times")
        if name in served:
            raise ValueError(f"--lora-modules: {name!r} is the base model's served name; "
                             "give the adapter another name")
    config = ModelConfig.from_pretrained(model) if modules else None
    for i, m in enumerate(modules, 1):
        load_adapter(LoRARequest(m.name, i, m.path), config, max_lora_rank)


class ServingModels:
    """Base model names and registered adapters of one server.

    Args:
        served: the base model's names (``--served-model-name``).
        engine: the ``AsyncEngine`` (its model config and LoRA limits check adapters).
        lora_modules: adapters served from the start (``--lora-modules``; checked at
            start-up by :func:`check_lora_modules`, loaded by the engine at their first
            request).
    """

    def __init__(self, served: list[str], engine=None,
                 lora_modules: list[LoRAModulePath] = ()):
        self.served = served
        self.engine = engine
        self._ids = itertools.count(1)
        self.lora_requests: dict[str, LoRARequest] = {
            m.name: LoRARequest(m.name, next(self._ids), m.path,
                                m.base_model_name if m.base_model_name in served else None)
            for m in lora_modules}

    @property
    def names(self) -> list[str]:
        """Every name ``model`` may take: the base model's, then the adapters'."""
        return self.served + list(self.lora_requests)

    def lora_request(self, name: str | None) -> LoRARequest | None:
        """The adapter ``model`` names (None: the base model)."""
        return self.lora_requests.get(name) if name else None

    def adapter_cards(self) -> list[dict]:
        """``/v1/models`` entries of the adapters: ``id``, ``root`` (the adapter's path) and
        ``parent`` (its base model's name), as vLLM lists them."""
        return [dict(id=r.lora_name, root=r.lora_path,
                     parent=r.base_model_name or self.served[0])
                for r in self.lora_requests.values()]

    async def load(self, lora_name: str | None, lora_path: str | None,
                   base_model_name: str | None = None) -> str:
        """Register an adapter after checking its files against the model.

        Raises:
            APIError: 400 without both fields, for a name already loaded, an engine without
                LoRA, or an adapter that does not fit; 404 for a path with no adapter.
        """
        if not lora_name or not lora_path:
            raise APIError(400, "Both 'lora_name' and 'lora_path' must be provided.",
                           "InvalidUserInput")
        if lora_name in self.lora_requests or lora_name in self.served:
            raise APIError(400, f"The lora adapter '{lora_name}' has already been loaded.",
                           "InvalidUserInput")
        lora_config = self.engine.check_ready().lora_config
        if lora_config is None:
            raise APIError(400, "LoRA is not enabled; start the server with --enable-lora",
                           "BadRequestError")
        request = LoRARequest(lora_name, next(self._ids), lora_path,
                              base_model_name if base_model_name in self.served else None)
        try:
            await asyncio.to_thread(load_adapter, request, self.engine.model_info.model_config,
                                    lora_config.max_lora_rank)
        except LoRAAdapterNotFoundError as e:
            raise APIError(404, str(e), "NotFoundError") from None
        except ValueError as e:
            raise APIError(400, str(e), "BadRequestError") from None
        self.lora_requests[lora_name] = request
        return f"Success: LoRA adapter '{lora_name}' added successfully."

    def unload(self, lora_name: str | None) -> str:
        """Forget an adapter (running requests finish with it).

        Raises:
            APIError: 400 without a name, 404 for one not loaded.
        """
        if not lora_name:
            raise APIError(400, "'lora_name' needs to be provided to unload a LoRA adapter.",
                           "InvalidUserInput")
        if lora_name not in self.lora_requests:
            raise APIError(404, f"The lora adapter '{lora_name}' cannot be found.",
                           "NotFoundError")
        del self.lora_requests[lora_name]
        return f"Success: LoRA adapter '{lora_name}' removed successfully."
