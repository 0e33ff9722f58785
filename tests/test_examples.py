"""Every example runs as a user would run it (``python examples/X.py``), against the emulator it starts itself,
and exits 0 only when the guard lost nothing. The FastAPI proxy has its own tests (test_fastapi_proxy.py)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

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


#: The examples that send the same requests with plain httpx and with the guard, and the label of each line.
COMPARING = {
    "plain_httpx.py": ("plain httpx", "llama_guard"),
    "async_httpx.py": ("plain httpx", "llama_guard"),
    "existing_client.py": ("before guard()", "after guard() "),
}
_LINE = re.compile(r"(?P<label>.+?): (?P<failed>\d+) of (?P<sent>\d+) requests failed")


def _failed(stdout: str, label: str) -> tuple[int, int]:
    """(failed, sent) from the example's line for ``label``."""
    for line in stdout.splitlines():
        found = _LINE.match(line)
        if found and found["label"] == label:
            return int(found["failed"]), int(found["sent"])
    raise AssertionError(f"no line for {label!r} in {stdout!r}")


def _run_example(name: str, *arguments: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(EXAMPLES / name), *arguments],
        env={key: value for key, value in os.environ.items() if key != "LLAMA_URL"},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@contextlib.contextmanager
def standalone_emulator(*flags: str) -> Iterator[tuple[str, list[str]]]:
    """``python -m llama_guard.testing FLAGS --port 0`` in its own process, as the docstrings say to start it: its
    URL, and the lines it printed once stopped (Ctrl-C)."""
    process = subprocess.Popen(
        [sys.executable, "-m", "llama_guard.testing", *flags, "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    printed: list[str] = []
    try:
        assert process.stdout is not None
        first = process.stdout.readline()
        found = re.search(r"listening on (http://\S+)", first)
        assert found, first
        yield found[1], printed
    finally:
        process.send_signal(signal.SIGINT)
        out, _ = process.communicate(timeout=30)
        printed.extend(out.splitlines())


@pytest.mark.slow  # an interpreter per example
@pytest.mark.parametrize("name", sorted(COMPARING))
def test_an_example_shows_the_defect_on_the_emulator_it_starts(name: str) -> None:
    """Run as its docstring's first line says (no server named): plain httpx loses requests, the guard none."""
    process = _run_example(name)
    assert process.returncode == 0, process.stdout + process.stderr
    plain, guard = COMPARING[name]
    failed, sent = _failed(process.stdout, plain)
    assert 0 < failed < sent, process.stdout
    assert _failed(process.stdout, guard) == (0, sent), process.stdout


@pytest.mark.slow  # two interpreters per example
@pytest.mark.parametrize("name", sorted(COMPARING))
def test_an_example_shows_the_defect_on_the_standalone_faulty_emulator(name: str) -> None:
    """Pointed at ``python -m llama_guard.testing --faulty`` as its docstring says: plain httpx loses the requests
    the emulator dropped after a stream, the guard none (sequential clients: 9 of 20, every request after a stream
    but the last)."""
    docstring = (EXAMPLES / name).read_text(encoding="utf-8").split('"""')[1]
    assert "python -m llama_guard.testing --faulty" in docstring, name
    with standalone_emulator("--faulty") as (url, printed):
        process = _run_example(name, url)
    assert process.returncode == 0, process.stdout + process.stderr
    plain, guard = COMPARING[name]
    failed, sent = _failed(process.stdout, plain)
    dropped = re.search(r"dropped after stream=(\d+)", " ".join(printed))
    assert dropped, printed
    assert 0 < failed < sent, process.stdout
    # Every request plain httpx lost was dropped by the emulator; existing_client's guarded client may find one
    # more dying connection in the pool it took over, which the guard sends again (its docstring says so).
    assert failed <= int(dropped[1]) <= failed + (name == "existing_client.py"), (process.stdout, printed)
    if name != "async_httpx.py":
        assert failed == 9
    assert _failed(process.stdout, guard) == (0, sent), process.stdout
