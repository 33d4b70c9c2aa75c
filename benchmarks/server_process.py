"""A benchmarked server as a subprocess: start-up time to ``/health`` 200 and peak RSS.

:class:`ServerProcess` starts a server command (``jaxpaged serve`` or llama.cpp's
``llama-server``: both take ``--port``) on 127.0.0.1, times it from spawn to the first
``GET /health`` that answers 200, samples the resident memory of its process tree from
``/proc`` meanwhile (:class:`RssSampler`) and stops it by its PID (SIGTERM, then SIGKILL).
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
import urllib.error
import urllib.request

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def child_pids(pid: int) -> list[int]:
    """The PIDs of every live descendant of ``pid`` (children, theirs, ...), read from the
    parent field of each ``/proc/<pid>/stat``; [] where ``/proc`` cannot be read."""
    parents: dict[int, list[int]] = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return []
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue                       # exited meanwhile
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses
        ppid = int(stat[stat.rindex(b")") + 2:].split()[1])
        parents.setdefault(ppid, []).append(int(name))
    out, todo = [], [pid]
    while todo:
        kids = parents.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def rss_bytes(pid: int) -> int:
    """Resident set size of one process in bytes (``/proc/<pid>/statm``); 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return 0


class RssSampler:
    """Samples the RSS of process ``pid`` and its descendants every ``interval_s`` seconds in
    a daemon thread and keeps the largest sum (``peak_bytes``). The descendants are looked up
    again every ``rescan_every`` samples. Pages shared between processes of the tree count in
    each (RSS's own rule). A context manager; :meth:`stop` takes a last sample.

    Args:
        pid: the root process (e.g. a server's ``Popen.pid``).
        interval_s: seconds between samples.
        rescan_every: samples between two descendant lookups (a scan of ``/proc``).
    """

    def __init__(self, pid: int, interval_s: float = 0.1, rescan_every: int = 10):
        self.pid, self.interval_s, self.rescan_every = pid, interval_s, rescan_every
        self.peak_bytes = 0
        self.num_samples = 0
        self.num_processes_seen = 1
        self._tree = [pid]
        self._seen = {pid}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def peak_mb(self) -> float:
        """``peak_bytes`` in MB (10**6 bytes)."""
        return self.peak_bytes / 1e6

    def sample(self) -> int:
        """Take one sample now; returns the tree's RSS in bytes (and updates the peak)."""
        if self.num_samples % self.rescan_every == 0:
            self._tree = [self.pid] + child_pids(self.pid)
            self._seen.update(self._tree)
            self.num_processes_seen = len(self._seen)
        total = sum(rss_bytes(p) for p in self._tree)
        self.num_samples += 1
        self.peak_bytes = max(self.peak_bytes, total)
        return total

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval_s)

    def start(self) -> RssSampler:
        """Start sampling in the background; returns ``self``."""
        self._thread = threading.Thread(target=self._loop, name=f"rss-{self.pid}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the background sampling after one last sample."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
            self.sample()

    def __enter__(self) -> RssSampler:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class ServerProcess:
    """A server subprocess on 127.0.0.1 (a context manager that stops it by PID).

    Args:
        command: the command line; its ``--port`` value is where requests go.
        log_path: the server's stdout and stderr.
        health_timeout_s: how long the server may take to answer ``/health`` 200.
        stop_timeout_s: how long SIGTERM may take before SIGKILL.
        env: the server's environment (default: this process's).
        rss_interval_s: sample the process tree's RSS every so many seconds from spawn to
            stop (:attr:`rss`, a :class:`RssSampler`); None: no sampling.
        name: how errors name the server (default: the command's file name).

    Attributes:
        startup_time: seconds from spawn to the first ``/health`` 200 (set on entry).
    Raises (on entry):
        RuntimeError: the server exited, or ``/health`` was not 200 within the timeout.
    """

    def __init__(self, command: list[str], log_path: str, health_timeout_s: float = 600.0,
                 stop_timeout_s: float = 10.0, env: dict[str, str] | None = None,
                 rss_interval_s: float | None = None, name: str | None = None):
        self.command, self.log_path, self.env = command, log_path, env
        self.url = f"http://127.0.0.1:{command[command.index('--port') + 1]}"
        self.health_timeout_s, self.stop_timeout_s = health_timeout_s, stop_timeout_s
        self.rss_interval_s = rss_interval_s
        self.name = name or os.path.basename(command[0])
        self.proc: subprocess.Popen | None = None
        self.rss: RssSampler | None = None
        self.startup_time: float | None = None

    def __enter__(self):
        os.makedirs(os.path.dirname(os.path.abspath(self.log_path)), exist_ok=True)
        with open(self.log_path, "wb") as log:
            t0 = time.perf_counter()
            self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=self.env)
        try:
            if self.rss_interval_s is not None:
                self.rss = RssSampler(self.proc.pid, self.rss_interval_s).start()
            self._wait_healthy()
            self.startup_time = time.perf_counter() - t0
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.health_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; "
                                   f"log: {self.log_path}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass                  # not listening yet, or 503 while the model loads
            time.sleep(0.1)
        raise RuntimeError(f"{self.name} not healthy after {self.health_timeout_s} s; "
                           f"log: {self.log_path}")

    def stop(self) -> None:
        """Stop the RSS sampling (after a last sample), then SIGTERM the server's PID,
        SIGKILL it after ``stop_timeout_s``, and reap it."""
        if self.rss is not None:
            self.rss.stop()
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(self.stop_timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
