"""A server that is loading its model (503 "Loading model" everywhere, no Retry-After, as llama-server answers) is
waited for up to max_loading_wait, spending none of the request's attempts, on both connection strategies."""

from __future__ import annotations

import math
import threading
import time

import pytest

from llama_guard import GuardPolicy
from llama_guard._core.retry_pacing import STATUS_BACKOFF
from llama_guard.testing import Fault, LlamaServerEmulator

from ._drivers import FLAVORS, close_driver, make_driver, run_scenario
from .test_adaptive_probe import one_request
from .test_mechanisms import CHAT, chat

LOADING_SECONDS = 2.0


async def loading_then_one_request(
    flavor: str, server: LlamaServerEmulator, policy: GuardPolicy, loading_for: float | None
) -> object:
    """The server loads for ``loading_for`` seconds (None: for ever) while one completion is asked for."""
    driver = make_driver(flavor, guarded=True, base_url=server.url, policy=policy)
    server.set_loading(True)
    loaded = None if loading_for is None else threading.Timer(loading_for, server.set_loading, args=(False,))
    if loaded is not None:
        loaded.start()
    try:
        await driver.request("POST", CHAT, json=chat(stream=False))
    finally:
        if loaded is not None:
            loaded.join()
        await close_driver(driver)
    return driver


@pytest.mark.parametrize("connection", ["auto", "reuse"])
@pytest.mark.parametrize("flavor", FLAVORS)
def test_a_loading_server_is_waited_for_without_spending_attempts(flavor: str, connection: str) -> None:
    """Loading for 2 s with max_attempts=1: the request still gets its 200 (the 503s spent no attempt), run once."""
    policy = GuardPolicy(connection=connection, max_attempts=1)  # type: ignore[arg-type]
    with LlamaServerEmulator() as server:
        driver = run_scenario(flavor, loading_then_one_request, flavor, server, policy, LOADING_SECONDS)
        ran = server.stats().completions_started
    (outcome,) = driver.outcomes  # type: ignore[attr-defined]
    assert outcome.status == 200, outcome
    assert outcome.first_byte >= LOADING_SECONDS * 0.9  # it did wait for the load, not return early
    assert outcome.result.attempts > 1  # the 503s were retried
    assert ran == 1


@pytest.mark.parametrize("flavor", FLAVORS)
def test_the_loading_wait_is_bounded(flavor: str) -> None:
    """A server that never finishes loading: the caller gets the 503 once max_loading_wait has passed, and the
    error history says why."""
    policy = GuardPolicy(max_loading_wait=0.6, backoff_max=0.2)
    with LlamaServerEmulator() as server:
        started = time.monotonic()
        driver = run_scenario(flavor, loading_then_one_request, flavor, server, policy, None)
        elapsed = time.monotonic() - started
        ran = server.stats().completions_started
    (outcome,) = driver.outcomes  # type: ignore[attr-defined]
    assert outcome.status == 503
    assert 0.4 <= elapsed < 5.0
    assert ran == 0


@pytest.mark.parametrize(
    ("retry_after", "backoff_max"),
    [pytest.param(0, 2.0, id="retry-after-0"), pytest.param(None, 0.0, id="backoff_max-0")],
)
@pytest.mark.parametrize("flavor", FLAVORS)
def test_a_loading_server_is_polled_at_most_twice_a_second(
    flavor: str, retry_after: int | None, backoff_max: float
) -> None:
    """Every answer 503, with Retry-After: 0 (a proxy in front of a loading server) or without it under
    backoff_max=0: the first retry goes at once, as asked; after that one attempt per 0.5 s at most, and a last one
    as max_loading_wait passes. Before, the guard sent thousands of attempts in the wait (17,297 in 120 s from one
    request on the requests stack; 323 in 2 s with backoff_max=0)."""
    wait = 1.2
    policy = GuardPolicy(max_loading_wait=wait, backoff_max=backoff_max)
    params = {} if retry_after is None else {"retry_after": retry_after}
    with LlamaServerEmulator() as server:
        server.inject(Fault.STATUS_503, path=CHAT, count=None, **params)
        started = time.monotonic()
        driver = run_scenario(flavor, one_request, flavor, server.url, policy, 10.0)
        elapsed = time.monotonic() - started
        sent = server.stats().requests_to(CHAT)
    (outcome,) = driver.outcomes  # type: ignore[attr-defined]
    assert outcome.status == 503
    # At once, then at most one per 0.5 s of the wait, the last at its end: slowness can only lower the count.
    assert 2 <= outcome.result.attempts == sent <= 2 + math.ceil(wait / STATUS_BACKOFF), outcome.result
    assert elapsed >= wait  # the caller waited max_loading_wait out


def test_max_loading_wait_zero_returns_the_503_at_once() -> None:
    """max_loading_wait=0: the first 503 goes to the caller, with one attempt."""
    with LlamaServerEmulator() as server:
        driver = run_scenario("sync", loading_then_one_request, "sync", server, GuardPolicy(max_loading_wait=0), None)
    (outcome,) = driver.outcomes  # type: ignore[attr-defined]
    assert outcome.status == 503
    assert outcome.result.attempts == 1


@pytest.mark.slow  # 20 loads of 2 s each
@pytest.mark.parametrize("connection", ["auto", "reuse"])
def test_twenty_loads_all_answered_once(connection: str) -> None:
    """Issue 21's figure: loading 2 s then 200, no Retry-After, default policy: 20 of 20 runs return 200, and the
    server ran each completion once."""
    statuses = []
    with LlamaServerEmulator() as server:
        for _ in range(20):
            policy = GuardPolicy(connection=connection)  # type: ignore[arg-type]
            driver = run_scenario("sync", loading_then_one_request, "sync", server, policy, LOADING_SECONDS)
            statuses.extend(o.status for o in driver.outcomes)  # type: ignore[attr-defined]
        ran = server.stats().completions_started
    assert statuses == [200] * 20
    assert ran == 20
