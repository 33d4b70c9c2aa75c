"""Whether a step speculates: measured output tokens per second, per batch size.

Speculation pays when a verification step (``1 + k`` tokens a sequence) costs less than the
tokens it emits would cost as plain decode steps. That holds while a step is bound by
reading the weights (small batches, fast accelerators) and fails once it is bound by
arithmetic: on the 2-core CPU a 64-sequence SmolLM2-135M verification step of 5 tokens a
sequence took ~4x a decode step, more than the ~3.4 tokens it emitted per sequence
(``docs/speculative_decoding.md``, "When to speculate"). The break-even depends on the
hardware, the model, k and the acceptance rate, so it is measured rather than modelled:
for each batch-size class (running sequences, by powers of two) the rule keeps an
exponential moving average of the output tokens per second of steps scheduled with and
without speculation, tries each mode for a few steps first (speculation first), then takes
the better one (speculation only when it is :data:`MIN_GAIN` ahead), and now and then the
other, so a change of acceptance or of sequence
lengths is noticed: at the :data:`EXPLORE_FIRST`-th decision of the class, then after gaps
that double up to :data:`EXPLORE_MAX` decisions. It is an epsilon-greedy two-armed bandit
with a decaying epsilon (Sutton & Barto, "Reinforcement Learning", 2nd ed., section 2.2).
The decay matters where the two modes are close or the first samples misled: on the 2-core
CPU a 64-sequence SmolLM2 prompt-lookup batch (86% of proposals accepted overall, fewer in
its first steps) measured speculation below plain decoding in its first steps, and one
exploring step every 32 then cost ~4% of the run (``docs/benchmarks.md``). vLLM's static
``disable_by_batch_size`` (no speculation above a batch size), given in the config,
replaces it. Pure Python.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

#: Steps of a mode in a class not measured (their first steps may compile shapes).
WARMUP_STEPS = 2
#: Measured steps of each mode before the rule trusts the averages.
MIN_SAMPLES = 3
#: The decision of a class that first takes the mode that is not the best; the gap to the
#: next doubles each time, up to :data:`EXPLORE_MAX`.
EXPLORE_FIRST = 32
EXPLORE_MAX = 256
#: Weight of the newest step in the moving average.
ALPHA = 0.25
#: Speculation is chosen only when its measured rate beats plain decoding's by this share:
#: plain steps run asynchronously and risk nothing, and where the two are close the moving
#: averages' noise decided (a 64-sequence SmolLM2 batch on the 2-core CPU: 0.95x plain
#: over 4 iterations with ties going to speculation).
MIN_GAIN = 0.05


@dataclass
class _Arm:
    steps: int = 0
    rate: float = 0.0      # output tokens per second, moving average

    def add(self, tokens_per_s: float) -> None:
        self.steps += 1
        if self.steps <= WARMUP_STEPS:
            return
        first = self.steps == WARMUP_STEPS + 1
        self.rate = tokens_per_s if first else ALPHA * tokens_per_s + (1 - ALPHA) * self.rate

    @property
    def measured(self) -> bool:
        return self.steps >= WARMUP_STEPS + MIN_SAMPLES


@dataclass
class _Class:
    arms: dict[bool, _Arm] = field(default_factory=lambda: {True: _Arm(), False: _Arm()})
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
        clock: seconds (monotonic); a test passes a fake one.
    """

    def __init__(self, clock=time.perf_counter):
        self._clock = clock
        self._classes: dict[int, _Class] = {}
        self._pending: dict[int, tuple[bool, int, float]] = {}
        self._last_done: float | None = None

    def choose(self, num_running: int) -> bool:
        """Whether a step over ``num_running`` sequences speculates."""
        c = self._classes.setdefault(num_running.bit_length(), _Class())
        spec, plain = c.arms[True], c.arms[False]
        if not spec.measured:
            return True
        if not plain.measured:
            return False
        best = spec.rate > plain.rate * (1 + MIN_GAIN)
        return (not best) if c.explores() else best

    def scheduled(self, key: int, speculates: bool, num_running: int) -> None:
        """A step (``key``: the id of its scheduled list) was scheduled in that mode."""
        if len(self._pending) > 64:     # steps that failed never come back
            self._pending.clear()
        self._pending[key] = (speculates, num_running.bit_length(), self._clock())

    def done(self, key: int, num_tokens: int, idle: bool) -> None:
        """The step ``key`` emitted ``num_tokens`` tokens; ``idle``: no sequence is left
        running. Its time runs from the previous step's end (so the host's work between
        steps counts, and steps overlapping under async scheduling count once), or from its
        own scheduling after an idle engine, to now."""
        entry = self._pending.pop(key, None)
        now = self._clock()
        if entry is not None:
            speculates, cls, started = entry
            seconds = now - (started if self._last_done is None else self._last_done)
            if seconds > 0:     # (the class of a step's own size: choose may have seen
                # another, when sequences finished between the decision and the schedule)
                self._classes.setdefault(cls, _Class()).arms[speculates].add(
                    num_tokens / seconds)
        self._last_done = None if idle else now
