"""`install()` in fresh interpreters: every import order, and `llama-guard run` (zero-code activation).

Each case runs a short script in a new Python process against the emulator on loopback; the script prints, as
JSON, whether its responses came back through the guard and what the installation counted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from llama_guard.testing import LlamaServerEmulator

# Each test starts fresh interpreters that import httpx (2 to 3 s each): the full suite's, not the fast core's.
pytestmark = pytest.mark.slow

TIMEOUT = 60  # seconds for one child process: it imports httpx/httpx2 and makes a few loopback requests

# {imports} is filled per case; the script then uses `lib` (httpx or httpx2).
SCRIPT = """
import json, sys
url = sys.argv[1]
{imports}
lib = sys.modules[sys.argv[2]]
sync_client = lib.Client(base_url=url)
results = []
for _ in range(3):
    response = sync_client.post("/v1/chat/completions", json={{"messages": [], "stream": True, "max_tokens": 2}})
    results.append("llama_guard" in response.extensions)

async def main():
    async with lib.AsyncClient(base_url=url) as client:
        response = await client.get("/health")
        results.append("llama_guard" in response.extensions)

import asyncio
asyncio.run(main())
import llama_guard._install.patching as installed
current = installed.installation()
print(json.dumps({{"guarded": results, "requests": current.stats.snapshot().requests if current else None}}))
"""

IMPORTS = {
    "library-first": "import {lib}\nimport llama_guard\nllama_guard.install(origins=[url])",
    "llama-guard-first": "import llama_guard\nllama_guard.install(origins=[url])\nimport {lib}",
}


@pytest.fixture(scope="module")
def server() -> Iterator[LlamaServerEmulator]:
    # These tests ask whose hands a response passed through, not whether a request was lost: without the defects
    # an unguarded script's pooled client cannot lose a request after a stream (which it did, now and then).
    with LlamaServerEmulator(http_threads=8, pool_bug=False, close_after_stream=False) as emulator:
        yield emulator


def run_python(code: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=TIMEOUT, env=env, check=False
    )


def outcome(process: subprocess.CompletedProcess[str]) -> dict[str, object]:
    assert process.returncode == 0, process.stderr
    result: dict[str, object] = json.loads(process.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.parametrize("library", ["httpx", "httpx2"])
@pytest.mark.parametrize("order", ["library-first", "llama-guard-first"])
def test_install_works_in_either_import_order(server: LlamaServerEmulator, library: str, order: str) -> None:
    script = SCRIPT.format(imports=IMPORTS[order].format(lib=library))
    assert outcome(run_python(script, server.url, library)) == {"guarded": [True] * 4, "requests": 4}


@pytest.mark.parametrize("library", ["httpx", "httpx2"])
def test_importing_llama_guard_patches_nothing(server: LlamaServerEmulator, library: str) -> None:
    script = SCRIPT.format(imports=f"import llama_guard\nimport {library}")
    assert outcome(run_python(script, server.url, library)) == {"guarded": [False] * 4, "requests": None}


def test_uninstall_before_the_import_leaves_the_library_unpatched(server: LlamaServerEmulator) -> None:
    """The post-import hook stays registered (wrapt cannot remove it) but does nothing once uninstalled."""
    imports = "import llama_guard\nllama_guard.install(origins=[url])\nllama_guard.uninstall()\nimport httpx2"
    script = SCRIPT.format(imports=imports)
    script += "\nassert not hasattr(httpx2.HTTPTransport.handle_request, '__wrapped__')\n"
    assert outcome(run_python(script, server.url, "httpx2")) == {"guarded": [False] * 4, "requests": None}


def llama_guard_run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "llama_guard", "run", *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env=env,
        check=False,
    )


def child_script(library: str) -> str:
    return SCRIPT.format(imports=f"import {library}")


@pytest.mark.parametrize("library", ["httpx", "httpx2"])
def test_run_guards_an_unmodified_program(server: LlamaServerEmulator, library: str) -> None:
    process = llama_guard_run(
        "--origins", server.url, "--", sys.executable, "-c", child_script(library), server.url, library
    )
    assert outcome(process) == {"guarded": [True] * 4, "requests": 4}


def test_run_reads_the_origins_from_the_environment(server: LlamaServerEmulator) -> None:
    env = {**os.environ, "LLAMA_GUARD_ORIGINS": server.url}
    process = llama_guard_run("--", sys.executable, "-c", child_script("httpx"), server.url, "httpx", env=env)
    assert outcome(process) == {"guarded": [True] * 4, "requests": 4}


def test_run_without_origins_learns_llama_servers(server: LlamaServerEmulator) -> None:
    env = {key: value for key, value in os.environ.items() if key != "LLAMA_GUARD_ORIGINS"}
    process = llama_guard_run("--", sys.executable, "-c", child_script("httpx"), server.url, "httpx", env=env)
    # The first response of the process is how it learns that the server is llama.cpp.
    assert outcome(process) == {"guarded": [False, True, True, True], "requests": 3}


def test_run_keeps_the_programs_exit_status_and_its_own_sitecustomize(tmp_path: Path) -> None:
    (tmp_path / "sitecustomize.py").write_text("import os\nos.environ['SITE_RAN'] = 'yes'\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    code = textwrap.dedent(
        """
        import os, sys, llama_guard._install.patching as installed
        print(os.environ.get('SITE_RAN'), installed.installation() is not None)
        sys.exit(3)
        """
    )
    process = llama_guard_run("--origins", "auto", "--", sys.executable, "-c", code, env=env)
    assert process.returncode == 3, process.stderr
    assert process.stdout.split() == ["yes", "True"]


@pytest.mark.parametrize(
    ("args", "status", "message"),
    [
        (["--"], 2, "give the command to run after --"),
        (["--origins", "ftp://nope", "--", "true"], 2, "bad --origins 'ftp://nope'"),
        # The flag given empty is named, not the environment variable it overrides.
        (["--origins", " , ", "--", "true"], 2, "bad --origins ' , ': it names no origin; give 'auto' or"),
        (["--", "no-such-command-llama-guard"], 127, "command not found: no-such-command-llama-guard"),
    ],
)
def test_run_rejects_bad_input_in_one_line(args: list[str], status: int, message: str) -> None:
    process = llama_guard_run(*args)
    assert process.returncode == status
    assert message in process.stderr
    assert "Traceback" not in process.stderr
    assert len(process.stderr.strip().splitlines()) == 1


def test_a_bad_environment_variable_stops_the_child_with_a_clear_message() -> None:
    """Set by hand (not through `run`), a malformed LLAMA_GUARD_ORIGINS must not be silently ignored."""
    from llama_guard._install.environment import BOOTSTRAP_DIRECTORY

    env = {**os.environ, "PYTHONPATH": BOOTSTRAP_DIRECTORY, "LLAMA_GUARD_ORIGINS": "localhost:8080"}
    process = run_python("print('ran')", env=env)
    assert process.returncode == 2
    assert "LLAMA_GUARD_ORIGINS='localhost:8080'" in process.stderr
    assert "ran" not in process.stdout
