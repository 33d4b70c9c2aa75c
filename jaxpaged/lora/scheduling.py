"""The scheduler's LoRA rules: at most ``max_loras`` adapters among running requests, and
their device slots. Pure Python.

A waiting request whose adapter would make ``max_loras + 1`` distinct adapters among the
running requests is skipped (it keeps its place; later requests may go first), as vLLM V1's
scheduler skips it (``vllm/v1/core/sched/scheduler.py``). An admitted request's adapter gets a
device slot in ``1 .. max_loras``: the one it already has, else a free one, else the least
recently used slot whose adapter no running request uses (one always exists, by the bound);
the slot's new weights ride in the step's :class:`SchedulerOutput` (``lora_loads``) and the
runner writes them before the step. An adapter keeps its slot while a running request uses it.
"""

from __future__ import annotations

from collections import OrderedDict

from jaxpaged.lora.cache import AdapterCache
from jaxpaged.lora.peft import LoRAAdapter


class LoRAScheduling:
    """Slot assignment and the adapter bound of one scheduler.

    Args:
        cache: the host's adapter cache (weights for a slot come from it).
    """

    def __init__(self, cache: AdapterCache):
        self.cache = cache
        self.max_loras = cache.config.max_loras
        #: lora_int_id -> device slot, least recently admitted first.
        self._slots: OrderedDict[int, int] = OrderedDict()
        self._loads: list[tuple[int, LoRAAdapter]] = []

    @staticmethod
    def adapter_ids(requests) -> set[int]:
        """Distinct ``lora_int_id`` of ``requests`` (base-model requests not counted)."""
        return {r.lora_request.lora_int_id for r in requests if r.lora_request is not None}

    def admit(self, request, active: set[int]) -> bool:
        """Whether ``request`` may join running requests using adapters ``active``; if so its
        adapter is added to ``active`` and given a slot (a load is queued when needed)."""
        lora = request.lora_request
        if lora is None:
            return True
        if lora.lora_int_id not in active and len(active) >= self.max_loras:
            return False
        active.add(lora.lora_int_id)
        if lora.lora_int_id in self._slots:
            self._slots.move_to_end(lora.lora_int_id)
            return True
        used = set(self._slots.values())
        free = [s for s in range(1, self.max_loras + 1) if s not in used]
        if free:
            slot = free[0]
        else:
            victim = next(i for i in self._slots if i not in active)
            slot = self._slots.pop(victim)
        self._slots[lora.lora_int_id] = slot
        self._loads.append((slot, self.cache.get(lora)))
        return True

    def requests_info(self, running, waiting) -> tuple[int, str, str]:
        """``(max_loras, running adapters, waiting adapters)``, names sorted and
        comma-joined (the labels of vLLM's ``lora_requests_info`` gauge)."""
        def names(requests):
            return ",".join(sorted({r.lora_request.lora_name for r in requests
                                    if r.lora_request is not None}))
        return self.max_loras, names(running), names(waiting)

    def forget(self, lora_int_id: int, running) -> None:
        """An adapter was removed: its slot is free again unless a running request still
        uses it (those finish with it; the slot is reused once they are gone)."""
        if lora_int_id not in self.adapter_ids(running):
            self._slots.pop(lora_int_id, None)

    def take_step(self) -> tuple[list[tuple[int, LoRAAdapter]], dict[int, int]]:
        """The slot writes queued since the last step, and the id -> slot map of now."""
        loads, self._loads = self._loads, []
        return loads, dict(self._slots)
