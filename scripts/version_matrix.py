#!/usr/bin/env python3
"""Run the fast core suite against the oldest and newest versions the pins allow.

The guard reaches into httpcore's and httpcore2's internals (behind one version gate), so the versions the pins admit
must be the versions it was tested with. Each row gets a fresh virtual environment under ``.matrix/``, the project
installed with its ``test`` extra and the row's exact versions, and runs ``pytest -n 4 -m "not slow and not
real_server"`` with ``LLAMA_GUARD_PARTIAL_DEPS=1``: a test module that needs a package the row lacks (httpx2 on
Python 3.10, the frameworks) is not collected, and pytest's summary names it. httpx2 needs Python 3.11, so its
lowest version has a row of its own, which runs only the tests named for httpx2.

Usage::

    python scripts/version_matrix.py            # every row; exit 1 if one fails, 2 if one cannot be set up
    python scripts/version_matrix.py --row oldest
    python scripts/version_matrix.py --try aiohttp==3.14.6   # a release not in TESTED_VERSIONS yet

``--try NAME==VERSION`` (repeatable) answers, for a new release of a library the guard hooks, whether the hooks work
on it: a row of its own (Python 3.11, ``--python`` to change) with those versions, the release admitted for the run
(``LLAMA_GUARD_ADMIT``: ``tests/conftest.py`` adds it to the gate's ``TESTED_VERSIONS``, so the tests run the hooks
rather than the public path), and the tests named for the library, real-server ones included where a llama-server
is built. Passing is half the evidence: the release joins ``TESTED_VERSIONS`` once what it changed where the guard
touches it (the library's ``internals.py``) is read too.

An interpreter a row needs is looked up in pyenv's versions folder, then as ``pythonX.Y`` on PATH; a row whose
interpreter is missing fails (exit 2) rather than passing unseen. Stdlib only.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FAST_CORE = "not slow and not real_server"
# What --try runs of the tests named for a library, its tests against a real llama-server included.
TRY_MARKERS = "not slow"
# The tests named for each library the guard hooks (pytest -k), for --try.
LIBRARY_TESTS = {
    "httpx": None,  # the whole suite: httpx is the guard's main stack
    "httpcore": None,
    "httpx2": "httpx2",
    "httpcore2": "httpx2",
    "aiohttp": "aiohttp",
    "requests": "requests or urllib3",
    "urllib3": "requests or urllib3",
}
# Workers, as the README's fast-core command: its tests wait on sockets and deadlines far more than they compute.
WORKERS = "4"


@dataclass(frozen=True)
class Row:
    name: str
    python: str
    pins: tuple[str, ...]
    why: str
    #: A pytest ``-k`` expression: the row runs only these tests of the fast core (None: all of it).
    select: str | None = None
    #: A --try row: its releases installed over the pins and admitted to the version gate for the run.
    trial: bool = False


# Keep in step with pyproject.toml's bounds and the TESTED_VERSIONS tables (llama_guard/_httpx/internals.py,
# llama_guard/_aiohttp/internals.py): tests/test_version_pins.py checks that every bound is a row's.
ROWS = (
    Row(
        "oldest",
        "3.10",
        (
            "httpx==0.27.0",
            "httpcore==1.0.7",
            "h11==0.14.0",
            "anyio==4.16.0",
            "tenacity==8.3.0",
            "wrapt==2.5.0",
            "aiohttp==3.12.4",
            "requests==2.31.0",
            "urllib3==2.0.7",
        ),
        "the lowest versions the pins allow, on the lowest Python (httpx2 needs 3.11: its tests skip and say so)",
    ),
    Row(
        "newest",
        "3.13",
        ("httpx==0.29.0", "httpcore==1.0.9", "httpx2==2.17.0", "httpcore2==2.17.0", "aiohttp==3.14.5"),
        "the newest versions the pins allow, on the newest Python",
    ),
    Row(
        "oldest-httpx2",
        "3.11",
        ("httpx2==2.16.2", "httpcore2==2.16.2"),
        "the lowest httpx2 the pins allow, its tests, on the lowest Python httpx2 supports (the oldest row's has none)",
        select="httpx2",
    ),
)


class SetupError(Exception):
    """A row that cannot run here, in one line."""


def find_python(version: str) -> str:
    # pyenv's own folder first: its shim on PATH exists for every installed version but fails unless that version is
    # selected, so a name on PATH is only taken once it has shown that it runs.
    pyenv_root = os.environ.get("PYENV_ROOT") or str(Path.home() / ".pyenv")
    candidates = sorted(glob.glob(f"{pyenv_root}/versions/{version}.*/bin/python{version}"))
    found = candidates[-1] if candidates else shutil.which(f"python{version}")
    if found and subprocess.run([found, "--version"], capture_output=True).returncode == 0:
        return found
    raise SetupError(f"no Python {version} (looked in {pyenv_root}/versions and for python{version} on PATH)")


def run(cmd: list[str], *, log: Path | None = None, env: dict[str, str] | None = None) -> int:
    if log is None:
        return subprocess.call(cmd, cwd=ROOT, env=env)
    with log.open("a") as out:
        return subprocess.call(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)


def prepare(row: Row, *, beyond_pins: bool = False) -> Path:
    """A fresh venv with the project and the row's exact versions; returns its python. ``beyond_pins`` (--try): the
    versions are installed after the project, over its pins (a release a pin does not admit yet can be tried), and
    with the ``real`` extra (the tiny model of the real-server tests)."""
    venv = ROOT / ".matrix" / row.name
    shutil.rmtree(venv, ignore_errors=True)
    venv.parent.mkdir(exist_ok=True)
    log = venv.parent / f"{row.name}.install.log"
    log.unlink(missing_ok=True)
    if run([find_python(row.python), "-m", "venv", str(venv)], log=log):
        raise SetupError(f"could not create a venv with Python {row.python} (see {log})")
    python = venv / "bin" / "python"
    steps = [["-e", ".[test,real]"], list(row.pins)] if beyond_pins else [["-e", ".[test]", *row.pins]]
    for step in steps:
        if run([str(python), "-m", "pip", "install", "--quiet", *step], log=log):
            raise SetupError(f"pip could not install {' '.join(step)} with Python {row.python} (see {log})")
    return python


def versions(python: Path) -> str:
    code = (
        "import importlib.metadata as m, sys\n"
        "names = ('httpx', 'httpcore', 'httpx2', 'httpcore2', 'aiohttp', 'requests', 'urllib3', 'h11', 'anyio')\n"
        "def v(n):\n"
        "    try: return m.version(n)\n"
        "    except m.PackageNotFoundError: return '-'\n"
        "print(f'Python {sys.version.split()[0]}', *(f'{n} {v(n)}' for n in names), sep=', ')\n"
    )
    return subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def release(text: str) -> str:
    """A ``--try`` argument: ``NAME==VERSION`` of a library the guard hooks."""
    name, equals, version = text.partition("==")
    if not equals or not version or name not in LIBRARY_TESTS:
        raise argparse.ArgumentTypeError(
            f"expected NAME==VERSION with NAME one of {', '.join(LIBRARY_TESTS)}, got {text!r}"
        )
    return text


def try_row(pins: list[str], python: str) -> Row:
    """The row of ``--try``: the releases pinned, the tests named for their libraries."""
    selections = {LIBRARY_TESTS[pin.partition("==")[0]] for pin in pins}
    select = None if None in selections else " or ".join(sorted(f"({s})" for s in selections if s is not None))
    why = "releases not in TESTED_VERSIONS, admitted for this run"
    return Row("try", python, tuple(pins), why, select, trial=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--row", choices=[r.name for r in ROWS], action="append", help="run only this row")
    parser.add_argument(
        "--try",
        dest="releases",
        type=release,
        action="append",
        metavar="NAME==VERSION",
        help="a release to try the hooks on, admitted for the run (repeatable; instead of the rows)",
    )
    parser.add_argument("--python", default="3.11", help="with --try: the Python of its row (%(default)s)")
    args = parser.parse_args(argv)
    if args.releases and args.row:
        parser.error("--try runs a row of its own: give --row or --try, not both")
    rows = (
        [try_row(args.releases, args.python)]
        if args.releases
        else [r for r in ROWS if not args.row or r.name in args.row]
    )
    failed: list[str] = []
    for row in rows:
        started = time.monotonic()
        print(f"version matrix: {row.name}: {row.why}", flush=True)
        try:
            python = prepare(row, beyond_pins=row.trial)
        except SetupError as exc:
            print(f"version matrix: {row.name}: error: {exc}", file=sys.stderr)
            return 2
        print(f"version matrix: {row.name}: {versions(python)}", flush=True)
        selection = [] if row.select is None else ["-k", row.select]
        env = {**os.environ, "LLAMA_GUARD_PARTIAL_DEPS": "1"}
        markers = FAST_CORE
        if row.trial:
            # The pins' own test checks the committed tables against pyproject.toml: not what a try asks.
            env["LLAMA_GUARD_ADMIT"] = " ".join(row.pins)
            markers = TRY_MARKERS
            selection += ["--deselect", "tests/test_version_pins.py"]
        code = run(
            [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", WORKERS, "-m", markers, *selection],
            env=env,
        )
        took = time.monotonic() - started
        print(f"version matrix: {row.name}: {'passed' if code == 0 else 'FAILED'} in {took:.0f} s", flush=True)
        if row.trial and code == 0:
            print(
                f"version matrix: try: the hooks pass on {', '.join(row.pins)}; read what changed where the guard "
                "touches it (the library's internals.py) before adding it to TESTED_VERSIONS",
                flush=True,
            )
        if code:
            failed.append(row.name)
    if failed:
        print(f"version matrix: failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
