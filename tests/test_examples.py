"""Every example runs as a user would run it (``python examples/X.py``), against the emulator it starts itself,
and exits 0 only when the guard lost nothing. The FastAPI proxy has its own tests (test_fastapi_proxy.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from llama_guard.testing import LlamaServerEmulator

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
STANDALONE = sorted(
    p.name for p in EXAMPLES.glob("*.py") if p.name != "fastapi_proxy.py" and not p.name.startswith("_")
)


def test_every_example_is_covered() -> None:
    assert {"plain_httpx.py", "async_httpx.py", "existing_client.py", "openai_sdk.py", "httpx2_client.py"} <= set(
        STANDALONE
    )


@pytest.mark.slow  # an interpreter per example, 2 to 9 s each
@pytest.mark.parametrize("name", STANDALONE)
def test_example_runs(name: str) -> None:
    process = subprocess.run(
        [sys.executable, str(EXAMPLES / name)], capture_output=True, text=True, timeout=120, check=False
    )
    assert process.returncode == 0, process.stdout + process.stderr
    assert "Traceback" not in process.stderr


# What each example needs beyond `pip install -e .`: its extra, and a module of that extra to hide.
EXTRAS = {
    "plain_httpx.py": None,
    "async_httpx.py": None,
    "existing_client.py": None,
    "httpx2_client.py": ("httpx2", "httpx2"),
    "openai_sdk.py": ("examples", "openai"),
    "pydantic_ai_agent.py": ("examples", "pydantic_ai"),
    "fastapi_proxy.py": ("examples", "fastapi"),
}

# Runs an example as `python examples/X.py` would, with the modules named in argv[2:] made unimportable.
WITHOUT_MODULES = """
import runpy, sys
from importlib.abc import MetaPathFinder

hidden = set(sys.argv[2:])

class Hide(MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in hidden:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, Hide())
for name in list(sys.modules):
    if name.split(".")[0] in hidden:
        del sys.modules[name]
script = sys.argv[1]
sys.argv = [script]
sys.path.insert(0, script.rsplit("/", 1)[0])
runpy.run_path(script, run_name="__main__")
"""


def test_every_example_declares_what_it_needs() -> None:
    """Each example's docstring has a 'Needs' line naming its extra, or saying it needs none."""
    assert set(EXTRAS) == {p.name for p in EXAMPLES.glob("*.py") if not p.name.startswith("_")}
    for name, needs in EXTRAS.items():
        text = (EXAMPLES / name).read_text(encoding="utf-8")
        docstring = text.split('"""')[1]
        expected = f"pip install -e '.[{needs[0]}]'" if needs else "pip install -e ."
        assert "Needs " in docstring, name
        assert expected in docstring, name


@pytest.mark.slow  # an interpreter per example, about a second each
@pytest.mark.parametrize("name", [name for name, needs in EXTRAS.items() if needs])
def test_an_example_without_its_extra_names_it_and_exits_2(name: str) -> None:
    extra, module = EXTRAS[name]  # type: ignore[misc]
    process = subprocess.run(
        [sys.executable, "-c", WITHOUT_MODULES, str(EXAMPLES / name), module],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert process.returncode == 2, process.stdout + process.stderr
    lines = process.stderr.strip().splitlines()
    assert len(lines) == 1, process.stderr
    assert f"pip install -e '.[{extra}]'" in lines[0]
    assert module in lines[0]
    assert process.stdout == ""


@pytest.mark.slow  # an interpreter
def test_plain_httpx_example_shows_defect_1_on_the_deterministic_emulator() -> None:
    """docs/testing.md, "Both defects, every time": pointed at `--faulty` (`--stream-close on_reuse
    --stall-burst 16`), the example's plain client loses 9 of its 20 requests (every request after a stream but the
    last) and the guard none."""
    with LlamaServerEmulator(stream_close="on_reuse", stall_burst=16) as server:
        process = subprocess.run(
            [sys.executable, str(EXAMPLES / "plain_httpx.py")],
            env={**os.environ, "LLAMA_URL": server.url},
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        dropped = server.stats().requests_dropped_after_stream
    assert process.returncode == 0, process.stdout + process.stderr
    lines = process.stdout.splitlines()
    assert lines[0].startswith("plain httpx: 9 of 20 requests failed"), process.stdout
    assert lines[1].startswith("llama_guard: 0 of 20 requests failed"), process.stdout
    assert dropped == 9
