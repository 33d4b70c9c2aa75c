"""`SchedulerOutput`: everything one device step needs, decided by the scheduler.

The step contract of vLLM V1 (``vllm/v1/engine/core.py``; the type is
``vllm/v1/core/sched/output.py``): ``Scheduler.schedule()`` returns a ``SchedulerOutput``, the
model runner turns it into device arrays and runs the step
(``ModelRunner.execute(scheduler_output) -> ModelRunnerOutput``) without asking the KV cache
manager anything, and ``Scheduler.update_from_output`` applies the result. Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from jaxpaged.core.request import Request


@dataclass(slots=True)
class ScheduledRequest:
    """One sequence's share of a step: it computes tokens ``[start, start + num_new_tokens)``.
    Not to be modified once scheduled (not frozen only because a frozen dataclass costs
    several times more to build, and a step builds one per running sequence).

    Attributes:
        request: the sequence (the runner reads its token ids, seed and sampling params).
        start: the first position computed (its ``num_computed_tokens`` at scheduling).
        num_new_tokens: tokens computed this step (a decode: 1; a prefill chunk: more).
        page_ids: the sequence's whole page table after this step's allocation, in token
            order; the K/V of position ``p`` go to slot ``page_ids[p // page_size] *
            page_size + p % page_size``.
        samples: True when the chunk reaches the end of the sequence's tokens, so its last
            position's logits give the next token(s).
        num_samples: tokens to draw from those logits (0 unless ``samples``; ``n`` for the
            prompt of a parallel-sampling request not yet forked, else 1).
        draft_token_ids: speculative decoding: the proposals verified after the decode
            token (they are the chunk's last ``len(draft_token_ids)`` tokens, not in the
            request's tokens; the step samples one row per position of the chunk); None
            when the sequence does not speculate this step. With a draft model the
            scheduler leaves ``-1`` placeholders that the draft's proposer fills in place
            before the step is dispatched (the one change after scheduling).
        group_page_ids: a model whose layers form KV cache groups (``jaxpaged.core
            .kv_groups``): the page tables of groups 1.. (``page_ids`` is group 0's), each as
            long as ``page_ids``; None when one page table serves every layer.
        state_slot: a model with recurrent layers (``jaxpaged.core.state_slots``): the
            sequence's state slot; -1 otherwise.
    """

    request: Request
    start: int
    num_new_tokens: int
    page_ids: list[int]
    samples: bool
    num_samples: int
    draft_token_ids: list[int] | None = None
    group_page_ids: list[list[int]] | None = None
    state_slot: int = -1

    @property
    def end(self) -> int:
        """One past the last position computed."""
        return self.start + self.num_new_tokens


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """One step's plan, in batch order.

    Attributes:
        scheduled: the sequences the step runs, in batch order.
        preempted: sequences preempted (recompute) to make room this step.
        scheduled_new_reqs: sequences that left the waiting queue this step (vLLM's name).
        page_copies: ``(source page, destination page)`` pairs the device must copy before
            the step (copy-on-write of pages shared with another sequence).
        forks: a parallel-sampling prompt draws its ``n`` first tokens in this step (it is
            forked when they arrive, so the next step must wait for them).
        lora_loads: ``(slot, adapter)`` weights the runner writes into the LoRA slots
            before the step (``jaxpaged.lora.scheduling``).
        lora_slots: ``lora_int_id -> slot`` of every adapter in a slot (empty: LoRA off).
        state_copies: a model with recurrent layers and prefix caching
            (``jaxpaged.core.state_slots``): ``(restores, saves)``, lists of ``(source
            slot, destination slot)`` the runner copies in every recurrent layer, restores
            before the step's forward and saves after it.
    """

    scheduled: list[ScheduledRequest]
    preempted: list[Request] = field(default_factory=list)
    scheduled_new_reqs: list[Request] = field(default_factory=list)
    page_copies: list[tuple[int, int]] = field(default_factory=list)
    forks: bool = False
    lora_loads: list = field(default_factory=list)
    lora_slots: dict = field(default_factory=dict)
    state_copies: tuple = ((), ())

    @property
    def num_tokens(self) -> int:
        """Tokens the step computes (before padding)."""
        return sum(s.num_new_tokens for s in self.scheduled)
