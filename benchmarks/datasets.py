"""Benchmark request sets: random, ShareGPT-format JSON, prefix repetition, prompt lookup,
workload W1, chat questions.

Each yields :class:`SampleRequest`s (a prompt as token ids, text or chat messages, its length,
and the exact number of tokens to generate). The dataset names and flags follow ``vllm bench``
(``--dataset-name random|sharegpt|prefix_repetition``, ``--random-input-len``, ...); ``chat``
(``bench serve`` only) sends the questions of ``configs/workloads/chat.json`` as chat messages.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
W1_PATH = os.path.join(ROOT, "configs", "workloads", "w1.json")
CHAT_PATH = os.path.join(ROOT, "configs", "workloads", "chat.json")
DATASETS = ("random", "sharegpt", "prefix_repetition", "prompt_lookup", "w1")
#: Sets only a server can take (their prompts are chat messages, rendered by its template).
CHAT_DATASETS = ("chat",)


@dataclass
class SampleRequest:
    """One benchmark request.

    Attributes:
        prompt: token ids (random sets), text (ShareGPT) or chat messages (``[{"role": "user",
            "content": ...}]``, the chat set: sent to ``/v1/chat/completions``).
        prompt_len: prompt length in tokens; 0 for chat messages (only the server knows their
            rendered length: the results take its ``usage.prompt_tokens``).
        output_len: tokens to generate (EOS is ignored so that exactly this many come out).
    """

    prompt: list[int] | str | list[dict]
    prompt_len: int
    output_len: int

    @property
    def is_chat(self) -> bool:
        """Whether :attr:`prompt` is a list of chat messages."""
        return isinstance(self.prompt, list) and bool(self.prompt) \
            and isinstance(self.prompt[0], dict)


def random_requests(num: int, input_len: tuple[int, int], output_len: int, seed: int,
                    token_range: tuple[int, int]) -> list[SampleRequest]:
    """Prompts of random token ids in ``token_range`` with lengths uniform in ``input_len``
    (inclusive), drawn with ``numpy.random.default_rng(seed)``: lengths first, then each
    prompt's ids (W1's recipe)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(input_len[0], input_len[1] + 1, size=num)
    return [SampleRequest(rng.integers(token_range[0], token_range[1], size=int(n)).tolist(),
                          int(n), output_len) for n in lengths]


def prefix_repetition_requests(num: int, num_prefixes: int, prefix_len: int, suffix_len: int,
                               output_len: int, seed: int, token_range: tuple[int, int]
                               ) -> list[SampleRequest]:
    """``num`` requests over ``num_prefixes`` shared random prefixes of ``prefix_len`` tokens,
    each followed by its own random ``suffix_len`` tokens (requests cycle through the
    prefixes, then are shuffled)."""
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(*token_range, size=prefix_len).tolist() for _ in range(num_prefixes)]
    out = [SampleRequest(prefixes[i % num_prefixes]
                         + rng.integers(*token_range, size=suffix_len).tolist(),
                         prefix_len + suffix_len, output_len) for i in range(num)]
    return [out[i] for i in rng.permutation(num)]


def prompt_lookup_requests(num: int, input_len: int, output_len: int, seed: int,
                           token_range: tuple[int, int]) -> list[SampleRequest]:
    """Prompts that the output can copy from: a random passage of ``input_len // 2`` token
    ids written twice (a model that continues the pattern writes it a third time, prompt
    lookup's best case; ``--speculative-config`` with ``method="ngram"``), drawn with
    ``numpy.random.default_rng(seed)``."""
    rng = np.random.default_rng(seed)
    half = max(1, input_len // 2)
    passages = [rng.integers(*token_range, size=half).tolist() for _ in range(num)]
    return [SampleRequest(p + p, 2 * half, output_len) for p in passages]


def sharegpt_requests(path: str, tokenizer, num: int, seed: int, output_len: int | None,
                      max_len: int) -> list[SampleRequest]:
    """Requests from a ShareGPT-format JSON list (``[{"conversations": [{"from": "human",
    "value": ...}, {"from": "gpt", "value": ...}, ...]}, ...]``): the first turn is the
    prompt, the second's token count the output length (unless ``output_len`` is given).
    Conversations with fewer than two turns, or that do not fit ``max_len``, are skipped.

    Raises:
        ValueError: the file is not such a list, or yields fewer than ``num`` requests.
    """
    with open(path) as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not JSON: {e}") from None
    if not isinstance(data, list):
        raise ValueError(f"{path}: a ShareGPT file is a JSON list of conversations")
    order = np.random.default_rng(seed).permutation(len(data))
    out = []
    for i in order:
        turns = data[i].get("conversations") or data[i].get("conversation") or []
        if len(turns) < 2:
            continue
        prompt = turns[0]["value"]
        prompt_len = len(tokenizer.encode(prompt))
        out_len = output_len or len(tokenizer.encode(turns[1]["value"], add_special_tokens=False))
        if prompt_len < 1 or out_len < 1 or prompt_len + out_len > max_len:
            continue
        out.append(SampleRequest(prompt, prompt_len, out_len))
        if len(out) == num:
            return out
    raise ValueError(f"{path} gives only {len(out)} usable requests, {num} asked")


def load_w1() -> dict:
    """Workload W1's definition (``configs/workloads/w1.json``)."""
    with open(W1_PATH) as f:
        return json.load(f)


def w1_requests(vocab_size: int | None = None) -> list[SampleRequest]:
    """Workload W1: 64 random-id prompts of 32-256 tokens, 128 output tokens each."""
    w = load_w1()
    lo, hi = w["token_range"]
    return random_requests(w["num_requests"], tuple(w["input_len"]), w["output_len"], w["seed"],
                           (lo, min(hi, vocab_size or hi)))


def load_chat() -> dict:
    """The chat workload's definition (``configs/workloads/chat.json``): ``questions`` (64
    short user questions), ``output_len``, ``single_user_requests``, ``concurrency``."""
    with open(CHAT_PATH) as f:
        return json.load(f)


def chat_requests(num: int, output_len: int) -> list[SampleRequest]:
    """The first ``num`` chat questions (cycled when ``num`` is more than there are), each as
    one user message, generating ``output_len`` tokens."""
    questions = load_chat()["questions"]
    return [SampleRequest([{"role": "user", "content": questions[i % len(questions)]}], 0,
                          output_len) for i in range(num)]


def add_dataset_args(parser: argparse.ArgumentParser, chat: bool = False) -> None:
    """``vllm bench``-style dataset flags (``chat``: offer the chat sets too, for a
    benchmark that sends requests to a server)."""
    g = parser.add_argument_group("dataset")
    g.add_argument("--dataset-name", choices=DATASETS + (CHAT_DATASETS if chat else ()),
                   default="random")
    g.add_argument("--dataset-path", default=None, help="ShareGPT JSON file (--dataset-name sharegpt)")
    g.add_argument("--num-prompts", type=int, default=64)
    g.add_argument("--random-input-len", type=int, default=128)
    g.add_argument("--random-output-len", type=int, default=128,
                   help="tokens each request generates (random, prefix_repetition, "
                        "prompt_lookup and chat sets)")
    g.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="input lengths uniform in [len*(1-r), len*(1+r)]")
    g.add_argument("--prefix-repetition-prefix-len", type=int, default=256)
    g.add_argument("--prefix-repetition-suffix-len", type=int, default=64)
    g.add_argument("--prefix-repetition-num-prefixes", type=int, default=4)
    g.add_argument("--sharegpt-output-len", type=int, default=None)
    g.add_argument("--dataset-seed", type=int, default=0)


def requests_from_args(args: argparse.Namespace, tokenizer, vocab_size: int,
                       max_len: int) -> list[SampleRequest]:
    """The request set the flags describe (token ids kept inside ``[3, vocab_size)``; the
    chat set uses neither ``tokenizer`` nor ``vocab_size``).

    Raises:
        ValueError: inconsistent flags (no ``--dataset-path`` for sharegpt, requests longer
            than ``max_len``).
    """
    for flag in ("num_prompts", "random_input_len", "random_output_len"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    token_range = (3, vocab_size)
    name = args.dataset_name
    if name == "w1":
        requests = w1_requests(vocab_size)
    elif name == "chat":
        requests = chat_requests(args.num_prompts, args.random_output_len)
    elif name == "sharegpt":
        if not args.dataset_path:
            raise ValueError("--dataset-name sharegpt needs --dataset-path FILE.json")
        requests = sharegpt_requests(args.dataset_path, tokenizer, args.num_prompts,
                                     args.dataset_seed, args.sharegpt_output_len, max_len)
    elif name == "prefix_repetition":
        requests = prefix_repetition_requests(
            args.num_prompts, args.prefix_repetition_num_prefixes,
            args.prefix_repetition_prefix_len, args.prefix_repetition_suffix_len,
            args.random_output_len, args.dataset_seed, token_range)
    elif name == "prompt_lookup":
        requests = prompt_lookup_requests(args.num_prompts, args.random_input_len,
                                          args.random_output_len, args.dataset_seed,
                                          token_range)
    else:
        r, n = args.random_range_ratio, args.random_input_len
        lengths = (max(1, round(n * (1 - r))), max(1, round(n * (1 + r))))
        requests = random_requests(args.num_prompts, lengths, args.random_output_len,
                                   args.dataset_seed, token_range)
    too_long = [q for q in requests if q.prompt_len + q.output_len > max_len]
    if too_long:
        raise ValueError(f"{len(too_long)} requests need more than max_model_len={max_len} "
                         f"tokens (e.g. {too_long[0].prompt_len} + {too_long[0].output_len})")
    return requests
