"""The versions the pins admit are the versions tested: for each library whose private attributes the guard reads,
``pyproject.toml``'s bounds, the version gate's ``TESTED_VERSIONS`` and the version matrix's rows
(``scripts/version_matrix.py``) agree. A pin widened for a new release without the gate and a matrix row, or a row
left on an old release, fails here rather than on a user's machine."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from llama_guard._aiohttp.internals import TESTED_VERSIONS as AIOHTTP_TESTED
from llama_guard._httpx.internals import TESTED_VERSIONS as HTTPX_TESTED

tomllib = pytest.importorskip("tomllib", reason="tomllib is Python 3.11+ (the pins are checked on every other row)")

ROOT = Path(__file__).resolve().parent.parent
GATED: dict[str, frozenset[str]] = {**HTTPX_TESTED, "aiohttp": AIOHTTP_TESTED}


def _version_matrix() -> ModuleType:
    spec = importlib.util.spec_from_file_location("version_matrix", ROOT / "scripts" / "version_matrix.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


def _pins() -> dict[str, set[str]]:
    """Each gated library's version bounds, as every requirement of the project (dependencies and extras) writes
    them."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        requirements += extra
    pins: dict[str, set[str]] = {name: set() for name in GATED}
    for text in requirements:
        requirement = Requirement(text)
        if requirement.name in pins:
            pins[requirement.name].add(str(requirement.specifier))
    return pins


def _row_versions() -> dict[str, set[str]]:
    """The exact versions the matrix's rows install, per gated library."""
    rows: dict[str, set[str]] = {name: set() for name in GATED}
    for row in _version_matrix().ROWS:
        for pin in row.pins:
            name, _, version = pin.partition("==")
            if name in rows:
                rows[name].add(version)
    return rows


@pytest.mark.parametrize("name", sorted(GATED))
def test_every_tested_version_is_admitted_and_the_bounds_are_rows_of_the_matrix(name: str) -> None:
    pins = _pins()[name]
    assert len(pins) == 1, f"{name} is pinned differently across pyproject.toml's requirements: {sorted(pins)}"
    specifier = SpecifierSet(pins.pop())
    tested = sorted(GATED[name], key=Version)
    refused = [version for version in tested if version not in specifier]
    assert not refused, f"{name}: TESTED_VERSIONS has {refused}, which the pin {specifier} does not admit"
    rows = _row_versions()[name]
    untested_rows = sorted(rows - GATED[name])
    assert not untested_rows, f"{name}: the version matrix installs {untested_rows}, not in TESTED_VERSIONS"
    for bound in (tested[0], tested[-1]):
        assert bound in rows, (
            f"{name} {bound}, the {'lowest' if bound == tested[0] else 'highest'} tested version, is no row of "
            f"scripts/version_matrix.py (its rows install {sorted(rows, key=Version)})"
        )
