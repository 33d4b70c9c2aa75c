"""``POST /v1/embeddings`` (OpenAI's Embeddings API, with vLLM's extra fields), on a server
whose engine runs its model for pooling (``--runner pooling`` / ``--convert embed``).

Request (OpenAI's ``CreateEmbeddingRequest``; vLLM's ``EmbeddingCompletionRequest``): ``model``,
``input`` (a string, a list of strings, a list of token ids, or a list of such lists; each one
embedding), ``encoding_format`` (``float``, or ``base64``: the little-endian float32 bytes of
the vector, base64-encoded, as OpenAI and vLLM send it; the official Python client asks for
base64 by default and decodes it), ``dimensions`` (refused with a 400: no model this server
loads supports Matryoshka sizes), ``user``; vLLM's ``add_special_tokens``,
``truncate_prompt_tokens``, ``normalize``, ``priority`` and ``request_id``. Response:
``{"object": "list", "data": [{"object": "embedding", "index", "embedding"}], "model",
"usage": {"prompt_tokens", "total_tokens"}}`` plus vLLM's ``id`` (``embd-...``) and
``created``. Empty inputs and inputs longer than ``max_model_len`` tokens are 400s that say
so. Each input runs as one pooling request of the engine (``jaxpaged.core.pooling``).
"""

from __future__ import annotations

import base64
import time
from typing import ClassVar, Literal

import numpy as np
from pydantic import Field, StrictInt, StrictStr
from starlette.requests import Request
from starlette.responses import Response

from jaxpaged.server.api_model import ApiModel
from jaxpaged.outputs import PoolingRequestOutput
from jaxpaged.pooling_params import PoolingParams
from jaxpaged.server.errors import bad_request
from jaxpaged.server.protocol import Int, _Request
from jaxpaged.server.serving import OpenAIServing, PreparedPrompt, off_loop
from jaxpaged.server.vllm_extras import truncate_prompt


class EmbeddingRequest(_Request):
    """The body of ``POST /v1/embeddings`` (see the module docstring)."""

    model: str | None = None
    input: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Int | None = None
    user: str | None = None
    # vLLM extras
    add_special_tokens: bool = True
    truncate_prompt_tokens: Int | None = None
    normalize: bool | None = None
    priority: Int = 0
    request_id: str | None = None
    #: (What the shared request path reads: embeddings never stream nor take a cache salt.)
    stream: ClassVar[bool] = False
    cache_salt: ClassVar[None] = None


class EmbeddingData(ApiModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(ApiModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(ApiModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage


def encode_embedding(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    """A [H] float32 vector as JSON floats, or as base64 of its little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, "<f4").tobytes()).decode("ascii")
    return vector.tolist()


class OpenAIServingEmbedding(OpenAIServing):
    """The embeddings endpoint."""

    async def create(self, body: EmbeddingRequest, raw_request: Request) -> Response:
        """Answer one embeddings request (JSON).

        Raises:
            APIError: 400 for ``dimensions``, empty or too long inputs, token ids outside
                the vocabulary; 404 for an unknown model; 503/500 when the engine cannot
                run it.
        """
        self.check_model(body.model)
        if body.dimensions is not None:
            raise bad_request("dimensions is not supported: this model does not support "
                              "Matryoshka embeddings (its embeddings have its hidden size, "
                              f"{self.engine.model_info.hidden_size})", "dimensions")
        prompts = await off_loop(self._prepare_prompts, body)
        params = [PoolingParams(normalize=body.normalize)] * len(prompts)
        request_id = self.request_id(raw_request, "embd", body.request_id)
        return await self.respond(raw_request, body, request_id, prompts, params, "input",
                                  None, lambda finals: self._response(request_id, body, finals))

    def _prepare_prompts(self, body: EmbeddingRequest) -> list[PreparedPrompt]:
        inputs = body.input
        if isinstance(inputs, str) or (inputs and isinstance(inputs[0], int)):
            inputs = [inputs]
        if not inputs:
            raise bad_request("input must not be empty", "input")
        max_model_len = self.engine.model_info.max_model_len
        prepared = []
        for i, item in enumerate(inputs):
            if not item:
                raise bad_request(f"input[{i}] is empty (an empty string or no token ids); "
                                  "every input needs at least one token", "input")
            if isinstance(item, str):
                self.check_text_length(item, "input")
                ids = self.tokenizer.encode(item, add_special_tokens=body.add_special_tokens)
                if not ids:
                    raise bad_request(f"input[{i}] tokenizes to no tokens", "input")
            else:
                ids = list(item)
            ids = truncate_prompt(ids, body.truncate_prompt_tokens, max_model_len)
            if len(ids) > max_model_len:
                raise bad_request(f"input[{i}] has {len(ids)} tokens, more than this model's "
                                  f"maximum context length of {max_model_len} tokens; shorten "
                                  "it (or set truncate_prompt_tokens)", "input")
            prepared.append(PreparedPrompt(item if isinstance(item, str) else None, ids, 0))
        return prepared

    def _response(self, request_id: str, body: EmbeddingRequest,
                  finals: list[PoolingRequestOutput]) -> EmbeddingResponse:
        data = [EmbeddingData(index=i, embedding=encode_embedding(f.outputs.data,
                                                                  body.encoding_format))
                for i, f in enumerate(finals)]
        num_tokens = sum(len(f.prompt_token_ids) for f in finals)
        return EmbeddingResponse(id=request_id, model=self.model_name(body.model), data=data,
                                 usage=EmbeddingUsage(prompt_tokens=num_tokens,
                                                      total_tokens=num_tokens))
