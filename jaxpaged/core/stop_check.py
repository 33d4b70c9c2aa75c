"""The token-id stop rules of one sequence, checked by the scheduler after each appended token.

vLLM v1 checks these in the scheduler (``check_stop`` in ``vllm/v1/core/sched/utils.py``),
where a token is appended to its request, and leaves stop strings to the output processor,
which alone has the text. Same split here: :func:`check_stop` reads only token ids and
lengths; ``OutputProcessor.add_token`` detokenizes and matches stop strings; and
``Scheduler.update_from_output`` combines the two and finishes the sequence. The order is
vLLM's: while fewer than ``min_tokens`` tokens are out no EOS or stop id counts; then EOS
(unless ``ignore_eos``), ``stop_token_ids``, a stop string, and last the length limits
(``max_tokens``, ``max_model_len``), which ``min_tokens`` never holds back. Pure Python.
"""

from __future__ import annotations

from jaxpaged.core.request import Request

#: Why a sequence stops: (``finish_reason``, ``stop_reason``), vLLM's meanings.
Stop = tuple[str, int | str | None]

#: An EOS token stopped it (``stop_reason`` None).
STOP_EOS: Stop = ("stop", None)
#: ``max_tokens`` or ``max_model_len`` stopped it.
STOP_LENGTH: Stop = ("length", None)


def check_stop(req: Request, eos_token_ids: frozenset[int], max_model_len: int) -> Stop | None:
    """The token-id stop rule that the sequence's last appended token fires, or None.

    Args:
        req: the sequence, its newest token already in ``req.all_token_ids``.
        eos_token_ids: the model's EOS ids (ignored with ``params.ignore_eos``).
        max_model_len: the engine's length limit, prompt included.

    Returns:
        :data:`STOP_EOS`; ``("stop", token)`` for one of ``params.stop_token_ids``;
        :data:`STOP_LENGTH` when the output reached ``req.max_tokens`` or the sequence
        ``max_model_len``; None when it goes on (a stop string may still end it, found by the
        output processor). EOS and stop ids count only from the ``min_tokens``-th output token.

    ``Scheduler.append_token`` (``jaxpaged.core.step_results``) calls this only for a token
    that is an EOS or stop id or reaches a length limit, the conditions every rule here needs:
    a new rule must widen that test too.
    """
    ids = req.all_token_ids
    num_ids = len(ids)
    num_output = num_ids - len(req.prompt_token_ids)
    p = req.params
    if num_output >= p.min_tokens:
        token = ids[-1]
        if not p.ignore_eos and token in eos_token_ids:
            return STOP_EOS
        if p.stop_token_ids and token in p.stop_token_ids:
            return ("stop", token)
    if num_output >= req.max_tokens or num_ids >= max_model_len:
        return STOP_LENGTH
    return None
