"""``POST /rerank`` and ``POST /score`` (also under ``/v1/``, and ``/v2/rerank``), vLLM's score
API and the Cohere / Jina rerank API, on a pooling server.

A classify server (a sequence classifier, ``--runner pooling`` / ``--convert classify``:
``jaxpaged.classification``) scores each (query, document) pair as one prompt through its
classifier head (a cross-encoder); an embedding server scores a pair by the cosine similarity
of the two texts' embeddings (a bi-encoder), as vLLM does. Prompts: ``jaxpaged.scoring``
(the server's ``--chat-template`` is the score template of a classify server).

``/score`` (vLLM's ``ScoreRequest``): ``text_1`` and ``text_2``, each a string or a list of
strings (1:1, 1:N, N:N), ``truncate_prompt_tokens``, ``use_activation``, ``priority``,
``request_id``. Response ``{"id": "score-...", "object": "list", "created", "model", "data":
[{"index", "object": "score", "score"}], "usage": {"prompt_tokens", "total_tokens"}}``.

``/rerank`` (Cohere's and Jina's ``query``, ``documents``, ``top_n``; vLLM's
``RerankRequest``): ``top_n`` 0 or absent means every document; ``return_documents``
(default true) includes each ``{"text"}``. Response ``{"id": "rerank-...", "model",
"results": [{"index", "document", "relevance_score"}], "usage": {"prompt_tokens",
"total_tokens"}}``, results by relevance, highest first (ties by index).

Bad input is a 400 naming the field: an empty side or ``documents``, a mismatched 1:N shape,
an empty text, a prompt longer than ``max_model_len``, ``top_n`` below 0; a generating
server answers these routes with a 400 that says to start one with ``--runner pooling``.
"""

from __future__ import annotations

import time
from typing import ClassVar

from pydantic import Field, StrictStr
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from jaxpaged.server.api_model import ApiModel
from jaxpaged.pooling_params import PoolingParams
from jaxpaged.scoring import as_list, cosine_similarity, cross_encoder_prompt, score_pairs
from jaxpaged.server.errors import bad_request
from jaxpaged.server.http_body import parse, ready
from jaxpaged.server.protocol import Int, _Request
from jaxpaged.server.serving import OpenAIServing, PreparedPrompt, off_loop
from jaxpaged.server.vllm_extras import truncate_prompt

#: The routes, by the handler that answers them.
SCORE_PATHS = ("/score", "/v1/score")
RERANK_PATHS = ("/rerank", "/v1/rerank", "/v2/rerank")


class _PoolingFields(_Request):
    model: str | None = None
    truncate_prompt_tokens: Int | None = None
    use_activation: bool | None = None
    priority: Int = 0
    request_id: str | None = None
    #: (What the shared request path reads: scores never stream nor take a cache salt.)
    stream: ClassVar[bool] = False
    cache_salt: ClassVar[None] = None


class ScoreRequest(_PoolingFields):
    """The body of ``POST /score`` (see the module docstring)."""

    text_1: StrictStr | list[StrictStr]
    text_2: StrictStr | list[StrictStr]


class RerankRequest(_PoolingFields):
    """The body of ``POST /rerank`` (see the module docstring)."""

    query: StrictStr
    documents: list[StrictStr]
    top_n: Int = 0
    return_documents: bool = True


class ScoreData(ApiModel):
    index: int
    object: str = "score"
    score: float


class ScoreUsage(ApiModel):
    prompt_tokens: int
    total_tokens: int


class ScoreResponse(ApiModel):
    id: str
    object: str = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ScoreData]
    usage: ScoreUsage


class RerankDocument(ApiModel):
    text: str


class RerankResult(ApiModel):
    index: int
    document: RerankDocument | None = None
    relevance_score: float


class RerankResponse(ApiModel):
    id: str
    model: str
    results: list[RerankResult]
    usage: ScoreUsage


class OpenAIServingScore(OpenAIServing):
    """The score and rerank endpoints."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        pooler = self.engine.args.pooler
        #: The engine's pooling task (``embed`` / ``classify``), None for a generating one.
        self.task = None if pooler is None else pooler.task

    async def score(self, body: ScoreRequest, raw_request: Request) -> Response:
        """Answer ``/score``.

        Raises:
            APIError: 400 for bad input or a generating server, 404 for an unknown model,
                503/500/504 as the other routes.
        """
        self._check(body)
        try:
            pairs = score_pairs(body.text_1, body.text_2)
        except ValueError as e:
            raise bad_request(str(e), "text_2" if str(e).startswith("text_2") else "text_1"
                              ) from None
        texts_1, texts_2 = as_list(body.text_1), as_list(body.text_2)
        return await self._run(body, raw_request, "score", texts_1, texts_2, pairs, "text_2",
                               lambda rid, scores, tokens: ScoreResponse(
                                   id=rid, model=self.model_name(body.model),
                                   data=[ScoreData(index=i, score=s)
                                         for i, s in enumerate(scores)],
                                   usage=ScoreUsage(prompt_tokens=tokens, total_tokens=tokens)))

    async def rerank(self, body: RerankRequest, raw_request: Request) -> Response:
        """Answer ``/rerank``.

        Raises:
            APIError: as :meth:`score`.
        """
        self._check(body)
        if not body.documents:
            raise bad_request("documents must hold at least one document to rerank",
                              "documents")
        if body.top_n < 0:
            raise bad_request(f"top_n must be 0 (every document) or more, got {body.top_n}",
                              "top_n")
        pairs = [(0, j) for j in range(len(body.documents))]

        def response(rid, scores, tokens):
            order = sorted(range(len(scores)), key=lambda j: (-scores[j], j))
            order = order[:body.top_n] if body.top_n else order
            return RerankResponse(id=rid, model=self.model_name(body.model), results=[
                RerankResult(index=j, relevance_score=scores[j],
                             document=RerankDocument(text=body.documents[j])
                             if body.return_documents else None) for j in order],
                usage=ScoreUsage(prompt_tokens=tokens, total_tokens=tokens))

        return await self._run(body, raw_request, "rerank", [body.query], body.documents,
                               pairs, "documents", response)

    def _check(self, body: _PoolingFields) -> None:
        self.check_model(body.model)
        if self.task is None:
            raise bad_request("this model runs for generation and cannot score or rerank: "
                              "serve a sequence classifier (a *ForSequenceClassification "
                              "model, or --convert classify with --hf-overrides) or an "
                              "embedding model with --runner pooling", "model")

    async def _run(self, body, raw_request, prefix: str, texts_1: list[str],
                   texts_2: list[str], pairs: list[tuple[int, int]], param: str, build):
        """Run the pairs' prompts (a classifier) or every text once (an embedding model)
        and answer ``build(request_id, scores per pair, prompt tokens)``."""
        classify = self.task == "classify"
        prompts = await off_loop(self._prompts, body, texts_1, texts_2, pairs, param, classify)
        params = [PoolingParams(task=self.task, use_activation=body.use_activation)
                  ] * len(prompts)
        request_id = self.request_id(raw_request, prefix, body.request_id)

        def response(finals):
            data = [f.outputs.data for f in finals]
            if classify:
                scores = [float(d[0]) for d in data]
            else:       # bi-encoder: each text embedded once
                n1 = len(texts_1)
                scores = [cosine_similarity(data[i], data[n1 + j]) for i, j in pairs]
            tokens = sum(len(f.prompt_token_ids) for f in finals)
            return build(request_id, scores, tokens)

        return await self.respond(raw_request, body, request_id, prompts, params, param, None,
                                  response)

    def _prompts(self, body, texts_1, texts_2, pairs, param, classify) -> list[PreparedPrompt]:
        """The prompts to run (see :meth:`_run`), each checked against ``max_model_len``.

        Raises:
            APIError: 400 for an empty or too long text or prompt, or a template that does
                not render.
        """
        rerank = param == "documents"
        names_1 = ["query"] if rerank else [f"text_1[{i}]" for i in range(len(texts_1))]
        names_2 = [f"{param}[{j}]" for j in range(len(texts_2))]
        for names, texts in ((names_1, texts_1), (names_2, texts_2)):
            for name, text in zip(names, texts):
                self.check_text_length(text, name.split("[")[0])
                if not text:
                    raise bad_request(f"{name} is empty; every text needs at least one "
                                      "character", name.split("[")[0])
        if not classify:
            return [PreparedPrompt(t, self._ids(self.tokenizer.encode(t), name, body,
                                                name.split("[")[0]), 0)
                    for name, t in zip(names_1 + names_2, texts_1 + texts_2)]
        cfg = self.engine.model_info.model_config
        concatenate = bool(cfg.classifier and cfg.classifier.from_tokens)
        prompts = []
        for i, j in pairs:
            try:
                ids = cross_encoder_prompt(self.tokenizer, texts_1[i], texts_2[j],
                                           self.config.chat_template, concatenate)
            except ValueError as e:
                raise bad_request(str(e)) from None
            what = f"the prompt of {names_2[j]} with {names_1[i]}"
            prompts.append(PreparedPrompt(None, self._ids(ids, what, body, param), 0))
        return prompts

    def _ids(self, ids: list[int], what: str, body, param: str) -> list[int]:
        max_model_len = self.engine.model_info.max_model_len
        ids = truncate_prompt(ids, body.truncate_prompt_tokens, max_model_len)
        if not ids:
            raise bad_request(f"{what} tokenizes to no tokens", param)
        if len(ids) > max_model_len:
            raise bad_request(f"{what} has {len(ids)} tokens, more than this model's maximum "
                              f"context length of {max_model_len} tokens; shorten it (or set "
                              "truncate_prompt_tokens)", param)
        return ids


async def score(request: Request) -> Response:
    """``POST /score`` (and ``/v1/score``) over ``request.app.state.scoring``."""
    ready(request)
    return await request.app.state.scoring.score(await parse(request, ScoreRequest), request)


async def rerank(request: Request) -> Response:
    """``POST /rerank`` (and ``/v1/rerank``, ``/v2/rerank``) over
    ``request.app.state.scoring``."""
    ready(request)
    return await request.app.state.scoring.rerank(await parse(request, RerankRequest), request)


def score_routes() -> list[Route]:
    """The routes of :data:`SCORE_PATHS` and :data:`RERANK_PATHS`."""
    return ([Route(p, score, methods=["POST"]) for p in SCORE_PATHS]
            + [Route(p, rerank, methods=["POST"]) for p in RERANK_PATHS])
