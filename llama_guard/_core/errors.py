"""`GuardError`: the mixin of every error llama_guard raises, shared by every stack; and `GuardedClasses`, each
stack's ``Guarded<X>`` classes (X: the stack's own error class, so that ``except X`` still catches them)."""

from __future__ import annotations

from typing import Any, Generic, TypeVar

__all__ = ["GuardError", "GuardedClasses"]

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
