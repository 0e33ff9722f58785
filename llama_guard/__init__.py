"""llama_guard: transports for httpx, httpx2, aiohttp and requests that make pooled HTTP clients safe against
llama.cpp's llama-server.

    import httpx, llama_guard
    client = httpx.Client(transport=llama_guard.GuardTransport(), base_url="http://127.0.0.1:8080")
    # or: client = llama_guard.guard(httpx.Client(base_url="http://127.0.0.1:8080"))

See docs/ for how it works and every setting.
"""

from . import _public
from ._core.errors import GuardError
from ._core.origins import Origin
from ._core.policy import GuardPolicy
from ._core.result import GuardResult
from ._core.stats import GuardStats, LatencySummary, StatsSnapshot
from ._httpx.async_transport import AsyncGuardTransport
from ._httpx.dual_transport import DualGuardTransport
from ._httpx.exceptions import FirstByteTimeout, ProbeError, ProbeTimeout
from ._httpx.sync_transport import GuardTransport
from ._install.guard import guard
from ._install.patching import Installation, install, uninstall
from ._metrics.sources import result_of, stats_of

__version__ = "0.1.0"

__all__ = [
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


_public.present_as_public(globals())
