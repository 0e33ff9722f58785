"""`install()` and `llama-guard run` for requests and urllib3 in fresh interpreters: either import order, and an
unmodified program under ``llama-guard run``.

Each case runs a short script in a new Python process against the emulator on loopback; the script prints, as JSON,
which of its responses carry the guard's result and what the installation counted.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator

import pytest

from llama_guard.testing import LlamaServerEmulator

# Fresh interpreters (a second or more each): the full suite's, not the fast core's.
pytestmark = pytest.mark.slow

TIMEOUT = 60

# A session, the module-level requests.post, and a urllib3 PoolManager: three requests each.
SCRIPT = """
import json, sys
url = sys.argv[1]
{imports}
import requests, urllib3
results = []
session = requests.Session()
for _ in range(3):
    response = session.post(url + "/v1/chat/completions", json={{"messages": [], "stream": True, "max_tokens": 2}})
    results.append(getattr(response.raw, "_llama_guard_result", None) is not None)
for _ in range(3):
    response = requests.post(url + "/v1/chat/completions", json={{"messages": [], "max_tokens": 2}})
    results.append(getattr(response.raw, "_llama_guard_result", None) is not None)
manager = urllib3.PoolManager()
for _ in range(3):
    response = manager.request("GET", url + "/health")
    results.append(getattr(response, "_llama_guard_result", None) is not None)
import llama_guard._install.patching as installed
current = installed.installation()
print(json.dumps({{"guarded": results, "requests": current.stats.snapshot().requests if current else None}}))
"""

IMPORTS = {
    "requests-first": "import requests\nimport llama_guard\nllama_guard.install(origins=[url])",
    "llama-guard-first": "import llama_guard\nllama_guard.install(origins=[url])",
    "nothing": "import llama_guard",
}


@pytest.fixture(scope="module")
def server() -> Iterator[LlamaServerEmulator]:
    with LlamaServerEmulator(http_threads=8, pool_bug=False, close_after_stream=False) as emulator:
        yield emulator


def outcome(process: subprocess.CompletedProcess[str]) -> dict[str, object]:
    assert process.returncode == 0, process.stderr
    result: dict[str, object] = json.loads(process.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.parametrize("order", ["requests-first", "llama-guard-first"])
def test_install_covers_requests_and_urllib3_in_either_import_order(server: LlamaServerEmulator, order: str) -> None:
    script = SCRIPT.format(imports=IMPORTS[order])
    process = subprocess.run(
        [sys.executable, "-c", script, server.url], capture_output=True, text=True, timeout=TIMEOUT, check=False
    )
    assert outcome(process) == {"guarded": [True] * 9, "requests": 9}


def test_importing_llama_guard_patches_nothing(server: LlamaServerEmulator) -> None:
    script = SCRIPT.format(imports=IMPORTS["nothing"])
    process = subprocess.run(
        [sys.executable, "-c", script, server.url], capture_output=True, text=True, timeout=TIMEOUT, check=False
    )
    assert outcome(process) == {"guarded": [False] * 9, "requests": None}


def test_run_guards_an_unmodified_requests_program(server: LlamaServerEmulator) -> None:
    script = SCRIPT.format(imports="")
    process = subprocess.run(
        [sys.executable, "-m", "llama_guard", "run", "--origins", server.url, "--", sys.executable, "-c", script,
         server.url],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )  # fmt: skip
    assert outcome(process) == {"guarded": [True] * 9, "requests": 9}
