"""Every access the guard makes to private attributes of urllib3, in one place (as ``_httpx/internals.py`` and
``_aiohttp/internals.py`` do for theirs): urllib3 2.x, the ``requests`` extra's pin. A ``PoolManager`` makes its pools
in ``_new_pool``, and a pool works out a request's timeout in ``_get_timeout``."""

from __future__ import annotations

import functools
from typing import Any

from urllib3.util.timeout import Timeout

__all__ = ["pool_timeout", "wrap_new_pool"]


def pool_timeout(pool: Any, timeout: Any) -> Timeout:
    """The `Timeout` a pool's ``urlopen`` would use for ``timeout`` (the call's, or its default)."""
    result: Timeout = pool._get_timeout(timeout)
    return result


def wrap_new_pool(manager: Any, new_pool: Any, *args: Any) -> None:
    """Route a ``PoolManager``'s ``_new_pool`` (on the instance) through ``new_pool(manager, original, *args, ...)``."""
    manager._new_pool = functools.partial(new_pool, manager, type(manager)._new_pool, *args)
