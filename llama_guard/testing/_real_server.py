"""Run a real llama.cpp ``llama-server`` as a subprocess, for integration tests.

Why: the emulator (:class:`LlamaServerEmulator`) reproduces llama-server's HTTP
defects from measurements; the tests marked ``real_server`` check against the
real thing (build b11434, built by ``scripts/get_llama_server.py``) that those
defects are still there and that the guard copes with them. Each test gets a
fresh server, because defect 2 (cpp-httplib's thread-pool idle counter) depends
on the pool's history: a server that has already served a burst is not fresh.

Example::

    from llama_guard.testing import RealLlamaServer, find_llama_server, write_tiny_model

    model = write_tiny_model(tmp_path / "tiny.gguf")
    with RealLlamaServer(model, binary=find_llama_server(), threads_http=4, metrics=True) as server:
        httpx.get(server.url + "/health")

The readiness probe and :meth:`RealLlamaServer.get` send ``Connection: close``
and close their sockets: an idle keep-alive connection would hold one of the
few HTTP threads (a thread owns a connection for its whole keep-alive life) and
change what a test measures.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import IO

from ._cpu_load import pin_process
from ._lifecycle import StartStop, end_process, spawn_watcher

__all__ = [
    "LLAMA_SERVER_BUILD",
    "LLAMA_SERVER_FIXED_BUILD_INFO",
    "RealLlamaServer",
    "RealServerError",
    "find_llama_server",
    "free_port",
    "llama_server_cache_dir",
    "llama_server_env_var",
]

#: The llama.cpp build the tests are written against (its cpp-httplib is 0.59.0).
LLAMA_SERVER_BUILD = "b11434"
#: What ``/props`` says for the same build with cpp-httplib's thread-pool fix applied
#: (``scripts/get_llama_server.py --fixed-pool``); doctor reads it as a fixed pool.
LLAMA_SERVER_FIXED_BUILD_INFO = f"{LLAMA_SERVER_BUILD}-fixedpool"


def llama_server_cache_dir(*, fixed_pool: bool = False) -> Path:
    """The folder ``scripts/get_llama_server.py`` builds into (keep the two in sync).

    ``${LLAMA_GUARD_CACHE:-~/.cache/llama_guard}/llama-server-b11434`` (``-fixedpool``
    appended for the build with the thread-pool fix): outside the work tree, so a
    clean checkout or ``git clean`` never costs a rebuild.
    """
    base = os.environ.get("LLAMA_GUARD_CACHE") or str(Path.home() / ".cache" / "llama_guard")
    name = LLAMA_SERVER_FIXED_BUILD_INFO if fixed_pool else LLAMA_SERVER_BUILD
    return Path(base).expanduser() / f"llama-server-{name}"


def llama_server_env_var(*, fixed_pool: bool = False) -> str:
    """The environment variable that names a binary to use instead of the cache."""
    return "LLAMA_SERVER_FIXED_BIN" if fixed_pool else "LLAMA_SERVER_BIN"


def _executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def find_llama_server(*, fixed_pool: bool = False) -> Path | None:
    """The llama-server binary to test against, or None when there is none.

    ``LLAMA_SERVER_BIN`` if it names an executable file, else the binary that
    ``scripts/get_llama_server.py`` left in the cache. With ``fixed_pool``: the
    same build with cpp-httplib's thread-pool fix (``LLAMA_SERVER_FIXED_BIN``,
    or what ``get_llama_server.py --fixed-pool`` cached). It does not build
    anything (that takes minutes; run the script for it) and does not run the
    binary.
    """
    env_bin = os.environ.get(llama_server_env_var(fixed_pool=fixed_pool))
    if env_bin:
        path = Path(env_bin).expanduser()
        return path.resolve() if _executable(path) else None
    cached = llama_server_cache_dir(fixed_pool=fixed_pool) / "bin" / "llama-server"
    return cached if _executable(cached) else None


class RealServerError(RuntimeError):
    """The server could not be started (it exited, or never became healthy); the message
    ends with the tail of its log."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the server may still lose a race for it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def _http_get(host: str, port: int, path: str, timeout: float) -> tuple[int, list[tuple[str, str]], bytes]:
    """One GET on its own connection, closed afterwards (see the module docstring)."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("GET", path, headers={"Connection": "close"})
        resp = conn.getresponse()
        body = resp.read()
        return resp.status, resp.getheaders(), body
    finally:
        conn.close()


# A server outlives a test process killed without cleanup (SIGKILL, a crash, a CI job's timeout), and a stray
# llama-server keeps a core busy for every later test. So a watchdog process beside each server (as the CPU hogs
# of _cpu_load.py do) watches the process that started the server, and kills the server once that process is gone;
# it exits on its own when the server does. `RealLlamaServer.stop` kills it before reaping the server, so it never
# holds a pid that could be reused.
_WATCHDOG = """\
import os, signal, sys, time
parent, server = int(sys.argv[1]), int(sys.argv[2])
while os.getppid() == parent:
    time.sleep(0.2)
    try:
        os.kill(server, 0)
    except ProcessLookupError:
        sys.exit(0)
try:
    os.kill(server, signal.SIGKILL)
except ProcessLookupError:
    pass
"""


class RealLlamaServer(StartStop):
    """A fresh ``llama-server`` subprocess on a free 127.0.0.1 port.

    ``start()`` (or ``with``) launches it and waits, at most
    ``startup_timeout`` seconds, for ``GET /health`` to answer 200 (it answers
    503 while the model loads). ``stop()`` sends SIGTERM, then SIGKILL after
    ``stop_timeout`` seconds, and always reaps the process, so no zombie and no
    ``ResourceWarning`` is left behind. Everything the server prints goes to
    :attr:`log_path` (a temporary file unless given), readable with
    :meth:`log_text`.

    Flags: ``parallel`` (``--parallel``, number of slots), ``threads_http``
    (``--threads-http``, cpp-httplib's pool size), ``ctx_size`` (``-c``, shared
    by the slots), ``metrics`` (``--metrics``, Prometheus text at
    ``/metrics``), ``threads`` (``--threads``, compute threads; 1 is plenty for
    the tiny model and leaves the CPU to the test), ``extra_args`` appended
    verbatim. ``cpus``: pin every thread of the server to these CPUs (e.g. one
    core that a :class:`~llama_guard.testing._cpu_load.CpuHogs` shares);
    ``batch_scheduling``: and run them as ``SCHED_BATCH`` (see
    :func:`~llama_guard.testing._cpu_load.pin_process`).
    """

    def __init__(
        self,
        model: str | os.PathLike[str],
        *,
        binary: str | os.PathLike[str] | None = None,
        parallel: int | None = None,
        threads_http: int | None = None,
        ctx_size: int | None = None,
        metrics: bool = False,
        threads: int | None = 1,
        extra_args: Sequence[str] = (),
        cpus: Iterable[int] | None = None,
        batch_scheduling: bool = False,
        host: str = "127.0.0.1",
        port: int | None = None,
        log_path: str | os.PathLike[str] | None = None,
        startup_timeout: float = 60.0,
        stop_timeout: float = 10.0,
    ) -> None:
        found = Path(binary) if binary is not None else find_llama_server()
        if found is None:
            raise RealServerError(
                "no llama-server binary: set LLAMA_SERVER_BIN or run "
                "'python scripts/get_llama_server.py' (builds b11434 into the cache)"
            )
        self.binary: Path = found
        self.model = Path(model)
        self.host = host
        self.port: int = port if port is not None else 0
        self._fixed_port = port is not None
        self.parallel = parallel
        self.threads_http = threads_http
        self.ctx_size = ctx_size
        self.metrics_enabled = metrics
        self.threads = threads
        self.extra_args = tuple(extra_args)
        self.cpus: frozenset[int] | None = None if cpus is None else frozenset(cpus)
        if batch_scheduling and self.cpus is None:
            raise ValueError("batch_scheduling needs cpus (the CPUs whose other work the server must not preempt)")
        self.batch_scheduling = batch_scheduling
        self.startup_timeout = startup_timeout
        self.stop_timeout = stop_timeout
        self._own_log = log_path is None
        self.log_path: Path = Path(log_path) if log_path is not None else Path(self._make_temp_log())
        self._proc: subprocess.Popen[bytes] | None = None
        self._watchdog: subprocess.Popen[bytes] | None = None
        self._log_file: IO[bytes] | None = None
        self._log_offset = 0
        self._started_at = 0.0
        #: Seconds from launch to the first ``/health`` 200, set by :meth:`start`.
        self.startup_seconds: float | None = None

    @staticmethod
    def _make_temp_log() -> str:
        fd, name = tempfile.mkstemp(prefix="llama-server-", suffix=".log")
        os.close(fd)
        return name

    # -- lifecycle ---------------------------------------------------------------

    def args(self) -> list[str]:
        """The command line (with the current port)."""
        cmd = [str(self.binary), "-m", str(self.model), "--host", self.host, "--port", str(self.port)]
        if self.parallel is not None:
            cmd += ["--parallel", str(self.parallel)]
        if self.threads_http is not None:
            cmd += ["--threads-http", str(self.threads_http)]
        if self.ctx_size is not None:
            cmd += ["-c", str(self.ctx_size)]
        if self.metrics_enabled:
            cmd.append("--metrics")
        if self.threads is not None:
            cmd += ["--threads", str(self.threads)]
        cmd += self.extra_args
        return cmd

    def start(self) -> RealLlamaServer:
        """Launch the server and wait until it is healthy; retry on a lost port race."""
        if self._proc is not None:
            raise RuntimeError("server already started")
        attempts = 1 if self._fixed_port else 3
        for attempt in range(attempts):
            if not self._fixed_port:
                self.port = free_port(self.host)
            self._launch()
            try:
                self._pin()
                self._wait_healthy()
                self._pin()  # again: threads started while the first pass ran
                return self
            except RealServerError:
                exited = self._proc is not None and self._proc.poll() is not None
                self.stop()
                log = self.log_path.read_bytes()[self._log_offset :].decode("utf-8", "replace").lower()
                port_lost = "couldn't bind" in log or "address already in use" in log
                if attempt + 1 < attempts and exited and port_lost:
                    continue
                raise
            except BaseException:  # e.g. KeyboardInterrupt: never leave the process behind
                self.stop()
                raise
        raise AssertionError("unreachable")  # pragma: no cover

    def _watch_for_orphaning(self) -> None:
        """Start the watchdog that kills the server if this process dies without stopping it (`_WATCHDOG`)."""
        assert self._proc is not None
        # A session of its own: a Ctrl-C in the terminal must not end it before the server is stopped.
        self._watchdog = spawn_watcher(_WATCHDOG, str(self._proc.pid), new_session=True)

    def _launch(self) -> None:
        self._log_file = self.log_path.open("ab")
        self._log_offset = self._log_file.tell()
        self._log_file.write(f"$ {' '.join(self.args())}\n".encode())
        self._log_file.flush()
        self._started_at = time.monotonic()
        # LLAMA_ARG_* variables set defaults for every llama-server flag; a test
        # must get exactly the flags it asked for, whatever the environment says.
        env = {k: v for k, v in os.environ.items() if not k.startswith("LLAMA_ARG_")}
        self._proc = subprocess.Popen(
            self.args(),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            # Its own session: a Ctrl-C in the terminal reaches pytest only, and
            # pytest's fixtures stop the server in order.
            start_new_session=True,
        )
        self._watch_for_orphaning()

    def _pin(self) -> None:
        if self.cpus is not None and self._proc is not None and self._proc.poll() is None:
            pin_process(self._proc.pid, self.cpus, batch=self.batch_scheduling)

    def _wait_healthy(self) -> None:
        assert self._proc is not None
        deadline = self._started_at + self.startup_timeout
        last = "no answer yet"
        while True:
            code = self._proc.poll()
            if code is not None:
                raise RealServerError(f"llama-server exited with {code} during startup; log tail:\n{self.log_tail()}")
            try:
                status, _, _ = _http_get(self.host, self.port, "/health", timeout=2.0)
            except OSError as exc:
                last = f"{type(exc).__name__}: {exc}"
            else:
                if status == 200:
                    self.startup_seconds = time.monotonic() - self._started_at
                    return
                last = f"HTTP {status}"
            if time.monotonic() >= deadline:
                raise RealServerError(
                    f"llama-server not healthy after {self.startup_timeout:.0f} s ({last}); "
                    f"log tail:\n{self.log_tail()}"
                )
            time.sleep(0.05)

    def stop(self) -> int | None:
        """Stop the server (SIGTERM, then SIGKILL) and reap it; return its exit code.

        Idempotent; bounded by about ``2 * stop_timeout`` seconds.
        """
        proc, self._proc = self._proc, None
        watchdog, self._watchdog = self._watchdog, None
        if watchdog is not None:  # first, so that it never outlives the server it names
            end_process(watchdog, ask=subprocess.Popen.kill, grace=None)
        code: int | None = None
        if proc is not None:
            code = end_process(proc, grace=self.stop_timeout, reap_timeout=self.stop_timeout)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        return code

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"<RealLlamaServer {self.url} {state} pid={self.pid}>"

    # -- access ------------------------------------------------------------------

    @property
    def url(self) -> str:
        """``http://127.0.0.1:PORT`` (no trailing slash)."""
        return f"http://{self.host}:{self.port}"

    @property
    def address(self) -> tuple[str, int]:
        """``(host, port)`` for raw sockets."""
        return (self.host, self.port)

    def get(self, path: str, timeout: float = 10.0) -> tuple[int, list[tuple[str, str]], bytes]:
        """``GET path`` on a connection of its own, closed afterwards: (status, headers, body)."""
        return _http_get(self.host, self.port, path, timeout)

    def metrics(self, timeout: float = 10.0) -> dict[str, float]:
        """The Prometheus counters and gauges of ``/metrics`` (needs ``metrics=True``).

        Keys without the ``llamacpp:`` prefix, e.g. ``tokens_predicted_total``:
        with every completion asking for ``max_tokens=N`` and
        ``"ignore_eos": true``, ``tokens_predicted_total / N`` is the number of
        completions the server actually ran (there is no request counter).
        """
        status, _, body = self.get("/metrics", timeout)
        if status != 200:
            raise RealServerError(f"/metrics answered {status} (start the server with metrics=True)")
        values: dict[str, float] = {}
        for line in body.decode("utf-8", "replace").splitlines():
            if not line or line.startswith("#"):
                continue
            name, _, value = line.rpartition(" ")
            if "{" in name:  # labelled series, e.g. per-position speculative counters
                continue
            with contextlib.suppress(ValueError):
                values[name.removeprefix("llamacpp:")] = float(value)
        return values

    def log_text(self) -> str:
        """Everything the server has printed so far (for asserting on its log)."""
        try:
            return self.log_path.read_text("utf-8", errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def cleanup_log(self) -> None:
        """Delete the log file if this object created it (after :meth:`stop`)."""
        if self._own_log and self._proc is None:
            with contextlib.suppress(FileNotFoundError):
                self.log_path.unlink()
