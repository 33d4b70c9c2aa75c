"""Helpers for tests that start ``jaxpaged`` in subprocesses."""

import socket
import time

import httpx


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_health(url: str, status: int, procs, timeout: float, poll: float = 0.5) -> None:
    """Poll ``url``/health until it answers ``status``; fail if ``timeout`` seconds pass or
    any of ``procs`` exits first."""
    deadline = time.monotonic() + timeout
    while True:
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
        try:
            if httpx.get(url + "/health", timeout=5).status_code == status:
                return
        except httpx.TransportError:
            pass
        time.sleep(poll)


def wait_for_text(path, text: str, procs, timeout: float, poll: float = 0.1) -> None:
    """Poll the file at ``path`` (a subprocess's redirected output) until it contains
    ``text``; fail if ``timeout`` seconds pass or any of ``procs`` exits first."""
    deadline = time.monotonic() + timeout
    while text not in path.read_text():
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
        time.sleep(poll)
