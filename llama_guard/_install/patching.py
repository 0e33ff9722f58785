"""`install()` / `uninstall()`: guard the llama-server traffic of every httpx, httpx2, aiohttp and requests/urllib3
client in the process.

For code that creates its HTTP clients itself (the openai SDK, pydantic-ai, LangChain, ...). Opt-in: importing
llama_guard patches nothing. `install()` wraps, with wrapt, the one method through which every pooled request of
a library goes: ``HTTPTransport.handle_request`` and ``AsyncHTTPTransport.handle_async_request`` of httpx and of
httpx2. Post-import hooks apply the wrappers whether those libraries are imported before or after the call. As
methods are looked up on the class, clients created before `install()` are covered too.

For each request the wrapper decides:

- guarded origin: the request goes through a guard (`GuardTransport` or its async/httpx2 twin) kept per transport
  instance, whose inner transport is that instance with its original method;
- any other origin: the original method is called with the original arguments, so the request, the response and
  the bytes on the wire are what they would have been without `install()`;
- a transport that an explicit guard already wraps (`guard(client)`): left alone, never guarded twice.

Without ``origins``, a server is guarded once it has identified itself (``Server: llama.cpp``): its first response
goes through unguarded (its stream's connection is still dropped, as in ``origins="auto"``). Until then a
transport is not touched: its pool (keep-alive expiry, connection hooks) changes only once it sends a request to a
llama-server origin. `uninstall()` puts back what the guards changed on each pool (``internals.restore_pool``).

aiohttp sessions get the guard's middleware at their first request while installed (``aiohttp_sessions.py``);
urllib3's pools, under requests sessions or used directly, the guard of ``llama_guard.requests`` at their first
request to a guarded origin (``requests_pools.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import sys
import threading
import weakref
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Final, NamedTuple

import wrapt

from .._core.decisions import is_streaming_response
from .._core.origins import Origin, OriginRegistry
from .._core.policy import GuardPolicy
from .._core.stats import GuardStats
from .._core.wrapped_transports import is_wrapped_by_a_guard
from .aiohttp_sessions import InstalledSessions, session_request_method
from .requests_pools import MODULES as _REQUESTS_MODULES
from .requests_pools import InstalledPools
from .requests_pools import patch_if_imported as _patch_requests_if_imported
from .requests_pools import unpatch as _unpatch_requests

__all__ = ["Installation", "install", "installation", "normalise_install_origins", "uninstall"]


class _Target(NamedTuple):
    """One method to wrap, and the guard class that serves its guarded requests."""

    module: str
    cls: str
    method: str
    guard: str  # "module:Class"
    base: str  # the transport base class the guard accepts as its inner transport
    drop: str  # "module:Class": the guard's stream wrapper that drops a stream's connection when it closes
    stream: str  # the library's byte-stream base class of this kind (what that wrapper wraps)


_TARGETS = (
    _Target(
        "httpx",
        "HTTPTransport",
        "handle_request",
        "llama_guard._httpx.sync_transport:GuardTransport",
        "BaseTransport",
        "llama_guard._httpx.sync_transport:_SyncDropAfterStream",
        "SyncByteStream",
    ),
    _Target(
        "httpx",
        "AsyncHTTPTransport",
        "handle_async_request",
        "llama_guard._httpx.async_transport:AsyncGuardTransport",
        "AsyncBaseTransport",
        "llama_guard._httpx.async_transport:_AsyncDropAfterStream",
        "AsyncByteStream",
    ),
    _Target(
        "httpx2",
        "HTTPTransport",
        "handle_request",
        "llama_guard._httpx2.sync_transport:GuardTransport",
        "BaseTransport",
        "llama_guard._httpx2.sync_transport:_SyncDropAfterStream",
        "SyncByteStream",
    ),
    _Target(
        "httpx2",
        "AsyncHTTPTransport",
        "handle_async_request",
        "llama_guard._httpx2.async_transport:AsyncGuardTransport",
        "AsyncBaseTransport",
        "llama_guard._httpx2.async_transport:_AsyncDropAfterStream",
        "AsyncByteStream",
    ),
)
_MODULES = tuple(dict.fromkeys(target.module for target in _TARGETS))


class Installation:
    """The process-wide guard that `install()` set up: its settings and the counters of every request it guarded.

    ``origins`` is ``"auto"`` (servers that identify as llama.cpp) or the guarded origins; ``policy`` the settings
    of every guard; ``stats`` one `GuardStats` shared by all of them; ``known_origins()`` the origins currently
    guarded (in ``"auto"`` mode, those learnt so far).
    """

    def __init__(self, origins: str | tuple[Origin, ...], policy: GuardPolicy) -> None:
        self.origins = origins
        self.policy = policy
        self.stats = GuardStats()
        self._registry = OriginRegistry(origins)
        # Each guard sees only the requests the wrapper hands it: all of them llama-server's in list mode, and in
        # "auto" mode it learns (for the whole process) through the shared registry.
        self._guard_policy = dataclasses.replace(policy, origins="auto" if origins == "auto" else "all")
        self._guards: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
        # Each pool a guard was built on, with what it was before (its library's internals module, the state).
        self._pools: weakref.WeakKeyDictionary[Any, tuple[Any, dict[str, Any]]] = weakref.WeakKeyDictionary()
        self._released = False
        self._lock = threading.Lock()
        self._sessions = InstalledSessions(self._guard_policy, self.stats, self._registry)
        # requests sessions and urllib3 pools (requests_pools.py): their pools, hooked at their first guarded request.
        self.urllib3_pools = InstalledPools(self._guard_policy, self.stats, self._registry)

    def __repr__(self) -> str:
        origins = self.origins if isinstance(self.origins, str) else [str(origin) for origin in self.origins]
        return f"<Installation origins={origins!r} {self.policy!r}>"

    def known_origins(self) -> frozenset[Origin]:
        return self._registry.known()

    def _guard_for(self, instance: Any, target: _Target, original: Callable[..., Any]) -> Any:
        """The guard of one transport instance, built at its first llama-server request; None once released."""
        guard = self._guards.get(instance)
        if guard is None:
            with self._lock:
                guard = self._guards.get(instance)
                if guard is None:
                    if self._released:  # uninstall() ran while this request was on its way
                        return None
                    self._remember_pool(instance, target)
                    guard = _build_guard(instance, target, original, self)
                    self._guards[instance] = guard
        return guard

    def leave_unguarded(self, library: str, clients: str, why: str) -> None:
        """``library``'s clients (``clients``, as a warning names them) go out unguarded: logged once per process,
        and in ``stats.unguarded`` (see `StatsSnapshot.unguarded`)."""
        from .._runtime import PROCESS

        self.stats.record_unguarded(library, why)
        PROCESS.warnings.warning(f"install() leaves {clients} unguarded: {why}")

    def _remember_pool(self, instance: Any, target: _Target) -> None:
        internals = importlib.import_module(_INTERNALS[target.module])
        pool = internals.hookable_pool(instance)  # the pool the guard will change, if it can reach one
        if pool is not None and pool not in self._pools:
            self._pools[pool] = (internals, internals.pool_state(pool))

    def _learn_from(self, response: Any, target: _Target, origin: Origin) -> Any:
        """In "auto" mode, a response of an origin not known as llama-server: it may say it is one. Then its
        stream's connection is dropped when the stream closes (that server closes it), as a guard's pass-through
        does; the transport's pool is left as it is until its next request, which a guard serves."""
        self.stats.add(passthrough=1)
        if (
            self._registry.learn(origin, response.headers)
            and self._guard_policy.stream_mode != "off"
            and is_streaming_response(response.headers)
            # Never an HTTP/2 connection: it carries other requests' streams (and is not llama-server's).
            and response.extensions.get("http_version", b"HTTP/1.1") == b"HTTP/1.1"
        ):
            network_stream = response.extensions.get("network_stream")
            if network_stream is not None and isinstance(response.stream, _resolve(target.module, target.stream)):
                # Counted in the origin's account, as the guard's own pass-through does (its STACK: the library).
                account = self.stats.of_origin(target.module, origin)
                response.stream = _resolve(*target.drop.split(":"))(response.stream, network_stream, account)
        return response

    def _undo(self) -> None:
        """Take this installation off everything it changed: aiohttp sessions, and each pool its guards hooked.
        Guards already handling a request finish it; no new one is built."""
        with self._lock:
            self._released = True
            for pool, (internals, state) in list(self._pools.items()):
                internals.restore_pool(pool, state)
            self._pools = weakref.WeakKeyDictionary()
            self._guards = weakref.WeakKeyDictionary()
        self._sessions.release()
        self.urllib3_pools.release()


def _resolve(module_name: str, name: str) -> Any:
    """A class of one of the HTTP libraries or of llama_guard's flavours, imported once it is needed."""
    return getattr(importlib.import_module(module_name), name)


def _build_guard(instance: Any, target: _Target, original: Callable[..., Any], owner: Installation) -> Any:
    guard_class = _resolve(*target.guard.split(":"))
    base = _resolve(target.module, target.base)
    inner = _unpatched_class(base, target.module)(instance, original)
    # One account and one set of learnt origins for the whole process (the guard's own would be per transport).
    return guard_class(inner, policy=owner._guard_policy, stats=owner.stats, origins=owner._registry)


_UNPATCHED_CLASSES: dict[type, type] = {}
_INTERNALS = {"httpx": "llama_guard._httpx.internals", "httpx2": "llama_guard._httpx2.internals"}


def _unpatched_class(base: type, library: str) -> type:
    """A transport (of ``base``'s library and kind) that is one instance with its original, unwrapped method."""
    cls = _UNPATCHED_CLASSES.get(base)
    if cls is None:
        hookable_pool = importlib.import_module(_INTERNALS[library]).hookable_pool

        def __init__(self: Any, instance: Any, original: Callable[..., Any]) -> None:
            # Weak: the per-instance guard lives in a WeakKeyDictionary keyed by the instance, which a strong
            # reference from its value would keep alive for ever.
            self._instance = weakref.ref(instance)
            self._original = original

        def handle(self: Any, request: Any) -> Any:
            # Sync: the response. Async: the original's coroutine, awaited by the guard.
            return self._original(self._live_instance(), request)

        def live_instance(self: Any) -> Any:
            instance = self._instance()
            if instance is None:  # pragma: no cover - the guard is only reachable through its instance
                raise RuntimeError("the transport this guard wrapped no longer exists")
            return instance

        def pool(self: Any) -> Any:
            # So that the guard's hooks and pool fixes (internals.py) reach the instance's real pool.
            return hookable_pool(self._live_instance())

        namespace = {
            "__init__": __init__,
            "__doc__": "The transport instance itself, with the method it had before install().",
            "_live_instance": live_instance,
            "_pool": property(pool),
            "handle_request": handle,
            "handle_async_request": handle,
            # close()/aclose() stay the base class's no-ops: the instance belongs to its client, which closes it.
        }
        cls = _UNPATCHED_CLASSES[base] = type(f"Unpatched{base.__name__}", (base,), namespace)
    return cls


# Process-wide state, changed under _STATE_LOCK only.
_STATE_LOCK = threading.RLock()
_current: Installation | None = None
_handles: dict[_Target, Any] = {}  # target -> the wrapt wrapper installed on its class
_hooked_modules: set[str] = set()  # post-import hooks cannot be removed: register each once, let them check state
_AIOHTTP = "aiohttp"
# Every library install() patches, by module name (also the name users know it by): the CLI and docs name these.
LIBRARIES: Final = (*_MODULES, _AIOHTTP, *_REQUESTS_MODULES)
_aiohttp_handle: tuple[type, str, Any] | None = None  # (class, method, wrapt wrapper) on aiohttp's sessions


def install(*, origins: str | Sequence[str | Origin] | None = None, policy: GuardPolicy | None = None) -> Installation:
    """Guard the llama-server traffic of every httpx, httpx2, aiohttp, requests and urllib3 client in this process;
    returns the `Installation`.

    ``origins``: the llama-server origins to guard, e.g. ``["http://127.0.0.1:8080"]``; ``None`` or ``"auto"``
    (default): every server that identifies itself as llama.cpp. ``policy``: the guard's settings (a
    `GuardPolicy`; its own ``origins`` must stay the default: pass origins here). Requests to any other origin
    are left exactly as they were. Calling it again replaces the settings (harmless with the same ones);
    `uninstall()` restores the original methods.
    """
    global _current
    if policy is None:
        policy = GuardPolicy()
    elif not isinstance(policy, GuardPolicy):
        raise TypeError(f"policy must be a llama_guard.GuardPolicy or None; got {type(policy).__name__}")
    if policy.origins != "all":
        raise ValueError(
            "install() takes the origins to guard as its own argument: install(origins=[...]); "
            f"leave the policy's origins at their default (got policy origins {policy.origins!r})"
        )
    setting = normalise_install_origins(origins)
    with _STATE_LOCK:
        if _current is not None and _current.origins == setting and _current.policy == policy:
            return _current
        if _current is not None:
            _current._undo()  # its pools and sessions get the new settings at their next request
        _current = Installation(setting, policy)
        for module in LIBRARIES:
            if module not in _hooked_modules:
                _hooked_modules.add(module)
                wrapt.register_post_import_hook(_patch_module, module)  # runs now if already imported
        for target in _TARGETS:
            # A module imported while a previous installation was active is already patched; others wait.
            _patch_if_imported(target)
        _patch_aiohttp_if_imported()
        _patch_requests_if_imported(_current)
        return _current


def uninstall() -> None:
    """Undo `install()`: the wrapped methods are restored; clients go back to their library's own behaviour.

    Harmless when nothing is installed. Responses already being read keep the guard they started with.
    """
    global _current, _aiohttp_handle
    with _STATE_LOCK:
        if _current is not None:
            _current._undo()
        _current = None
        if _aiohttp_handle is not None:
            session_class, method, handle = _aiohttp_handle
            with contextlib.suppress(wrapt.WrapperNotOutermostError):  # inert while nothing is installed
                wrapt.unwrap_object(session_class, method, handle, missing_ok=True)
                _aiohttp_handle = None
        _unpatch_requests()
        for target, handle in list(_handles.items()):
            module = importlib.import_module(target.module)
            try:
                wrapt.unwrap_object(getattr(module, target.cls), target.method, handle, missing_ok=True)
            except wrapt.WrapperNotOutermostError:
                # Another library wrapped the method after us; removing ours would remove theirs. Ours stays in
                # the chain but is inert (it passes every call straight through while nothing is installed).
                continue
            del _handles[target]


def installation() -> Installation | None:
    """The active `Installation`, or None when `install()` is not in effect."""
    return _current


def normalise_install_origins(origins: object) -> str | tuple[Origin, ...]:
    if origins is None or origins == "auto":
        return "auto"
    if isinstance(origins, str):
        if origins == "all":
            raise ValueError(
                "install() guards llama-server only, never every origin of the process: give origins=[...] "
                "or leave origins=None to guard servers that identify as llama.cpp"
            )
        origins = [origins]
    # GuardPolicy's validation names what is wrong with an origin; reuse it rather than repeat it.
    normalised = GuardPolicy(origins=origins).origins  # type: ignore[arg-type]
    assert isinstance(normalised, tuple)
    return normalised


def _patch_module(module: Any) -> None:
    """Post-import hook of each of `LIBRARIES`: patch it if an installation is active now."""
    with _STATE_LOCK:
        for target in _TARGETS:
            if target.module == module.__name__:
                _patch_if_imported(target)
        if module.__name__ == _AIOHTTP:
            _patch_aiohttp_if_imported()
        if module.__name__ in _REQUESTS_MODULES:
            _patch_requests_if_imported(_current)


def _patch_aiohttp_if_imported() -> None:
    global _aiohttp_handle
    if _current is None or sys.modules.get(_AIOHTTP) is None or _aiohttp_handle is not None:  # None: import blocked
        return
    target = session_request_method()
    if isinstance(target, str):
        _current.leave_unguarded("aiohttp", "aiohttp's sessions", target)
        return
    session_class, method = target
    _aiohttp_handle = (session_class, method, wrapt.wrap_function_wrapper(session_class, method, _aiohttp_wrapper))


def _aiohttp_wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A session's request is about to start (the coroutine is not created yet): the session gets the guard first."""
    current = _current
    if current is not None and instance is not None:
        current._sessions.adopt(instance)
    return wrapped(*args, **kwargs)


def _patch_if_imported(target: _Target) -> None:
    module = sys.modules.get(target.module)
    if _current is None or module is None or target in _handles:
        return
    cls = getattr(module, target.cls, None)
    if cls is None:  # pragma: no cover - a library version without this class
        return
    original = cls.__dict__[target.method]
    _handles[target] = wrapt.wrap_function_wrapper(cls, target.method, _wrapper_for(target, original))


def _wrapper_for(target: _Target, original: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        current = _current
        if current is None or instance is None or is_wrapped_by_a_guard(instance):
            return wrapped(*args, **kwargs)
        request = args[0] if args else kwargs.get("request")
        url = getattr(request, "url", None)
        if url is None:
            return wrapped(*args, **kwargs)
        origin = Origin.of_url(url)
        if current._registry.is_llama(origin):
            guard = current._guard_for(instance, target, original)
            if guard is not None:
                return getattr(guard, target.method)(request)
        elif current._registry.learns:
            # Not a guard's: the transport and its pool stay as they are until it talks to llama-server.
            if target.method == "handle_async_request":
                return _learn_async(current, wrapped(*args, **kwargs), target, origin)
            return current._learn_from(wrapped(*args, **kwargs), target, origin)
        return wrapped(*args, **kwargs)

    return wrapper


async def _learn_async(current: Installation, sent: Awaitable[Any], target: _Target, origin: Origin) -> Any:
    return current._learn_from(await sent, target, origin)
