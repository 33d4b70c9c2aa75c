"""Several processes (hosts), one engine: multi-controller JAX via ``jax.distributed``.

Every process runs the same program. Each calls :func:`initialize` before anything starts
JAX, then builds the same engine over one global mesh made of every process's devices, and
runs the same jitted step on its own devices; XLA's collectives (NCCL on GPUs, Gloo on CPUs)
carry the all-reduces between processes. The host side is **deterministic everywhere**:
every process is given the same requests in the same order, so every scheduler makes the same
decisions and no scheduling state is sent between processes. :func:`check_same_everywhere`
refuses a job whose processes were given different settings or prompts. Between steps the
processes exchange stop requests and, for ``jaxpaged serve``, process 0's engine commands
(``jaxpaged.distributed.step_sync``). Only process 0 reports results (:func:`is_leader`).

Failures are made short and legible, because JAX's own reactions are slow and native: a
process that cannot join within :func:`join_timeout_s` seconds says so in one line (JAX
would abort with a C++ trace), a process whose peer died leaves at once (:func:`abandon`)
instead of waiting at JAX's shutdown barrier, and JAX's preemption service is turned off so
that SIGTERM reaches Python.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import signal
import socket
import sys
import threading
import time

import jax
import numpy as np
from jax._src import distributed

logger = logging.getLogger(__name__)

#: Seconds every process waits for the others to join (and at a consistency check), unless
#: the environment variable :data:`TIMEOUT_ENV` sets another number.
INITIALIZATION_TIMEOUT_S = 60
TIMEOUT_ENV = "JAXPAGED_MULTIHOST_TIMEOUT_S"
#: Seconds without heartbeats after which JAX declares a process dead.
HEARTBEAT_TIMEOUT_S = 30
#: Seconds a finishing process waits for the others at JAX's shutdown barrier.
SHUTDOWN_TIMEOUT_S = 30

_checks = 0     # consistency checks made so far (each gets its own keys)
_formed = False     # this process has joined a multi-process job


class MultiHostError(ValueError):
    """Inconsistent ``--coordinator-address`` / ``--num-processes`` / ``--process-id``, or
    processes of one job given different settings or prompts."""


class JobFailed(RuntimeError):
    """A step of a multi-host job failed (typically a collective, because a process died or
    lost its connection); the job cannot go on. Leave with :func:`leave_failed_job`."""


def parse_coordinator_address(address: str) -> tuple[str, int]:
    """``(host, port)`` of ``HOST:PORT`` (``[v6]:PORT`` for an IPv6 literal).

    Raises:
        MultiHostError: no port, or a port outside 1..65535.
    """
    host, sep, port = address.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise MultiHostError(f"--coordinator-address must be HOST:PORT with a port in "
                             f"1..65535, got {address!r}")
    return host, int(port)


def initialize(coordinator_address: str | None, num_processes: int, process_id: int | None
               ) -> None:
    """Join the ``num_processes`` processes (no-op for one process or when this process has
    already joined).

    Process 0 starts JAX's coordination service on the address's port; every process
    connects to it. A process whose peers have not all joined after :func:`join_timeout_s`
    seconds prints one line naming the likely causes and
    exits with status 1; one that receives SIGINT or SIGTERM meanwhile leaves at once.

    Args:
        coordinator_address: ``host:port`` of process 0's coordinator service.
        num_processes: processes in the job.
        process_id: this process's index in ``[0, num_processes)``.

    Raises:
        MultiHostError: a missing or malformed address, a missing id or one out of range, an
            address or id given to a one-process job, a host that does not resolve, or (on
            process 0) a port already in use; a bad :data:`TIMEOUT_ENV`.
    """
    if num_processes == 1:
        if coordinator_address or process_id not in (None, 0):
            raise MultiHostError("--coordinator-address and --process-id need --num-processes "
                                 "> 1 (the number of processes in the job)")
        return
    if distributed.global_state.client is not None:
        return
    if not coordinator_address:
        raise MultiHostError("--num-processes > 1 needs --coordinator-address HOST:PORT")
    if process_id is None:
        raise MultiHostError(f"--process-id is required with --num-processes {num_processes} "
                             f"(0 .. {num_processes - 1}, 0 on the coordinator's host)")
    if not 0 <= process_id < num_processes:
        raise MultiHostError(f"--process-id must be in [0, {num_processes}), got {process_id!r}")
    host, port = parse_coordinator_address(coordinator_address)
    try:
        socket.getaddrinfo(host, port)
    except socket.gaierror as e:
        raise MultiHostError(f"--coordinator-address host {host!r} does not resolve: "
                             f"{e.strerror}") from None
    if process_id == 0:
        _check_port_free(port)
    timeout = join_timeout_s()
    jax.config.update("jax_enable_preemption_service", False)   # let SIGTERM reach Python
    _join(timeout, coordinator_address, num_processes, process_id)
    global _formed
    _formed = True


def _join(timeout: int, address: str, num_processes: int, process_id: int) -> None:
    """``jax.distributed.initialize`` on a helper thread, so that this thread can give up
    after ``timeout`` seconds with one line (JAX, whose own timeout is set longer, would
    abort in C++) and, in the main thread, leave at once on SIGINT or SIGTERM (a thread
    blocked inside JAX's connect would not see them)."""
    joined, failure = threading.Event(), []

    def connect():
        try:
            jax.distributed.initialize(coordinator_address=address,
                                       num_processes=num_processes, process_id=process_id,
                                       initialization_timeout=timeout + 30,
                                       heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_S,
                                       shutdown_timeout_seconds=SHUTDOWN_TIMEOUT_S)
        except BaseException as e:   # noqa: BLE001 - re-raised in the caller's thread
            failure.append(e)
        finally:
            joined.set()

    main = threading.current_thread() is threading.main_thread()
    # Both signals explicitly: a process started in the background inherits SIGINT ignored.
    previous = {sig: signal.signal(sig, _raise_interrupt)
                for sig in (signal.SIGINT, signal.SIGTERM)} if main else {}
    try:
        threading.Thread(target=connect, daemon=True, name="jaxpaged-join").start()
        logger.info("process %d of %d: waiting up to %d s for the job to form at %s",
                    process_id, num_processes, timeout, address)
        deadline = time.monotonic() + timeout
        # Short waits: a signal delivered to another thread runs its Python handler only
        # when this thread next runs Python code.
        while not joined.wait(0.2) and time.monotonic() < deadline:
            pass
        if not joined.is_set():
            waiting_for = "the other processes" if process_id == 0 else f"process 0 at {address}"
            print(f"jaxpaged: error: process {process_id} of {num_processes} could not form "
                  f"the job within {timeout} s (waiting for {waiting_for}); start every process "
                  "with the same --coordinator-address and --num-processes and its own "
                  f"--process-id in 0..{num_processes - 1}", file=sys.stderr)
            abandon(1)
    except KeyboardInterrupt as e:
        signum = e.args[0] if e.args else signal.SIGINT
        print(f"jaxpaged: process {process_id} received {signal.Signals(signum).name} while "
              "waiting for the other processes; leaving", file=sys.stderr)
        abandon(128 + signum)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if failure:
        raise failure[0]


def job_formed() -> bool:
    """True once this process has joined a multi-process job (every process connected)."""
    return _formed


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(signum)


def _check_port_free(port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError as e:
            raise MultiHostError(f"process 0 cannot listen on --coordinator-address port {port}: "
                                 f"{e.strerror} (is another process of this job also started "
                                 "with --process-id 0, or another program using the port?)"
                                 ) from None


def join_timeout_s() -> int:
    """Seconds to wait for the other processes: :data:`TIMEOUT_ENV` or
    :data:`INITIALIZATION_TIMEOUT_S`.

    Raises:
        MultiHostError: :data:`TIMEOUT_ENV` is not a positive integer.
    """
    text = os.environ.get(TIMEOUT_ENV, str(INITIALIZATION_TIMEOUT_S))
    if not text.isdigit() or int(text) < 1:
        raise MultiHostError(f"{TIMEOUT_ENV} must be a positive number of seconds, got {text!r}")
    return int(text)


def check_same_everywhere(what: str, values: dict[str, object], show_values: bool = True
                          ) -> None:
    """Refuse to go on unless every process of the job passed the same ``values``.

    Process 0 publishes its values in JAX's coordination key-value store; each process
    compares, and all of them raise if any differs. Every process must make the same calls
    in the same order. No-op in a one-process job.

    Args:
        what: what the values are, for the message (``"engine settings"``).
        values: JSON-able values by name (large values may be given as digests:
            :func:`digest`).
        show_values: quote the differing values in the message (off for digests).

    Raises:
        MultiHostError: on every process, naming the first differing value and the processes.
    """
    if jax.process_count() == 1:
        return
    global _checks
    _checks += 1
    client = distributed.global_state.client
    key, me = f"jaxpaged/check/{_checks}", jax.process_index()
    timeout_ms = join_timeout_s() * 1000
    if me == 0:
        client.key_value_set(f"{key}/reference", json.dumps(values, sort_keys=True))
    reference = json.loads(client.blocking_key_value_get(f"{key}/reference", timeout_ms))
    verdict = ""
    for name in sorted(set(values) | set(reference)):
        if values.get(name) != reference.get(name):
            verdict = (f"{name} is {_shown(values.get(name))} on process {me} but "
                       f"{_shown(reference.get(name))} on process 0" if show_values else
                       f"{name} is not the same on process 0 and process {me}")
            break
    client.key_value_set(f"{key}/verdict/{me}", verdict)
    client.wait_at_barrier(key, timeout_ms)
    problems = sorted(v for _, v in client.key_value_dir_get(f"{key}/verdict/") if v)
    if problems:
        raise MultiHostError(f"the processes of the job were given different {what}: "
                             f"{problems[0]} (every process must run the same command, apart "
                             "from --process-id)")


def _shown(value: object) -> str:
    return "unset (the default)" if value is None else repr(value)


def digest(value: object) -> str:
    """A short digest of picklable ``value`` (for :func:`check_same_everywhere`): equal
    values built the same way (lists, dicts, numpy arrays, dataclasses) digest equally in
    every process."""
    return hashlib.sha256(pickle.dumps(value)).hexdigest()[:16]


def leave_failed_job(error: BaseException) -> None:
    """Print ``error``'s first line as the reason the multi-host job failed and leave with
    status 1 (:func:`abandon`): a collective failed because a peer died, and nothing can
    continue."""
    print(f"jaxpaged: error: the multi-host job failed: {first_line(error)}", file=sys.stderr)
    abandon(1)


def first_line(error: BaseException) -> str:
    """The first line of ``error``'s message (XLA's runtime errors run to many lines)."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def abandon(status: int) -> None:
    """Leave the process now with ``status``, without JAX's shutdown barrier (which would
    wait for peers that are gone or stuck) and without finalizing the interpreter."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(status)


def is_leader() -> bool:
    """True in process 0 (the one that prints, serves and returns outputs)."""
    return jax.process_index() == 0


def to_host(x: jax.Array) -> np.ndarray:
    """A replicated array's value as numpy, also when it spans other processes' devices."""
    return np.asarray(x if x.is_fully_addressable else x.addressable_data(0))
