"""Several processes (hosts), one engine: multi-controller JAX via ``jax.distributed``.

Every process runs the same program. Each calls :func:`initialize` before anything starts
JAX, then builds the same engine over one global mesh made of every process's devices, and
runs the same jitted step on its own devices; XLA's collectives (NCCL on GPUs, Gloo on CPUs)
carry the all-reduces between processes. The host side is **deterministic everywhere**:
every process is given the same requests in the same order, so every scheduler makes the same
decisions and no scheduling state is sent between processes. For ``LLM.generate`` and
``jaxpaged generate`` the program passes the same prompts everywhere; for ``jaxpaged serve``
process 0 alone takes HTTP requests and, before each step, sends the step's engine commands
(add, abort, stop) to the other processes (:func:`broadcast_commands`), which apply them in
the same order. Only process 0 reports results (:func:`is_leader`).
"""

from __future__ import annotations

import pickle

import jax
import numpy as np
from jax._src import distributed
from jax.experimental import multihost_utils

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


def broadcast_commands(commands: list | None) -> list:
    """Process 0's ``commands`` (picklable tuples), returned on every process.

    Every process must call this the same number of times, in the same order; other
    processes pass None. The pickled bytes travel through ``broadcast_one_to_all`` (a
    collective over all devices), padded to a power of two so that few sizes compile.
    Pickle is safe here: the bytes come only from process 0 of the same job.
    """
    leader = is_leader()
    payload = pickle.dumps(commands) if leader else b""
    size = int(multihost_utils.broadcast_one_to_all(np.array([len(payload)], np.int32),
                                                    is_source=leader)[0])
    buf = np.zeros(max(256, 1 << (size - 1).bit_length()), np.uint8)
    if leader:
        buf[:size] = np.frombuffer(payload, np.uint8)
    buf = multihost_utils.broadcast_one_to_all(buf, is_source=leader)
    return pickle.loads(np.asarray(buf)[:size].tobytes())
