"""Whether a step speculates: its measured cost against its sequences' acceptance rates.

A verification step computes ``1 + k`` tokens a sequence (its shape: one query block of
``1 + k`` per sequence, whatever each proposes), so its cost is the step's, not the
proposals': about one decode step while the step is bound by reading the weights (small
batches, fast accelerators), about ``1 + k`` once it is bound by arithmetic (as on the 2-core
CPUs: ``docs/measurements.md``, "Adaptive speculation").
It emits ``1 + a`` tokens a sequence, ``a`` accepted. So per batch-size class (running
sequences, by powers of two) the rule keeps, as exponential moving averages over timed
decode-only steps,

- ``u``: seconds per sequence of a plain decode step, and
- ``r``: a verification step's time over a plain step's of as many sequences (the cost
  ratio; a draft model's forwards fall in the step's time),

and per sequence an acceptance rate ``alpha`` (:class:`SpecState`: the chance that a
proposal is right given the ones before it were; a moving average over its verified
proposals and, with n-gram proposals, over the proposals it would have made in its plain
steps, checked against the tokens it then emitted: free, and exactly a point-mass
proposal's acceptance, P(t = x) = p(x)). A sequence is expected to emit
``1 + sum_j alpha ** j`` tokens (j = 1 .. k) in a verification step; the step speculates
when its sequences' mean ``E`` beats ``(1 + MIN_GAIN) * r``. The cost ratio follows the
hardware and the shapes, not the load or the text, so a class without one borrows its
nearest class's; acceptance follows the text (a prompt-lookup sequence copies little in
its first tokens and almost everything later), which is why it is kept per sequence and
current: the moving averages of tokens per second per mode that this rule replaces judged
speculation by its first steps and lost 3-5% against plain decoding at batch 64
(``docs/benchmarks.md``).

The first class measures plain steps, then verification steps (the first of each mode's
steps untimed: they may compile or touch new memory); then every class follows the rule,
and now and then takes the other mode to measure it again: at the :data:`EXPLORE_FIRST`-th
decision of the class, then after gaps that double up to :data:`EXPLORE_MAX` (an
epsilon-greedy choice with a decaying epsilon, Sutton & Barto, "Reinforcement Learning",
2nd ed., section 2.2). With n-gram proposals a class that does not speculate explores only
while ``E`` is within :data:`EXPLORE_WITHIN` of the break-even (its acceptance is known
without speculating); a draft model's sequences learn theirs only by drafting, so they
explore always. vLLM's static ``disable_by_batch_size`` (no speculation above a batch
size), given in the config, replaces the rule. Pure Python.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

#: Steps of a mode in a class not measured (their first steps may compile shapes).
WARMUP_STEPS = 1
#: Measured steps of plain decoding, and of verification, before the rule trusts them.
MIN_PLAIN_SAMPLES = 3
MIN_VERIFY_SAMPLES = 2
#: The decision of a class that first takes the mode that is not the best; the gap to the
#: next doubles each time, up to :data:`EXPLORE_MAX`.
EXPLORE_FIRST = 32
EXPLORE_MAX = 256
#: A class not speculating explores (n-gram) only while E > (1 - this) * the break-even.
EXPLORE_WITHIN = 0.1
#: Weight of the newest step in the cost averages.
ALPHA = 0.25
#: Speculation must be expected to emit this share more tokens per second: plain steps run
#: asynchronously and risk nothing; the cost ratio's samples spread, and ``E`` runs high, as
#: a proposal's later positions are accepted less often than its first (the geometric
#: model's one ``alpha``). A smaller margin let a batch speculate where it did not pay
#: (``docs/measurements.md``, "Adaptive speculation").
MIN_GAIN = 0.15
#: Weight of the newest checked proposal in a sequence's acceptance.
ACCEPT_WEIGHT = 0.25
#: A sequence's acceptance before any of its proposals was checked.
PRIOR_ACCEPTANCE = 1.0
#: A sequence whose shadow lookups find nothing waits 1, 2, 4 ... up to this many tokens
#: before the next (a lookup copies its tokens: O(length) host time a step otherwise).
MAX_SHADOW_WAIT = 8


@dataclass
class SpecState:
    """One sequence's drafting record (``Request.spec_state``).

    Attributes:
        alpha: the chance a proposal is right given the earlier ones were (moving average;
            a step where an n-gram sequence found nothing to propose counts as a miss).
        shadow: an n-gram proposal made after a plain step and not yet checked: the index
            in ``all_token_ids`` of the token its first id predicts, and the ids.
        wait, backoff: tokens until the next shadow lookup, and the last such wait.
    """

    alpha: float = PRIOR_ACCEPTANCE
    shadow: tuple[int, list[int]] | None = None
    wait: int = 0
    backoff: int = 0

    def record(self, accepted: int, proposed: int) -> None:
        """``accepted`` of ``proposed`` proposals (a run from the first) were accepted:
        that many moving-average steps towards 1, then one towards 0 for the first rejected
        one (those after it were not tried)."""
        a = 1.0 - (1.0 - self.alpha) * (1.0 - ACCEPT_WEIGHT) ** accepted
        self.alpha = a * (1.0 - ACCEPT_WEIGHT) if accepted < proposed else a

    def observe(self, tokens: list[int], propose, k: int) -> None:
        """The sequence, now ``tokens``, emitted a token in a plain step: check the shadow
        proposal against it, and when that is settled make the next one with
        ``propose(tokens, k)`` (``NgramProposer.propose``), backing off after lookups that
        find nothing."""
        if self.shadow is not None:
            start, proposal = self.shadow
            known = tokens[start:start + len(proposal)]
            accepted = 0
            while accepted < len(known) and known[accepted] == proposal[accepted]:
                accepted += 1
            if accepted == len(known) < len(proposal):
                return      # every emitted token so far matches: wait for the next
            self.record(accepted, len(proposal))
            self.shadow = None
        if self.wait:
            self.wait -= 1
            return
        proposal = propose(tokens, k)
        if proposal:
            self.shadow, self.backoff = (len(tokens), proposal), 0
        else:       # nothing to propose: a miss, as in a verification step
            self.record(0, 1)
            self.backoff = self.wait = min(2 * self.backoff or 1, MAX_SHADOW_WAIT)


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a sequence with acceptance ``alpha`` is expected to emit in a verification
    step of ``k`` proposals: ``1 + alpha + alpha**2 + ... + alpha**k``."""
    total, p = 1.0, 1.0
    for _ in range(k):
        p *= alpha
        total += p
    return total


@dataclass
class _Average:
    min_samples: int
    steps: int = 0
    value: float = 0.0   # moving average

    def add(self, value: float) -> None:
        self.steps += 1
        if self.steps <= WARMUP_STEPS:
            return
        first = self.steps == WARMUP_STEPS + 1
        self.value = value if first else ALPHA * value + (1 - ALPHA) * self.value

    @property
    def measured(self) -> bool:
        return self.steps >= WARMUP_STEPS + self.min_samples


@dataclass
class _Class:
    per_seq: _Average = field(default_factory=lambda: _Average(MIN_PLAIN_SAMPLES))  # u
    ratio: _Average = field(default_factory=lambda: _Average(MIN_VERIFY_SAMPLES))   # r
    decisions: int = 0
    next_explore: int = EXPLORE_FIRST
    gap: int = EXPLORE_FIRST

    def explores(self) -> bool:
        """Count a decision; True when it is one that takes the other mode."""
        self.decisions += 1
        if self.decisions < self.next_explore:
            return False
        self.gap = min(2 * self.gap, EXPLORE_MAX)
        self.next_explore = self.decisions + self.gap
        return True


class AdaptiveSpeculation:
    """The per-step choice described in the module docstring.

    Args:
        acceptance_is_free: proposals are checked in plain steps too (n-gram).
        clock: seconds (monotonic); a test passes a fake one.
    """

    def __init__(self, acceptance_is_free: bool, clock=time.perf_counter):
        self._free = acceptance_is_free
        self._clock = clock
        self._classes: dict[int, _Class] = {}
        self._pending: dict[int, tuple[int, int, bool, float]] = {}
        self._last_done: float | None = None

    def choose(self, expected: list[float]) -> bool:
        """Whether a step over sequences expected to emit these many tokens each in a
        verification step (:func:`expected_tokens`; 1 for one that cannot speculate)
        speculates."""
        if not expected:
            return False
        key = len(expected).bit_length()
        c = self._classes.setdefault(key, _Class())
        if not c.per_seq.measured:
            return False
        ratio = self._ratio(key)
        if ratio is None:
            return True
        mean = sum(expected) / len(expected)
        pays = mean >= (1 + MIN_GAIN) * ratio
        if c.explores() and (pays or not self._free or mean > (1 - EXPLORE_WITHIN) * ratio):
            return not pays
        return pays

    def _ratio(self, key: int) -> float | None:
        """The class's cost ratio, else its nearest measured class's (None: none yet)."""
        measured = [k for k, c in self._classes.items() if c.ratio.measured]
        if not measured:
            return None
        return self._classes[min(measured, key=lambda k: (abs(k - key), k))].ratio.value

    def scheduled(self, key: int, num_running: int, num_seqs: int, verifies: bool) -> None:
        """A decode-only step (``key``: the id of its scheduled list) of ``num_seqs``
        sequences, a verification step if ``verifies``, was scheduled over
        ``num_running``."""
        if len(self._pending) > 64:     # steps that failed never come back
            self._pending.clear()
        self._pending[key] = (num_running.bit_length(), num_seqs, verifies, self._clock())

    def done(self, key: int, idle: bool) -> None:
        """The step ``key`` is applied; ``idle``: no sequence is left running. Its time runs
        from the previous step's end (so the host's work between steps counts, and steps
        overlapping under async scheduling count once), or from its own scheduling after an
        idle engine, to now."""
        entry = self._pending.pop(key, None)
        now = self._clock()
        if entry is not None:
            cls, num_seqs, verifies, started = entry
            seconds = now - (started if self._last_done is None else self._last_done)
            # (the class of a step's own size: choose may have seen another, when sequences
            # finished between the decision and the schedule)
            c = self._classes.setdefault(cls, _Class())
            if seconds > 0 and num_seqs:
                if not verifies:
                    c.per_seq.add(seconds / num_seqs)
                elif c.per_seq.measured:
                    c.ratio.add(seconds / (c.per_seq.value * num_seqs))
        self._last_done = None if idle else now
