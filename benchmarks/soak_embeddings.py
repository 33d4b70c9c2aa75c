"""The ``/v1/embeddings`` part of ``jaxpaged bench soak``: many clients against a pooling server.

vLLM serves one task per server, and so does ``jaxpaged serve``: embeddings come from a server
started with ``--runner pooling`` (``jaxpaged.pooling_params``), not from the generating server
the rest of the soak targets. ``jaxpaged bench soak`` therefore starts a second, pooling server
of the same model in this process after the generation part (or targets
``--embeddings-base-url``), and this module sends it ``num_requests`` requests, at most
``concurrency`` at once: inputs as a string, a list of 1-4 strings, token ids, or a list of
token-id lists (text prompts repeated, so requests share prefixes), ``encoding_format`` float
or base64, and a ``disconnect_fraction`` of clients that hang up after a random moment. A
``RERANK_SHARE`` of the requests go to ``/v1/rerank`` instead (a query and 1-3 documents,
``top_n`` 0-2), which the pooling server answers by the cosine similarity of embeddings.

It checks that every request not hung up got a 200 with OpenAI's shape (``object: "list"``,
``data`` items ``{object: "embedding", index}`` in input order, ``usage.prompt_tokens`` ==
``total_tokens`` == the inputs' token count), that each embedding equals offline
``LLM.embed`` of the same input on an engine of the same flags within ``TOLERANCE`` (batch
composition must not change an embedding), and afterwards, for a server in this process,
that every KV page is free and the engine holds no request. A rerank answer must hold
``min(top_n or all, documents)`` distinct results sorted by ``relevance_score``, ``usage``
counting the query's and documents' tokens, and scores equal to offline ``LLM.score`` within
``TOLERANCE``. Returns a summary whose ``problems`` lists each failed check.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import time
from dataclasses import dataclass

import httpx
import numpy as np

from jaxpaged.benchmarks.serve import http_client, run_limited, served_model

#: Largest difference allowed between a served and an offline embedding (float32 rounding of
#: other step shapes).
TOLERANCE = 1e-5
#: The share of requests sent to ``/v1/rerank``.
RERANK_SHARE = 0.2
_TEXTS = ("Once upon a time", "Tom and his dog went to the park.", "The cat saw a mouse",
          "Lily had a toy car. She liked to play with it in the garden every morning.",
          "One day, a big red ball", "Ben said,")


@dataclass
class EmbeddingsRequest:
    """One request of the workload: its body, its inputs' token ids, and when (seconds after
    it was sent) its client hangs up (None: never)."""

    index: int
    body: dict
    token_ids: list[list[int]]
    hang_up_after: float | None
    route: str = "/v1/embeddings"


def make_embeddings_workload(num_requests: int, tokenizer, seed: int,
                             disconnect_fraction: float) -> list[EmbeddingsRequest]:
    """``num_requests`` random embedding requests (see the module docstring)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(num_requests):
        texts = [str(rng.choice(_TEXTS)) + (f" {int(rng.integers(100))}" if rng.random() < 0.5
                                            else "")
                 for _ in range(int(rng.integers(1, 5)))]
        ids = [tokenizer.encode(t) for t in texts]
        if rng.random() < RERANK_SHARE:     # ids: the query's, then each document's
            body = {"query": texts[0], "documents": texts[1:] or texts[:1],
                    "top_n": int(rng.integers(3))}
            hang_up = float(rng.uniform(0, 0.05)) if rng.random() < disconnect_fraction \
                else None
            out.append(EmbeddingsRequest(i, body, ids if ids[1:] else ids * 2, hang_up,
                                         "/v1/rerank"))
            continue
        kind = rng.integers(4)
        inputs = (texts[0] if kind == 0 else texts if kind == 1 else ids[0] if kind == 2
                  else ids)
        if kind in (0, 2):
            ids = ids[:1]
        body = {"input": inputs, "encoding_format": "base64" if rng.random() < 0.5 else "float"}
        hang_up = float(rng.uniform(0, 0.05)) if rng.random() < disconnect_fraction else None
        out.append(EmbeddingsRequest(i, body, ids, hang_up))
    return out


async def _send(client: httpx.AsyncClient, req: EmbeddingsRequest, model: str):
    """(status or None for a hang-up, the JSON body or the error text)."""
    async def post():
        r = await client.post(req.route, json={"model": model, **req.body})
        try:
            return r.status_code, r.json()
        except ValueError:
            return r.status_code, r.text

    if req.hang_up_after is None:
        return await post()
    try:
        return await asyncio.wait_for(post(), req.hang_up_after)
    except TimeoutError:
        return None, "hung up"


def _vectors(data: list[dict], encoding_format: str) -> list[np.ndarray]:
    if encoding_format == "base64":
        return [np.frombuffer(base64.b64decode(d["embedding"]), "<f4") for d in data]
    return [np.asarray(d["embedding"], np.float32) for d in data]


def check_response(req: EmbeddingsRequest, status, body, model: str) -> list[str]:
    """What is wrong with one answer (empty: nothing), offline comparison aside."""
    if status != 200:
        return [f"status {status}: {str(body)[:300]}"]
    n, tokens = len(req.token_ids), sum(map(len, req.token_ids))
    if req.route == "/v1/rerank":
        return _check_rerank(req, body, model, tokens)
    problems = []
    if body.get("object") != "list" or body.get("model") != model:
        problems.append(f"object {body.get('object')!r}, model {body.get('model')!r}")
    data = body.get("data", [])
    if [d.get("index") for d in data] != list(range(n)) or any(
            d.get("object") != "embedding" for d in data):
        problems.append(f"data items {[(d.get('object'), d.get('index')) for d in data]}")
    if body.get("usage") != {"prompt_tokens": tokens, "total_tokens": tokens}:
        problems.append(f"usage {body.get('usage')}, expected {tokens} prompt tokens")
    return problems


def _check_rerank(req: EmbeddingsRequest, body, model: str, tokens: int) -> list[str]:
    """What is wrong with one rerank answer, offline comparison aside."""
    num_docs, top_n = len(req.body["documents"]), req.body["top_n"]
    results = body.get("results", [])
    indices = [r.get("index") for r in results]
    scores = [r.get("relevance_score", 0.0) for r in results]
    problems = [] if body.get("model") == model else [f"model {body.get('model')!r}"]
    if len(set(indices)) != min(top_n or num_docs, num_docs) or not set(indices) <= set(
            range(num_docs)):
        problems.append(f"result indices {indices} for {num_docs} documents, top_n {top_n}")
    if scores != sorted(scores, reverse=True):
        problems.append(f"results not sorted by relevance_score: {scores}")
    if body.get("usage") != {"prompt_tokens": tokens, "total_tokens": tokens}:
        problems.append(f"usage {body.get('usage')}, expected {tokens} prompt tokens")
    return problems


def run_embeddings_soak(base_url: str, llm, num_requests: int, concurrency: int, seed: int = 0,
                        disconnect_fraction: float = 0.1, api_key: str | None = None,
                        model: str | None = None, engine=None) -> dict:
    """Run the embeddings soak against the pooling server at ``base_url``.

    Args:
        llm: the offline reference, a :class:`jaxpaged.LLM` of the served model started
            with the server's runner flags.
        engine: the server's ``AsyncEngine`` when it runs in this process (adds the page-pool
            checks); None for a remote server.

    Returns:
        The summary; ``problems`` holds every failed check (empty when all passed).
    """
    url, card = served_model(base_url, api_key, model)
    model = card["id"]
    requests = make_embeddings_workload(num_requests, llm.get_tokenizer(), seed,
                                        disconnect_fraction)

    async def go():
        async with http_client(url, api_key) as client:
            return await run_limited(requests, lambda q: _send(client, q, model), concurrency)

    results, duration = asyncio.run(go())
    problems: list[str] = []

    def problem(req: EmbeddingsRequest | None, what: str) -> None:
        where = "" if req is None else f"embeddings request {req.index} {json.dumps(req.body)}: "
        problems.append(where + what)

    answered = [(q, body) for q, (status, body) in zip(requests, results) if status is not None]
    for req, (status, body) in zip(requests, results):
        if status is not None:
            for p in check_response(req, status, body, model):
                problem(req, p)
    compared_scores = 0
    for req, body in answered:
        if req.route != "/v1/rerank" or not isinstance(body, dict) or "results" not in body:
            continue
        offline = llm.score(req.body["query"], req.body["documents"], use_tqdm=False)
        for r in body["results"]:
            j = r.get("index")
            if isinstance(j, int) and 0 <= j < len(offline):
                diff = abs(r["relevance_score"] - offline[j].outputs.score)
                compared_scores += 1
                if diff > TOLERANCE:
                    problem(req, f"relevance_score differs from offline LLM.score by "
                                 f"{diff:.3g}")
    good = [(q, b) for q, b in answered if isinstance(b, dict) and "data" in b
            and len(b["data"]) == len(q.token_ids)]
    flat = [ids for q, _ in good for ids in q.token_ids]
    offline = [np.asarray(o.outputs.embedding, np.float32)
               for o in llm.embed(flat, use_tqdm=False)] if flat else []
    worst, k = 0.0, 0
    for req, body in good:
        for vec in _vectors(body["data"], req.body["encoding_format"]):
            diff = float(np.abs(vec - offline[k]).max()) if vec.shape == offline[k].shape \
                else float("inf")
            worst, k = max(worst, diff), k + 1
            if diff > TOLERANCE:
                problem(req, f"embedding differs from offline LLM.embed by {diff:.3g}")
    leaked = None
    if engine is not None and engine.is_ready:     # (a dead one fails /health below)
        core = engine.check_alive()         # the EngineClient (engine/protocol.py)
        deadline = time.monotonic() + 30
        while core.has_unfinished_requests() and time.monotonic() < deadline:
            time.sleep(0.02)
        kv = core.stats()
        leaked = kv.num_pages - kv.num_free_pages
        if leaked or core.has_unfinished_requests():
            problem(None, f"the pooling engine is not idle: {leaked} pages held, "
                          f"{core.get_num_unfinished_requests()} requests")
    with contextlib.suppress(httpx.HTTPError):
        if httpx.get(url + "/health", timeout=30).status_code != 200:
            problem(None, "/health is not 200 after the embeddings soak")
    return {"num_requests": num_requests, "concurrency": concurrency,
            "answered": len(answered), "hung_up": len(requests) - len(answered),
            "compared_embeddings": k, "compared_scores": compared_scores,
            "max_abs_diff": worst, "duration": duration,
            "leaked_pages": leaked, "problems": problems[:50], "num_problems": len(problems)}


def add_cli_args(parser) -> None:
    """The embeddings part's flags of ``jaxpaged bench soak``."""
    parser.add_argument("--embeddings-requests", type=int, default=None,
                        help="/v1/embeddings (and a fifth of them /v1/rerank) requests sent "
                             "to a pooling server after the generation part (default: a "
                             "tenth of --num-requests; 0: none)")
    parser.add_argument("--embeddings-base-url", default=None,
                        help="a running --runner pooling server (default: start one of the "
                             "engine flags' model here)")


def soak_from_flags(args, engine_args, seed: int) -> dict | None:
    """Run the embeddings part as ``args`` say (None when it sends no request): against
    ``--embeddings-base-url``, or a pooling server of ``engine_args``' model started here;
    the offline reference is an ``LLM`` of the same flags with ``runner="pooling"``."""
    import dataclasses

    from jaxpaged import LLM
    from jaxpaged.arg_utils import DEFAULT_MODEL
    from jaxpaged.server.launcher import ServerThread
    from jaxpaged.server.serving import ServerConfig

    num = args.num_requests // 10 if args.embeddings_requests is None \
        else args.embeddings_requests
    if num <= 0:
        return None
    pooling_args = dataclasses.replace(engine_args, runner="pooling")
    server = None
    if args.embeddings_base_url is None:
        name = "stories260K" if engine_args.model == DEFAULT_MODEL else engine_args.model
        server = ServerThread(pooling_args, ServerConfig([name])).start(timeout=1800)
    try:
        llm = LLM(**vars(pooling_args))
        return run_embeddings_soak(args.embeddings_base_url or server.url, llm, num,
                                   args.concurrency, seed, args.disconnect_fraction / 2,
                                   args.api_key, args.served_model if server is None else None,
                                   server.engine if server else None)
    finally:
        if server is not None:
            server.stop()
