"""Every ```python block of README.md and docs/*.md runs as written, and prints what the docs say it prints.

The convention (docs/index.md, "Code in these pages", says it to readers), an HTML comment on the line just before a
fence, invisible on GitHub and on the site:

- no marker: a ```python block is a complete program. It runs in a fresh interpreter, against an emulator whose URL
  replaces ``http://127.0.0.1:8080`` (the address the docs use for "your llama-server"), with a timeout.
- ``<!-- fragment -->``: a piece of a larger program (it uses names it does not define, or starts a server that
  never returns). Not run.
- ``<!-- pytest -->``: a test module; it runs under pytest and all its tests must pass.
- ``<!-- output -->`` before a ```text block: the exact stdout of the block run just before it; ``...`` stands for
  any text (numbers that vary from run to run).

Other fences (``sh``, ``text``, ``json``, unlabelled ones showing output) are not Python and are not run.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from llama_guard.testing import LlamaServerEmulator

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
DOCS_URL = "http://127.0.0.1:8080"
MARKERS = ("fragment", "pytest", "output")
TIMEOUT = 90.0

_FENCE = re.compile(r"^(?P<fence>`{3,})(?P<info>[^`]*)$")
_MARKER = re.compile(r"^<!--\s*(?P<name>[\w-]+)\s*-->$")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    lang: str
    marker: str | None
    code: str

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks_of(page: Path) -> list[Block]:
    lines = page.read_text(encoding="utf-8").splitlines()
    found: list[Block] = []
    index = 0
    while index < len(lines):
        opening = _FENCE.match(lines[index])
        if not opening:
            index += 1
            continue
        start = index
        body: list[str] = []
        index += 1
        while index < len(lines) and lines[index].rstrip() != opening["fence"]:
            body.append(lines[index])
            index += 1
        if index == len(lines):
            raise AssertionError(f"{page.relative_to(ROOT)}:{start + 1}: code block never closed")
        previous = lines[start - 1].strip() if start else ""
        marker = _MARKER.match(previous)
        found.append(
            Block(page, start + 1, opening["info"].strip(), marker["name"] if marker else None, "\n".join(body) + "\n")
        )
        index += 1
    return found


ALL_BLOCKS = [block for page in PAGES for block in blocks_of(page)]
RUN = [block for block in ALL_BLOCKS if block.lang == "python" and block.marker != "fragment"]


def expected_output(block: Block) -> str | None:
    """The ``<!-- output -->`` block right after ``block`` (the next fence in the same page), if any."""
    after = [b for b in ALL_BLOCKS if b.page == block.page and b.line > block.line]
    if after and after[0].marker == "output":
        return after[0].code
    return None


def matches(expected: str, actual: str) -> bool:
    pattern = ".*?".join(re.escape(part) for part in expected.strip().split("..."))
    return re.fullmatch(pattern, actual.strip(), flags=re.DOTALL) is not None


@pytest.fixture
def server() -> Iterator[LlamaServerEmulator]:
    with LlamaServerEmulator() as emulator:
        yield emulator


def test_markers_are_known_and_placed_where_they_mean_something() -> None:
    """A typo in a marker would silently run (or skip) a block: every marker is one of the known ones, on the block
    it is meant for, and every <!-- output --> follows a block that runs."""
    problems = []
    for page in PAGES:
        lines = page.read_text(encoding="utf-8").splitlines()
        for number, line in enumerate(lines, 1):
            marker = _MARKER.match(line.strip())
            before_fence = number < len(lines) and _FENCE.match(lines[number]) is not None
            if marker and before_fence and marker["name"] not in MARKERS:
                problems.append(f"{page.relative_to(ROOT)}:{number}: unknown marker {line.strip()}; known: {MARKERS}")
            if marker and marker["name"] in MARKERS and not before_fence:
                problems.append(f"{page.relative_to(ROOT)}:{number}: {line.strip()} is not right before a fence")
    for block in ALL_BLOCKS:
        if block.marker in ("fragment", "pytest") and block.lang != "python":
            problems.append(f"{block.name}: <!-- {block.marker} --> on a {block.lang or 'plain'} block")
        if block.marker == "output":
            before = [b for b in ALL_BLOCKS if b.page == block.page and b.line < block.line]
            if not before or before[-1] not in RUN or before[-1].marker == "pytest":
                problems.append(f"{block.name}: <!-- output --> does not follow a block that runs")
    assert not problems, "\n".join(problems)


def test_the_convention_covers_the_docs() -> None:
    """Guards the parser itself: it finds the blocks, and most Python in the docs runs."""
    python = [block for block in ALL_BLOCKS if block.lang == "python"]
    assert len(python) >= 20
    assert len(RUN) > len(python) / 2


def test_matches_treats_ellipsis_as_any_text() -> None:
    assert matches("0 200\n... requests=...", "0 200\n1 200\n<GuardStats requests=6>")
    assert not matches("0 200\n1 200", "0 200\n1 500")


@pytest.mark.slow
@pytest.mark.parametrize("block", RUN, ids=[block.name for block in RUN])
def test_block_runs(block: Block, server: LlamaServerEmulator, tmp_path: Path) -> None:
    """The block runs to the end in a fresh interpreter (exit 0), and prints what the docs show."""
    script = tmp_path / ("test_snippet.py" if block.marker == "pytest" else "snippet.py")
    script.write_text(block.code.replace(DOCS_URL, server.url), encoding="utf-8")
    command = [sys.executable, str(script)]
    if block.marker == "pytest":
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "error", str(script)]
    env = {**os.environ, "LLAMA_URL": server.url, "PYTHONDONTWRITEBYTECODE": "1"}
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=TIMEOUT, check=False)
    assert done.returncode == 0, f"{block.name} exited {done.returncode}\n{done.stdout}\n{done.stderr}"
    expected = expected_output(block)
    if expected is not None:
        assert matches(expected, done.stdout), f"{block.name} printed:\n{done.stdout}\nthe docs show:\n{expected}"


def test_the_emulator_s_settings_table_names_every_argument() -> None:
    """docs/testing.md's table of `LlamaServerEmulator` arguments has a row for each (a new setting, such as
    ``stall_oldest_first``, was once left out) and none that does not exist."""
    import inspect

    lines = (ROOT / "docs" / "testing.md").read_text(encoding="utf-8").splitlines()
    start = lines.index("| Argument | Default | Meaning |")
    documented: set[str] = set()
    for line in lines[start + 2 :]:
        if not line.startswith("| `"):
            break
        documented.update(re.findall(r"`(\w+)`", line.split("|")[1]))
    arguments = set(inspect.signature(LlamaServerEmulator).parameters)
    assert documented == arguments
