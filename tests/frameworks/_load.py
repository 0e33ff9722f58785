"""One framework path under load: plain, then guarded, against the same emulator; what each phase lost.

A *call* is ``call(index, stream) -> text``: one chat completion through the framework, its whole answer. Half of
the requests are streamed (odd indexes). Sync calls run one after another on the framework's one client, so each
request after a stream meets that stream's pooled connection; async calls run as 16 concurrent tasks sharing one
client. Every framework's own retries are off (``max_retries=0``, litellm's ``num_retries=0``), so whatever recovers
a lost request is the guard.

The server is tests/conftest.py's ``racy_server`` (``stream_close="on_reuse"``): every request written to a
connection a stream left is dropped unanswered and counted (``requests_dropped_after_stream``), whatever the load.
So the controls are exact: a phase lost exactly the requests the server dropped in it, and no other.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field

import pytest

import llama_guard
from llama_guard.testing import EmulatorStats, LlamaServerEmulator, generated_text

MAX_TOKENS = 4
SYNC_REQUESTS = 24
ASYNC_REQUESTS = 48
CONCURRENCY = 16
MESSAGES = [{"role": "user", "content": "hi"}]

# Warnings the frameworks' own imports raise, nothing to do with the guard (pytest turns warnings into errors).
FRAMEWORK_WARNINGS = [
    # pydantic on litellm's TypedDicts
    pytest.mark.filterwarnings("ignore:Items? .* on TypedDict class .*ReadOnly:UserWarning"),
]

SyncCall = Callable[[int, bool], str]
AsyncCall = Callable[[int, bool], Awaitable[str]]


@dataclass
class Phase:
    """One phase of a test: how many requests were asked, the texts that came back and the errors raised."""

    asked: int
    texts: list[str] = field(default_factory=list)
    errors: list[BaseException] = field(default_factory=list)
    completions_ran: int = 0  # completions the server started during the phase
    dropped: int = 0  # requests the server dropped during the phase, written to a connection a stream left

    @property
    def lost(self) -> int:
        return len(self.errors)

    @property
    def wrong(self) -> list[str]:
        return [text for text in self.texts if text != generated_text(MAX_TOKENS)]


def measure(server: LlamaServerEmulator, phase: Phase, before: EmulatorStats) -> Phase:
    """What the server did during the phase. A dropped request is counted before its connection is closed, so by the
    time the client has seen the loss, the server has counted it: the difference is final."""
    after = server.stats()
    phase.completions_ran = after.completions_started - before.completions_started
    phase.dropped = after.requests_dropped_after_stream - before.requests_dropped_after_stream
    return phase


def run_sync(server: LlamaServerEmulator, call: SyncCall, requests: int = SYNC_REQUESTS) -> Phase:
    phase = Phase(requests)
    before = server.stats()
    for index in range(requests):
        try:
            phase.texts.append(call(index, index % 2 == 1))
        except Exception as exc:
            phase.errors.append(exc)
    return measure(server, phase, before)


async def run_async(server: LlamaServerEmulator, call: AsyncCall, requests: int = ASYNC_REQUESTS) -> Phase:
    phase = Phase(requests)
    before = server.stats()
    indexes = iter(range(requests))

    async def worker() -> None:
        for index in indexes:  # shared: each index taken once
            try:
                phase.texts.append(await call(index, index % 2 == 1))
            except Exception as exc:
                phase.errors.append(exc)

    await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    return measure(server, phase, before)


def assert_guarded(phase: Phase, counted: int) -> None:
    """Nothing lost, nothing dropped, every answer whole, the server ran each request once, and the guard counted
    each."""
    assert phase.errors == [], f"{phase.lost} of {phase.asked} lost, e.g. {phase.errors[:2]!r}"
    assert phase.dropped == 0, f"the server dropped {phase.dropped} requests sent on connections streams left"
    assert phase.wrong == []
    assert phase.completions_ran == phase.asked
    assert counted == phase.asked


def assert_plain_exposed(plain: Phase) -> None:
    """The control of a path that reuses a stream's pooled connection: it lost exactly the requests the server
    dropped there, at least one, and nothing else. (How many depends on how the concurrent tasks interleave: the
    exposed paths are all async; every sync path here closes a stream's response at ``[DONE]``.)"""
    assert plain.dropped > 0, f"plain should reuse a stream's connection; the server dropped 0 of {plain.asked}"
    assert plain.lost == plain.dropped, f"lost {plain.lost}, dropped {plain.dropped}: e.g. {plain.errors[:2]!r}"
    assert plain.wrong == []
    assert plain.completions_ran == plain.asked - plain.lost  # the dropped ones never ran


def assert_plain_not_exposed(plain: Phase) -> None:
    """The control of a path that closes a stream's response at ``[DONE]``: no request ever reached a connection a
    stream left (the server dropped 0), so plain lost 0 and the server ran every request."""
    assert plain.dropped == 0, f"the server dropped {plain.dropped}: plain reused a stream's connection"
    assert plain.errors == [], f"plain lost {plain.lost} of {plain.asked}: {plain.errors[:2]!r}"
    assert plain.wrong == []
    assert plain.completions_ran == plain.asked


def report(framework: str, path: str, plain: Phase, guarded: Phase) -> None:
    """One row of the integrations table (shown with ``pytest -s``)."""
    print(
        f"\nMATRIX {framework} {path}: plain lost {plain.lost} of {plain.asked} (server dropped {plain.dropped}); "
        f"guarded lost {guarded.lost} of {guarded.asked}; server ran {guarded.completions_ran}"
    )


@contextlib.contextmanager
def installed(server: LlamaServerEmulator) -> Iterator[llama_guard.Installation]:
    installation = llama_guard.install(origins=[server.url])
    try:
        yield installation
    finally:
        llama_guard.uninstall()
