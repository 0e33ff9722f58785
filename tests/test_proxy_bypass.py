"""A guard given as ``transport=`` to a client that also has ``proxy=`` never sees a request (httpx mounts its own
proxy transport for every URL): said once, and in ``stats.bypassed``, when the client enters its transports
(``with``) or else when it closes."""

from __future__ import annotations

import logging

import httpx
import pytest

import llama_guard
from llama_guard._runtime import PROCESS

# A proxy address nothing listens on: no request is sent in these tests, only the client's set-up is looked at.
PROXY = "http://127.0.0.1:9"


@pytest.fixture(autouse=True)
def _fresh_warnings() -> None:
    PROCESS.warnings.forget()


def test_a_proxied_client_that_bypasses_the_guard_is_said(caplog: pytest.LogCaptureFixture) -> None:
    """transport=GuardTransport() with proxy=: entering the client says the guard is bypassed, before any request,
    and stats too; closing it says nothing more."""
    guard = llama_guard.GuardTransport()
    with caplog.at_level(logging.WARNING, logger="llama_guard"), httpx.Client(transport=guard, proxy=PROXY):
        assert guard.stats.bypassed is not None
        assert "all://" in guard.stats.bypassed
    said = [r for r in caplog.records if "is bypassed" in r.getMessage()]
    assert len(said) == 1
    assert "guard(client)" in said[0].getMessage()


def test_a_client_used_without_with_is_said_when_it_closes(caplog: pytest.LogCaptureFixture) -> None:
    """A client that is never entered is looked at when it closes."""
    guard = llama_guard.GuardTransport()
    client = httpx.Client(transport=guard, proxy=PROXY)
    assert guard.stats.bypassed is None
    with caplog.at_level(logging.WARNING, logger="llama_guard"):
        client.close()
    assert guard.stats.bypassed is not None
    assert [r for r in caplog.records if "is bypassed" in r.getMessage()]


def test_a_partial_bypass_is_said(caplog: pytest.LogCaptureFixture) -> None:
    """mounts= for one scheme sends that scheme round the guard while the other goes through it: said too."""
    guard = llama_guard.GuardTransport()
    mounts = {"https://": httpx.HTTPTransport()}
    with caplog.at_level(logging.WARNING, logger="llama_guard"), httpx.Client(transport=guard, mounts=mounts):
        pass
    assert guard.stats.bypassed is not None
    assert "https://" in guard.stats.bypassed


@pytest.mark.anyio
async def test_the_async_guard_says_it_too(caplog: pytest.LogCaptureFixture) -> None:
    """The same for AsyncGuardTransport."""
    guard = llama_guard.AsyncGuardTransport()
    with caplog.at_level(logging.WARNING, logger="llama_guard"):
        async with httpx.AsyncClient(transport=guard, proxy=PROXY):
            pass
    assert guard.stats.bypassed is not None
    assert any("is bypassed" in r.getMessage() for r in caplog.records)


def test_an_unused_client_without_proxy_says_nothing(caplog: pytest.LogCaptureFixture) -> None:
    """Control: a client that simply made no request is not a bypass."""
    guard = llama_guard.GuardTransport()
    with caplog.at_level(logging.WARNING, logger="llama_guard"), httpx.Client(transport=guard):
        pass
    assert guard.stats.bypassed is None
    assert not [r for r in caplog.records if "is bypassed" in r.getMessage()]


def test_guard_of_a_proxied_client_wraps_the_proxy_transport() -> None:
    """guard(client) wraps the mounted proxy transport: nothing is bypassed."""
    client = llama_guard.guard(httpx.Client(proxy=PROXY))
    try:
        mounted = list(client._mounts.values())
        assert mounted
        assert all(isinstance(t, llama_guard.GuardTransport) for t in mounted)
    finally:
        client.close()


@pytest.mark.parametrize("mounted", ["guard(client)", "GuardTransport", "DualGuardTransport"])
def test_a_mounted_guard_is_no_bypass(mounted: str, caplog: pytest.LogCaptureFixture) -> None:
    """A transport mounted for some URLs that is itself a guard sends guarded: nothing is bypassed, and the warning
    that told the user to call guard(client) is not said (it was, after guard(client) itself)."""

    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"ok": True})

    pattern = f"http://mounted-{mounted.lower().replace('(', '-').replace(')', '')}.invalid"
    mounts: dict[str, httpx.BaseTransport] = {
        "guard(client)": httpx.MockTransport(answer),
        "GuardTransport": llama_guard.GuardTransport(httpx.MockTransport(answer)),
        "DualGuardTransport": llama_guard.DualGuardTransport(httpx.MockTransport(answer)),
    }
    client = httpx.Client(transport=httpx.MockTransport(answer), mounts={pattern: mounts[mounted]})
    if mounted == "guard(client)":
        client = llama_guard.guard(client)
        guard = client._transport
    else:
        guard = llama_guard.GuardTransport(httpx.MockTransport(answer))
        client._transport = guard
    assert isinstance(guard, llama_guard.GuardTransport)
    with caplog.at_level(logging.WARNING, logger="llama_guard"):
        with client:
            assert client.get("http://127.0.0.1:9/health").status_code == 200
            assert client.get(f"{pattern}/health").status_code == 200
        assert guard.stats.bypassed is None
    assert not [r for r in caplog.records if "is bypassed" in r.getMessage()]


def test_a_partial_bypass_is_said_at_the_first_request_without_with(caplog: pytest.LogCaptureFixture) -> None:
    """A client never entered, with one scheme mounted round the guard: said at its first request through the
    guard, not only when (if ever) it closes."""

    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"ok": True})

    guard = llama_guard.GuardTransport(httpx.MockTransport(answer))
    client = httpx.Client(transport=guard, mounts={"https://": httpx.HTTPTransport()})
    try:
        with caplog.at_level(logging.WARNING, logger="llama_guard"):
            assert client.get("http://127.0.0.1:9/health").status_code == 200
            assert guard.stats.bypassed is not None
            assert "https://" in guard.stats.bypassed
            assert len([r for r in caplog.records if "is bypassed" in r.getMessage()]) == 1
    finally:
        client.close()


def test_the_check_never_walks_the_heap(monkeypatch: pytest.MonkeyPatch) -> None:
    """The client is found from the frames that call the guard, not among the heap's objects: a walk of the heap
    at every client's close costs in proportion to everything the process holds (here it would raise)."""
    import gc

    def walked(*args: object) -> list[object]:
        raise AssertionError("the bypass check walked the heap")

    monkeypatch.setattr(gc, "get_referrers", walked)
    monkeypatch.setattr(gc, "get_objects", walked)
    entered, closed, plain = (llama_guard.GuardTransport() for _ in range(3))
    with httpx.Client(transport=entered, proxy=PROXY):
        pass
    httpx.Client(transport=closed, proxy=PROXY).close()
    httpx.Client(transport=plain).close()
    assert entered.stats.bypassed is not None
    assert closed.stats.bypassed is not None
    assert plain.stats.bypassed is None
