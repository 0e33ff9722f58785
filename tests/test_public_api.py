"""The public face: a curated, tested list of names; everything else lives in private modules."""

from __future__ import annotations

import importlib

import httpx
import pytest

import llama_guard


def test_exported_members() -> None:
    """`llama_guard.__all__` is the contract; adding or removing a name is a deliberate change."""
    assert sorted(llama_guard.__all__) == sorted(
        [
            "AsyncGuardTransport",
            "DualGuardTransport",
            "FirstByteTimeout",
            "GuardError",
            "GuardPolicy",
            "GuardResult",
            "GuardStats",
            "GuardTransport",
            "Installation",
            "LatencySummary",
            "Origin",
            "ProbeError",
            "ProbeTimeout",
            "StatsSnapshot",
            "__version__",
            "guard",
            "install",
            "result_of",
            "stats_of",
            "uninstall",
        ]
    )
    for name in llama_guard.__all__:
        assert hasattr(llama_guard, name), name


def test_public_classes_present_the_public_module() -> None:
    """Public classes show as llama_guard.X in reprs and docs, not as private module paths."""
    for name in llama_guard.__all__:
        value = getattr(llama_guard, name)
        if isinstance(value, type):
            assert value.__module__ == "llama_guard", name


def test_errors_are_httpx_errors() -> None:
    """Handlers written for httpx keep working."""
    assert issubclass(llama_guard.FirstByteTimeout, httpx.ReadTimeout)
    assert issubclass(llama_guard.ProbeTimeout, httpx.ConnectTimeout)
    assert issubclass(llama_guard.ProbeError, httpx.ConnectError)
    for cls in (llama_guard.FirstByteTimeout, llama_guard.ProbeTimeout, llama_guard.ProbeError):
        assert issubclass(cls, llama_guard.GuardError)


def test_transports_are_httpx_transports() -> None:
    sync, asynchronous = llama_guard.GuardTransport(), llama_guard.AsyncGuardTransport()
    try:
        assert isinstance(sync, httpx.BaseTransport)
        assert isinstance(asynchronous, httpx.AsyncBaseTransport)
    finally:
        sync.close()


@pytest.mark.parametrize(
    ("module", "library"),
    [("llama_guard.httpx2", "httpx2"), ("llama_guard.aiohttp", "aiohttp"), ("llama_guard.requests", "requests")],
)
def test_a_flavour_presents_its_own_classes_and_keeps_the_shared_ones_public(module: str, library: str) -> None:
    """A flavour's transports and errors show as its own (``llama_guard.httpx2.GuardTransport``); the classes it
    exports again from `llama_guard` (GuardError, GuardPolicy) keep ``llama_guard``; none shows a private module.
    Skipped where the flavour's extra is not installed (httpx2 on Python 3.10, in the version matrix)."""
    pytest.importorskip(library)
    flavour = importlib.import_module(module)
    shown = {name: value.__module__ for name in flavour.__all__ if isinstance(value := getattr(flavour, name), type)}
    assert shown["GuardError"] == shown["GuardPolicy"] == "llama_guard"
    assert shown["ProbeError"] == shown["ProbeTimeout"] == shown["FirstByteTimeout"] == module
    assert set(shown.values()) == {"llama_guard", module}, shown
