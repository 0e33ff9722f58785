"""llama_guard for aiohttp (``pip install llama-guard[aiohttp]``: aiohttp 3.12.4 to 3.14)::

    from llama_guard.aiohttp import guarded_session, guard_of, guard_result

    async with guarded_session("http://127.0.0.1:8080") as session:
        async with session.post("/v1/chat/completions", json={...}) as response:
            print(await response.json(), guard_result(response))
        print(guard_of(session).stats)

Or the parts: ``aiohttp.ClientSession(connector=GuardConnector(), middlewares=[GuardMiddleware()])``; or
`guard_session(session)` on a session that exists. The same `GuardPolicy`, `GuardStats` and `GuardResult` as the
httpx transports; errors subclass aiohttp's (`ProbeTimeout`, `ProbeError`, `FirstByteTimeout`, and
``Guarded<X>`` for an aiohttp error X the guard gave up on), all of them `llama_guard.GuardError`.
"""

from ._core.extras import missing_extra

try:
    import aiohttp as _aiohttp  # noqa: F401
except ModuleNotFoundError as exc:  # pragma: no cover - depends on the environment (scripts/smoke_no_extras.py)
    missing_extra(exc, feature="llama_guard.aiohttp", extra="aiohttp", modules=("aiohttp",))

from ._aiohttp.internals import unsupported_version

if (_unsupported := unsupported_version()) is not None:
    raise ImportError(f"llama_guard.aiohttp: {_unsupported}")

from . import _public
from ._aiohttp.connector import GuardConnector
from ._aiohttp.exceptions import FirstByteTimeout, ProbeError, ProbeTimeout
from ._aiohttp.internals import TESTED_VERSIONS
from ._aiohttp.middleware import GuardMiddleware, guard_result, request_options
from ._aiohttp.session import guard_of, guard_session, guarded_session, unguard_session
from ._core.errors import GuardError
from ._core.llama_server import CLIENT_KEEPALIVE as KEEPALIVE_TIMEOUT
from ._core.policy import GuardPolicy
from ._core.result import GuardResult
from ._core.stats import GuardStats

__all__ = [
    "KEEPALIVE_TIMEOUT",
    "TESTED_VERSIONS",
    "FirstByteTimeout",
    "GuardConnector",
    "GuardError",
    "GuardMiddleware",
    "GuardPolicy",
    "GuardResult",
    "GuardStats",
    "ProbeError",
    "ProbeTimeout",
    "guard_of",
    "guard_result",
    "guard_session",
    "guarded_session",
    "request_options",
    "unguard_session",
]

_public.present_as_public(globals())
