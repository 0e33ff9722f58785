"""The RealLlamaServer harness and what the real server offers for counting requests.

The guard's tests must prove that no request ran twice; these tests pin down
the two server-side counts available in b11434 (there is no request counter):

* ``/metrics`` (``--metrics``): ``llamacpp:tokens_predicted_total`` grows by
  exactly ``max_tokens`` per completion that asks for ``"ignore_eos": true``
  (streamed or not), so it divided by ``max_tokens`` is the number of
  completions run.
* the log (default verbosity): one ``launch_slot_: ... processing task`` and one
  ``release: ... stop processing`` line per completion. HTTP requests themselves
  are not logged (cpp-httplib's request logger is disabled in b11434).
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

import httpx
import pytest

from llama_guard.testing._real_server import RealLlamaServer

from ._raw_http import CHAT, chat_body

pytestmark = pytest.mark.real_server

MAX_TOKENS = 16


def wait_for(condition, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
    return True


def test_starts_healthy_and_stops_cleanly(real_server):
    server = real_server()
    assert server.running
    assert server.startup_seconds is not None
    assert 0 < server.startup_seconds <= server.startup_timeout
    status, headers, body = server.get("/health")
    assert (status, body) == (200, b'{"status":"ok"}')
    assert ("Server", "llama.cpp") in headers
    pid = server.pid
    assert server.stop() == 0  # SIGTERM: a clean shutdown
    assert not server.running
    assert server.pid is None
    assert pid is not None
    assert server.stop() is None  # idempotent


def test_context_manager_and_flags(llama_server_bin, tiny_model, tmp_path):
    log = tmp_path / "server.log"
    server = RealLlamaServer(
        tiny_model, binary=llama_server_bin, parallel=2, threads_http=3, ctx_size=1024, log_path=log
    )
    with server:
        assert server.url == f"http://127.0.0.1:{server.port}"
        props = httpx.get(server.url + "/props", timeout=10).json()
        assert props["total_slots"] == 2
    assert not server.running
    text = log.read_text()
    assert "--threads-http 3" in text.splitlines()[0]  # the command line heads the log
    assert "n_slots = 2" in text


def test_startup_failure_is_reported_with_the_log(llama_server_bin, tmp_path):
    bad = tmp_path / "not-a-model.gguf"
    bad.write_bytes(b"not a gguf file")
    server = RealLlamaServer(bad, binary=llama_server_bin, startup_timeout=30)
    with pytest.raises(RuntimeError, match="llama-server exited"):
        server.start()
    assert not server.running
    server.cleanup_log()


def test_metrics_and_log_count_each_completion_once(real_server):
    server = real_server(metrics=True)
    assert server.metrics()["tokens_predicted_total"] == 0
    with httpx.Client(base_url=server.url, timeout=30) as client:
        for _ in range(3):
            resp = client.post(CHAT, json=chat_body(stream=False, max_tokens=MAX_TOKENS))
            assert resp.json()["usage"]["completion_tokens"] == MAX_TOKENS
        # Not kept after a stream: the server closes a streamed response's connection (the defect the guard fixes),
        # and this plain client would lose the next request on it when it reuses it before the close arrives.
        for _ in range(2):
            with client.stream(
                "POST", CHAT, json=chat_body(stream=True, max_tokens=MAX_TOKENS), headers={"Connection": "close"}
            ) as resp:
                resp.read()
        client.get("/health")
    metrics = server.metrics()
    assert metrics["tokens_predicted_total"] == 5 * MAX_TOKENS, metrics
    assert metrics["requests_processing"] == 0
    assert wait_for(lambda: server.log_text().count("stop processing") == 5, timeout=30), server.log_tail()
    log = server.log_text()
    assert log.count("processing task") == 5
    assert "/health" not in log  # requests themselves are not logged


def running(pid: int) -> bool:
    """Whether process ``pid`` exists and has not exited (a zombie waiting to be reaped has)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


STARTER = """\
import sys, time
from pathlib import Path
from llama_guard.testing._real_server import RealLlamaServer
server = RealLlamaServer(Path(sys.argv[1]), binary=Path(sys.argv[2]), log_path=Path(sys.argv[3])).start()
print(server.pid, flush=True)
time.sleep(120)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_server_does_not_outlive_a_killed_test_process(llama_server_bin, tiny_model, tmp_path):
    """A test process killed without cleanup (SIGKILL: no fixture, no finally runs) leaves no llama-server behind:
    the watchdog started beside the server kills it."""
    args = [str(tiny_model), str(llama_server_bin), str(tmp_path / "server.log")]
    pid = None
    with subprocess.Popen([sys.executable, "-c", STARTER, *args], stdout=subprocess.PIPE) as starter:
        try:
            assert starter.stdout is not None
            ready, _, _ = select.select([starter.stdout], [], [], 120)
            assert ready, "the starter printed no server pid within 120 s"
            pid = int(starter.stdout.readline())
            assert running(pid)
            starter.kill()
            starter.wait()
            assert wait_for(lambda: not running(pid), timeout=10), "llama-server outlived the process that started it"
        finally:
            starter.kill()
            if pid is not None and running(pid):  # the test failed: do not leave it behind either
                os.kill(pid, signal.SIGKILL)
