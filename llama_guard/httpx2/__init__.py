"""llama_guard for httpx2, the maintained fork of httpx (used by openai 3.x, anthropic 2.x, pydantic-ai 2.x).

    import httpx2
    import llama_guard.httpx2

    client = httpx2.Client(base_url="http://127.0.0.1:8080", transport=llama_guard.httpx2.GuardTransport())

Needs the extra ``pip install 'llama-guard[httpx2]'``. Same behaviour, settings (`llama_guard.GuardPolicy`),
results and stats as the httpx flavour: its transports are generated from the same source by
``scripts/unasync.py``. Errors are instances of the httpx2 class they stand for and of `llama_guard.GuardError`.
"""

from .._core.extras import missing_extra

try:
    import httpcore2 as _httpcore2  # noqa: F401
    import httpx2 as _httpx2  # noqa: F401
except ModuleNotFoundError as exc:  # pragma: no cover - depends on the environment (scripts/smoke_no_extras.py)
    missing_extra(exc, feature="llama_guard.httpx2", extra="httpx2", modules=("httpx2", "httpcore2"))

from .. import _public
from .._core.errors import GuardError
from .._core.policy import GuardPolicy
from .._httpx2.async_transport import AsyncGuardTransport
from .._httpx2.dual_transport import DualGuardTransport
from .._httpx2.exceptions import FirstByteTimeout, ProbeError, ProbeTimeout
from .._httpx2.sync_transport import GuardTransport
from .._install.guard import guard

__all__ = [
    # httpx2's own transports and errors (its classes' subclasses)
    "AsyncGuardTransport",
    "DualGuardTransport",
    "GuardTransport",
    "FirstByteTimeout",
    "ProbeError",
    "ProbeTimeout",
    # the same as llama_guard's
    "GuardError",
    "GuardPolicy",
    "guard",
]

_public.present_as_public(globals())
