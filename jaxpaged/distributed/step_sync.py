"""What the processes of a multi-host job tell each other between steps.

Before each step every process calls :func:`sync_step` (the same number of times, in the same
order). It carries two things:

- **stop requests**: SIGINT or SIGTERM to any process (handled by
  :func:`install_signal_handlers`) is seen by every process at the next step, and every
  process raises :class:`JobStopped` there, so Ctrl-C on any host ends the whole job cleanly
  instead of leaving the others blocked in a collective;
- **process 0's commands** (``jaxpaged serve``: requests added and aborted, the final stop),
  which the others apply in the same order so every engine takes the same steps.

Both travel through ``jax.experimental.multihost_utils`` collectives over the job's devices:
an all-gather of one ``[payload bytes, stop signal]`` word per process, then, only when
process 0 has commands, a broadcast of their pickled bytes (padded to a power of two so few
sizes compile). Pickle is safe here: the bytes come only from process 0 of the same job.

While the processes are still starting up (loading, precompiling) there is no step to meet
at: a stop is then posted in JAX's coordination key-value store (:func:`request_job_stop`),
every process cuts its precompile short (:func:`stop_requested_anywhere`), and the job stops
at its first step.
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
import threading

import jax
import numpy as np
from jax._src import distributed
from jax.experimental import multihost_utils

from jaxpaged.distributed.multihost import job_formed

_stop_signal = 0     # the signal this process received (0: none)
_stop_posted = False
_STOP_KEY = "jaxpaged/stop"


class JobStopped(Exception):
    """A process of the job received SIGINT or SIGTERM; every process stops at this step.

    Attributes:
        process: the process that received the signal.
        signum: the signal's number.
    """

    def __init__(self, process: int, signum: int):
        super().__init__(f"process {process} received {signal.Signals(signum).name}; "
                         "the job is stopping")
        self.process = process
        self.signum = signum


def install_signal_handlers() -> None:
    """Make SIGINT and SIGTERM request a job-wide stop (seen at the next :func:`sync_step`);
    a second signal ends this process at once. Only from the main thread (elsewhere, e.g. the
    server's engine thread, the server's own handlers stay in charge)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, _request_stop)
        signal.signal(signal.SIGTERM, _request_stop)


def _request_stop(signum, frame) -> None:
    global _stop_signal
    if _stop_signal:
        os._exit(128 + signum)
    _stop_signal = signum
    sys.stderr.write(f"jaxpaged: process {jax.process_index()} received "
                     f"{signal.Signals(signum).name}; the job stops at its next step (send it "
                     "again to end this process now)\n")


def request_job_stop() -> None:
    """Ask every process of the job to stop (also while they are still starting up)."""
    global _stop_posted
    if job_formed() and not _stop_posted:
        distributed.global_state.client.key_value_set(_STOP_KEY, str(jax.process_index()))
        _stop_posted = True


def stop_requested_anywhere() -> bool:
    """True once this process has received a stop signal or any process has called
    :func:`request_job_stop` (checked while starting up, e.g. between precompiled shapes,
    where no step collective runs yet)."""
    if _stop_signal:
        request_job_stop()
        return True
    if not job_formed():
        return False
    try:
        distributed.global_state.client.key_value_try_get(_STOP_KEY)
    except Exception:   # noqa: BLE001 - NOT_FOUND: nobody asked
        return False
    return True


def sync_step(commands: list | None = None) -> list:
    """Exchange stop requests, and process 0's ``commands``, before a step.

    Args:
        commands: process 0's commands (``jaxpaged.engine.commands``: picklable dataclasses;
            None or empty: nothing to send); ignored on the other processes.

    Returns:
        Process 0's commands, on every process.

    Raises:
        JobStopped: on every process, when any process has received a stop signal.
    """
    leader = jax.process_index() == 0
    payload = pickle.dumps(commands) if leader and commands else b""
    words = np.asarray(multihost_utils.process_allgather(
        np.array([len(payload), _stop_signal], np.int32))).reshape(-1, 2)
    stopping = np.flatnonzero(words[:, 1])
    if stopping.size:
        process = int(stopping[0])
        raise JobStopped(process, int(words[process, 1]))
    size = int(words[0, 0])
    if size == 0:
        return []
    buf = np.zeros(max(256, 1 << (size - 1).bit_length()), np.uint8)
    if leader:
        buf[:size] = np.frombuffer(payload, np.uint8)
    buf = multihost_utils.broadcast_one_to_all(buf, is_source=leader)
    return pickle.loads(np.asarray(buf)[:size].tobytes())
