"""A guard's routes: what it remembers per URL (scheme, host, port) after a first request gives every later
request of the route the plan a guard without that memory would make."""

from __future__ import annotations

import httpx
import pytest

from llama_guard import GuardPolicy, GuardStats
from llama_guard._core.guard import Guard, RequestPlan
from llama_guard._core.origins import Origin, OriginRegistry
from llama_guard._httpx.internals import request_parts

from ._machines import fresh_origins

POLICIES = {
    "default": GuardPolicy(),
    "reuse": GuardPolicy(connection="reuse"),
    "first-byte deadline": GuardPolicy(connection="close", first_byte_timeout=5.0),
}
URLS = (
    "http://10.1.2.3:8080/v1/chat/completions",
    "http://127.0.0.1:8080/v1/chat/completions",
    "http://bücher.example:8080/v1/chat/completions",  # the parts carry the IDNA spelling, the URL the Unicode one
    "https://[::1]/completion",
)


def _guard(policy: GuardPolicy) -> Guard:
    return Guard(
        policy=policy,
        stats=GuardStats(),
        origins=OriginRegistry(policy.origins),
        stack="httpx",
        process=fresh_origins(),
    )


def _plan(guard: Guard, url: str, body: bytes | None, *, hooks_follow: bool = True) -> RequestPlan:
    """As the httpx transport asks, origin not worked out (every origin guarded)."""
    request = httpx.Request("POST", url, content=body if body is not None else b"")
    scheme, host, port, _ = request_parts(True)(request)
    return guard.plan(
        request,
        scheme=scheme,
        host=host,
        port=port,
        origin=None,
        overrides=None,
        body=body,
        may_close=True,
        hooks_follow=hooks_follow,
    )


def _decided(plan: RequestPlan) -> tuple[object, ...]:
    return (plan.origin, plan.stats, plan.connection, plan.as_is, plan.close_connection, plan.drops_streams)


@pytest.mark.parametrize("policy", POLICIES.values(), ids=POLICIES.keys())
@pytest.mark.parametrize("url", URLS)
@pytest.mark.parametrize("hooks_follow", [True, False])
def test_a_remembered_route_plans_as_a_fresh_guard_would(policy: GuardPolicy, url: str, hooks_follow: bool) -> None:
    guard = _guard(policy)
    first = _plan(guard, url, b'{"stream": false}', hooks_follow=hooks_follow)
    assert first.origin == Origin.of_url(httpx.URL(url))
    for body in (b'{"n_predict": 4}', None, b'{"stream": true}', b"{}"):
        remembered = _plan(guard, url, body, hooks_follow=hooks_follow)
        fresh = _plan(_guard(policy), url, body, hooks_follow=hooks_follow)
        # Remembered once the strategy is final ("auto" measures a remote origin first: then nothing is).
        assert (remembered.given_origin is not None) is first.connection.final
        assert _decided(remembered)[0] == _decided(fresh)[0] == Origin.of_url(httpx.URL(url))
        assert _decided(remembered)[2:] == _decided(fresh)[2:]
        assert remembered.stats is first.stats  # the origin's one account
