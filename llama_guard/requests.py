"""llama_guard for requests and urllib3 (``pip install llama-guard[requests]``: requests >= 2.31, urllib3 2.x)::

    import requests
    from llama_guard.requests import GuardAdapter, result_of

    session = requests.Session()
    adapter = GuardAdapter()
    session.mount("http://", adapter)
    session.mount("https://", adapter)
    response = session.post("http://127.0.0.1:8080/v1/chat/completions", json={...})
    print(response.json(), result_of(response), adapter.stats)

Or ``llama_guard.guard(session)`` on a session that exists (its adapters keep their settings), or
``llama_guard.install()`` for every session, ``requests.post`` and urllib3 ``PoolManager`` of the process. The same
`GuardPolicy`, `GuardStats` and `GuardResult` as the other stacks; errors subclass requests' own (`ProbeTimeout`,
`ProbeError`, `FirstByteTimeout`, and ``Guarded<X>`` for a requests error X the guard gave up on), all of them
`llama_guard.GuardError`. urllib3 used directly sees urllib3's classes (``Guarded<MaxRetryError>`` and the like,
whose ``reason`` is `Urllib3ProbeTimeout`, `Urllib3ProbeError` or `Urllib3FirstByteTimeout` for the guard's own).
"""

from ._core.extras import missing_extra

try:
    import requests as _requests  # noqa: F401
    import urllib3 as _urllib3
except ModuleNotFoundError as exc:  # pragma: no cover - depends on the environment (scripts/smoke_no_extras.py)
    missing_extra(exc, feature="llama_guard.requests", extra="requests", modules=("requests", "urllib3"))

from ._install.requests_pools import unsupported_urllib3

if unsupported_urllib3(_urllib3) is not None:  # pragma: no cover - depends on the environment
    raise ImportError(f"llama_guard.requests: {unsupported_urllib3(_urllib3)}")

from . import _public
from ._core.errors import GuardError
from ._core.policy import GuardPolicy
from ._core.result import GuardResult
from ._core.stats import GuardStats
from ._requests.adapter import GuardAdapter, guard_session, request_options, result_of
from ._requests.exceptions import (
    FirstByteTimeout,
    ProbeError,
    ProbeTimeout,
    Urllib3FirstByteTimeout,
    Urllib3ProbeError,
    Urllib3ProbeTimeout,
)

__all__ = [
    "FirstByteTimeout",
    "GuardAdapter",
    "GuardError",
    "GuardPolicy",
    "GuardResult",
    "GuardStats",
    "ProbeError",
    "ProbeTimeout",
    "Urllib3FirstByteTimeout",
    "Urllib3ProbeError",
    "Urllib3ProbeTimeout",
    "guard_session",
    "request_options",
    "result_of",
]

_public.present_as_public(globals())
