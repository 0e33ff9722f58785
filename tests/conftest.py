"""Shared fixtures: emulators whose defects are deterministic, for the tests that assert that plain clients fail
or that a mechanism of the guard fired.

A control must not pass or fail by chance: on these servers every request written to a stream's kept-alive
connection is lost (``stream_close="on_reuse"``), and a burst of new connections stalls by position, not by how
fast threads wake (``stall_burst``). The server counts both (``requests_dropped_after_stream``,
``connections_stalled``), so a test can compare what its clients saw with what the server did, exactly.
"""

from __future__ import annotations

import ast
import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from llama_guard.testing import LlamaServerEmulator, reset_probe_learning

#: The burst of the stalling server: of the first 16 connections of a burst, 4 are served and 12 stall.
BURST_THREADS = 4
BURST_SIZE = 16


@pytest.fixture(autouse=True)
def fresh_probe_learning() -> Iterator[None]:
    """Every test starts with nothing learnt about probing any origin, and leaves nothing behind: the learnt probe
    deadlines and admission are process-wide, and an emulator may get the port of an earlier test's."""
    reset_probe_learning()
    yield
    reset_probe_learning()


@pytest.fixture
def racy_server() -> Iterator[LlamaServerEmulator]:
    """Streams' connections are given up after the final chunk without a FIN: a pooled client reuses them, and
    the request it writes there is dropped unanswered -- every time. Enough threads that no burst stalls."""
    with LlamaServerEmulator(stream_close="on_reuse", http_threads=16, pool_bug=False) as server:
        yield server


@pytest.fixture
def stalling_server() -> Iterator[LlamaServerEmulator]:
    """The pool stall, deterministic: connections 5 to 16 of a burst leave their first request unread until a
    served connection closes (or ``release_stalled()``); later connections, a client's reconnects, are served."""
    with LlamaServerEmulator(http_threads=BURST_THREADS, stall_burst=BURST_SIZE) as server:
        yield server


# -- the version matrix: packages the `test` extra does not install everywhere ---------------------------------

#: Packages that only some environments have: httpx2 (and all built on it) needs Python 3.11+, and the frameworks,
#: SDKs and lm-evaluation-harness come with the `dev` extra only.
OPTIONAL_PACKAGES = frozenset(
    {
        "httpx2",
        "httpcore2",
        "openai",
        "pydantic_ai",
        "litellm",
        "haystack",
        "langchain_openai",
        "huggingface_hub",
        "lm_eval",
    }
)
#: scripts/version_matrix.py sets it: there a test module that imports a missing optional package is not collected,
#: and the report header names each such module. Anywhere else a missing package fails the run, as it should.
PARTIAL_DEPS = os.environ.get("LLAMA_GUARD_PARTIAL_DEPS") == "1"
_NOT_COLLECTED: dict[str, str] = {}


def _admit(releases: str) -> None:
    """Add each ``NAME==VERSION`` of ``releases`` to its version gate's ``TESTED_VERSIONS`` for this run, so that the
    tests run the guard's hooks on it rather than the public path: ``scripts/version_matrix.py --try`` sets
    ``LLAMA_GUARD_ADMIT``. requests and urllib3 have no table (their gate is urllib3's major version)."""
    for pin in releases.split():
        name, _, version = pin.partition("==")
        if name in ("httpx", "httpcore"):
            from llama_guard._httpx import internals

            internals.TESTED_VERSIONS[name] = internals.TESTED_VERSIONS[name] | {version}
        elif name in ("httpx2", "httpcore2"):
            from llama_guard._httpx2 import internals as internals2

            internals2.TESTED_VERSIONS[name] = internals2.TESTED_VERSIONS[name] | {version}
        elif name == "aiohttp":
            import llama_guard.aiohttp
            from llama_guard._aiohttp import internals as aiohttp_internals

            admitted = aiohttp_internals.TESTED_VERSIONS | {version}
            aiohttp_internals.TESTED_VERSIONS = llama_guard.aiohttp.TESTED_VERSIONS = admitted


_admit(os.environ.get("LLAMA_GUARD_ADMIT", ""))


def _missing_imports(path: Path, seen: frozenset[Path] = frozenset()) -> list[str]:
    """The optional packages ``path`` imports at module level (following this suite's own relative imports) that
    are not installed."""
    missing: list[str] = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.ImportFrom) and node.level and node.module:
            local = path.parents[node.level - 1] / (node.module.replace(".", "/") + ".py")
            if local.is_file() and local not in seen:
                missing += _missing_imports(local, seen | {path})
            continue
        else:
            continue
        for name in names:
            top = name.split(".")[0]
            if top in OPTIONAL_PACKAGES and importlib.util.find_spec(top) is None:
                missing.append(top)
    return missing


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if not PARTIAL_DEPS or collection_path.suffix != ".py" or not collection_path.name.startswith(("test_", "_")):
        return None
    missing = _missing_imports(collection_path)
    if not missing:
        return None
    _NOT_COLLECTED[str(collection_path.relative_to(config.rootpath))] = ", ".join(sorted(set(missing)))
    return True


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    for module, missing in sorted(_NOT_COLLECTED.items()):
        terminalreporter.write_line(f"not collected (LLAMA_GUARD_PARTIAL_DEPS, {missing} not installed): {module}")
