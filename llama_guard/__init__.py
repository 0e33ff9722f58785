"""llama_guard: httpx transports that make pooled HTTP clients safe against llama.cpp's llama-server.

    import httpx, llama_guard
    client = httpx.Client(transport=llama_guard.GuardTransport(), base_url="http://127.0.0.1:8080")
    # or: client = llama_guard.guard(httpx.Client(base_url="http://127.0.0.1:8080"))

See docs/ for how it works and every setting.
"""

from ._async_transport import AsyncGuardTransport
from ._exceptions import FirstByteTimeout, ProbeError, ProbeTimeout
from ._guard import guard
from ._guard_error import GuardError
from ._install import Installation, install, uninstall
from ._origins import Origin
from ._policy import GuardPolicy
from ._result import GuardResult
from ._stats import GuardStats, LatencySummary, StatsSnapshot
from ._sync_transport import GuardTransport

__version__ = "0.1.0"

__all__ = [
    "AsyncGuardTransport",
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
    "uninstall",
]

# Public classes present themselves as llama_guard.X (in reprs, tracebacks and docs), as httpx's do.
for _name in __all__:
    _value = globals()[_name]
    if isinstance(_value, type):
        _value.__module__ = "llama_guard"
del _name, _value
