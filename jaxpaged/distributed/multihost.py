"""Several processes (hosts), one engine: multi-controller JAX via ``jax.distributed``.

Every process runs the same program. Each calls :func:`initialize` before anything starts
JAX, then builds the same engine over one global mesh made of every process's devices, and
runs the same jitted step on its own devices; XLA's collectives (NCCL on GPUs, Gloo on CPUs)
carry the all-reduces between processes. The host side is **deterministic everywhere**:
every process is given the same requests in the same order (for ``LLM.generate`` and
``jaxpaged generate``, the same prompts on every process), so every scheduler makes the same
decisions and no scheduling state is sent between processes. Only process 0 reports
results (:func:`is_leader`).
"""

from __future__ import annotations

import jax
import numpy as np
from jax._src import distributed

#: Seconds every process waits for the others at start-up.
INITIALIZATION_TIMEOUT_S = 120


class MultiHostError(ValueError):
    """Inconsistent ``--coordinator-address`` / ``--num-processes`` / ``--process-id``."""


def initialize(coordinator_address: str | None, num_processes: int, process_id: int | None
               ) -> None:
    """Join the ``num_processes`` processes (no-op for one process or when this process has
    already joined).

    Args:
        coordinator_address: ``host:port`` of process 0's coordinator service.
        num_processes: processes in the job.
        process_id: this process's index in ``[0, num_processes)``.

    Raises:
        MultiHostError: a missing address or id, or an id out of range.
    """
    if num_processes == 1 or distributed.global_state.client is not None:
        return
    if not coordinator_address:
        raise MultiHostError("--num-processes > 1 needs --coordinator-address HOST:PORT")
    if process_id is None or not 0 <= process_id < num_processes:
        raise MultiHostError(f"--process-id must be in [0, {num_processes}), got {process_id!r}")
    jax.distributed.initialize(coordinator_address=coordinator_address,
                               num_processes=num_processes, process_id=process_id,
                               initialization_timeout=INITIALIZATION_TIMEOUT_S)


def is_leader() -> bool:
    """True in process 0 (the one that prints, serves and returns outputs)."""
    return jax.process_index() == 0


def to_host(x: jax.Array) -> np.ndarray:
    """A replicated array's value as numpy, also when it spans other processes' devices."""
    return np.asarray(x if x.is_fully_addressable else x.addressable_data(0))
