"""The optional extras (``pip install 'llama-guard[aiohttp]'``): a missing one is named when its feature is asked for.

The default install has neither aiohttp nor httpx2; nothing that every user runs (`install`, `uninstall`, `guard`,
``llama-guard run``) imports them. Importing a flavour that needs one (``llama_guard.aiohttp``,
``llama_guard.httpx2``) without it raises `ModuleNotFoundError` saying which extra to install.
"""

from __future__ import annotations

from typing import NoReturn

__all__ = ["missing_extra", "missing_extra_message"]


def missing_extra_message(feature: str, extra: str, module: str) -> str:
    return (
        f"{feature} needs {module}, which is not installed: pip install 'llama-guard[{extra}]' "
        f"(or, from a checkout of llama_guard, pip install -e '.[{extra}]')"
    )


def missing_extra(exc: ModuleNotFoundError, *, feature: str, extra: str, modules: tuple[str, ...]) -> NoReturn:
    """Re-raise ``exc`` (caught importing ``feature``'s libraries) naming ``extra``, when the missing module is one
    of those the extra brings (``modules``); any other missing module is a broken install: ``exc`` as it is."""
    missing = (exc.name or "").partition(".")[0]
    if missing not in modules:
        raise exc
    raise ModuleNotFoundError(missing_extra_message(feature, extra, missing), name=exc.name) from exc
