"""One framework path under load: plain, then guarded, against the same emulator; what each phase lost.

A *call* is ``call(index, stream) -> text``: one chat completion through the framework, its whole answer. Half of
the requests are streamed (odd indexes). Sync calls run one after another on the framework's one client, so each
request after a stream meets that stream's pooled connection; async calls run as 16 concurrent tasks sharing one
client. Every framework's own retries are off, so whatever recovers a lost request is the guard.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field

import pytest

import llama_guard
from llama_guard.testing import LlamaServerEmulator, generated_text

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

    @property
    def lost(self) -> int:
        return len(self.errors)

    @property
    def wrong(self) -> list[str]:
        return [text for text in self.texts if text != generated_text(MAX_TOKENS)]


def run_sync(server: LlamaServerEmulator, call: SyncCall, requests: int = SYNC_REQUESTS) -> Phase:
    phase = Phase(requests)
    before = server.stats().completions_started
    for index in range(requests):
        try:
            phase.texts.append(call(index, index % 2 == 1))
        except Exception as exc:
            phase.errors.append(exc)
    phase.completions_ran = server.stats().completions_started - before
    return phase


async def run_async(server: LlamaServerEmulator, call: AsyncCall, requests: int = ASYNC_REQUESTS) -> Phase:
    phase = Phase(requests)
    before = server.stats().completions_started
    indexes = iter(range(requests))

    async def worker() -> None:
        for index in indexes:  # shared: each index taken once
            try:
                phase.texts.append(await call(index, index % 2 == 1))
            except Exception as exc:
                phase.errors.append(exc)

    await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    phase.completions_ran = server.stats().completions_started - before
    return phase


def assert_guarded(phase: Phase, counted: int) -> None:
    """Nothing lost, every answer whole, the server ran each request once, and the guard counted each."""
    assert phase.errors == [], f"{phase.lost} of {phase.asked} lost, e.g. {phase.errors[:2]!r}"
    assert phase.wrong == []
    assert phase.completions_ran == phase.asked
    assert counted == phase.asked


# The stream close 60 ms after the final chunk is a race: a framework that reuses the connection loses a request
# only when it sends one within those 60 ms. An exposed framework's plain phase is run up to this many times until
# it loses one (it lost some in each of the first runs measured; see docs/integrations.md).
PLAIN_TRIES = 3


def plain_sync(server: LlamaServerEmulator, call: SyncCall, *, exposed: bool) -> Phase:
    phase = run_sync(server, call)
    for _ in range(PLAIN_TRIES - 1):
        if not exposed or phase.lost:
            break
        phase = run_sync(server, call)
    return phase


async def plain_async(server: LlamaServerEmulator, call: AsyncCall, *, exposed: bool) -> Phase:
    phase = await run_async(server, call)
    for _ in range(PLAIN_TRIES - 1):
        if not exposed or phase.lost:
            break
        phase = await run_async(server, call)
    return phase


def check_plain(plain: Phase, *, exposed: bool, why: str) -> None:
    """The control: a framework that reuses a stream's pooled connection loses requests without the guard; one
    that closes the response at ``[DONE]`` loses none."""
    if exposed:
        assert plain.lost >= 1, f"plain should lose requests ({why}); lost 0 of {plain.asked}, {PLAIN_TRIES} times"
    else:
        assert plain.errors == [], f"plain should lose nothing ({why}); lost {plain.lost}: {plain.errors[:2]!r}"


def report(framework: str, path: str, plain: Phase, guarded: Phase) -> None:
    """One row of the integrations table (shown with ``pytest -s``)."""
    print(
        f"\nMATRIX {framework} {path}: plain lost {plain.lost} of {plain.asked}; "
        f"guarded lost {guarded.lost} of {guarded.asked}; server ran {guarded.completions_ran}"
    )


@contextlib.contextmanager
def installed(server: LlamaServerEmulator) -> Iterator[llama_guard.Installation]:
    installation = llama_guard.install(origins=[server.url])
    try:
        yield installation
    finally:
        llama_guard.uninstall()
