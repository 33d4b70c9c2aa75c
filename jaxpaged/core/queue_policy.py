"""The scheduling policies (``--scheduling-policy``): the waiting queue's order and the
preemption victim.

* ``fcfs``: arrival order; the newest running sequence is preempted first.
* ``priority``: lower ``priority`` first, ties by arrival; the victim is the lowest-priority,
  newest running sequence (vLLM's ``priority`` policy).
* ``sjf`` (shortest job first with aging): the queue is ordered by
  ``arrival + K * remaining / max_model_len``: ``arrival`` the request's arrival number,
  ``remaining`` the tokens it has left to process (prompt and outputs not in the pool, plus
  ``max_tokens`` minus its outputs so far), ``K`` = ``sjf_aging_requests``. A request that
  arrived ``d`` requests later sorts ahead only if its remaining work is shorter by more than
  ``d * max_model_len / K`` tokens, so **at most K requests that arrived after a request are
  scheduled before it** (aging: the bound is the same whatever the load, and no request
  starves). The key does not change while a request waits, so the queue stays sorted on
  insert. The victim is the running sequence last in that order. (Shortest-job-first for LLM
  serving with a starvation guard: Fu et al., "Efficient LLM Scheduling by Learning to Rank",
  NeurIPS 2024; here the job length is the request's own bound, not a prediction.)

Pure Python, no JAX.
"""

from __future__ import annotations

from jaxpaged.constants import SCHEDULING_POLICIES
from jaxpaged.core.request import Request


class QueuePolicy:
    """One policy's queue key and victim choice.

    Args:
        policy: ``fcfs``, ``priority`` or ``sjf``.
        max_model_len: most tokens of one sequence (``sjf``'s scale).
        sjf_aging_requests: ``sjf``'s K.

    Raises:
        ValueError: an unknown policy.
    """

    def __init__(self, policy: str, max_model_len: int, sjf_aging_requests: int = 64):
        if policy not in SCHEDULING_POLICIES:
            raise ValueError(f"unknown scheduling policy {policy!r}; "
                             f"choose from {list(SCHEDULING_POLICIES)}")
        self.policy = policy
        self._aging = sjf_aging_requests / max_model_len

    def key(self, req: Request) -> tuple:
        """The waiting queue's sort key of ``req`` (smaller runs first)."""
        if self.policy == "priority":
            return (req.priority, req.arrival)
        if self.policy == "sjf":
            remaining = (len(req.all_token_ids) - req.num_computed_tokens
                         + req.max_tokens - req.num_output_tokens)
            return (req.arrival + self._aging * remaining, req.arrival)
        return (req.arrival,)

    def victim(self, running: list[Request]) -> Request:
        """The running sequence to preempt (``running`` in scheduling order, non-empty)."""
        if self.policy == "fcfs":
            return running[-1]
        return max(running, key=self.key)
