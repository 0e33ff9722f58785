"""`GuardError`: the mixin of every error llama_guard raises, shared by every stack; and `GuardedClasses`, each
stack's ``Guarded<X>`` classes (X: the stack's own error class, so that ``except X`` still catches them)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Generic, TypeVar

if TYPE_CHECKING:
    from .request_machine import Fail

__all__ = ["GuardError", "GuardedClasses", "caller_error"]

E = TypeVar("E", bound=BaseException)


class GuardError(Exception):
    """Mixin of every error raised by llama_guard. ``except httpx.<Class>`` still catches them.

    Attributes:
        attempts: attempts made for the request, the first included.
        elapsed: seconds from the first attempt to the error.
        history: one line per failed attempt: what failed and what the guard decided.
    """

    attempts: int = 1
    elapsed: float = 0.0
    history: tuple[str, ...] = ()


class GuardedClasses(Generic[E]):
    """``Guarded<X>`` for each error class X of one stack: a subclass of ``mixins``, `GuardError` and X, made once.
    Each is also set in ``namespace`` (its module's globals, ``module``), so that it pickles and shows a stable
    name."""

    __slots__ = ("_made", "_mixins", "_module", "_namespace")

    def __init__(self, namespace: dict[str, Any], *, mixins: tuple[type, ...] = ()) -> None:
        self._namespace = namespace
        self._module: str = namespace["__name__"]
        self._mixins = mixins
        self._made: dict[type[E], type[E]] = {}

    def of(self, base: type[E]) -> type[E]:
        """``Guarded<base>``, or ``base`` itself when it is one of the guard's classes already."""
        if issubclass(base, GuardError):
            return base
        cls = self._made.get(base)
        if cls is None:
            name = f"Guarded{base.__name__}"
            cls = type(name, (*self._mixins, GuardError, base), {"__module__": self._module, "__qualname__": name})
            self._namespace[name] = cls
            self._made[base] = cls
        return cls


def caller_error(
    error: E,
    fail: Fail | None,
    *,
    text: Callable[[BaseException], str],
    guarded: Callable[..., E],
) -> E:
    """The caller's error once the guard stops: ``error`` as it is (``fail`` None: not the network's), or the guard's
    of the same class (``guarded``, the stack's `GuardedClasses` maker) whose message is the error's own (``text``)
    followed by the guard's account, caused by ``error``."""
    if fail is None:
        return error
    message = f"{text(error) or type(error).__name__} {fail.message}"
    made = guarded(error, message=message, attempts=fail.attempts, elapsed=fail.elapsed, history=fail.history)
    made.__cause__ = error
    return made
