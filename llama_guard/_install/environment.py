"""Zero-code activation: `install()` configured from the environment, for applications one cannot edit.

``LLAMA_GUARD_ORIGINS`` holds ``auto`` (servers that identify as llama.cpp) or comma-separated origins
(``http://127.0.0.1:8080,http://10.0.0.5:8080``). ``llama-guard run -- python app.py`` sets it and puts
`llama_guard/_install/bootstrap` on ``PYTHONPATH``, whose ``sitecustomize`` calls `install_from_environment()` as
the child Python starts.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from .patching import Installation, install

__all__ = ["ORIGINS_VARIABLE", "BOOTSTRAP_DIRECTORY", "install_from_environment", "origins_from_text"]

ORIGINS_VARIABLE = "LLAMA_GUARD_ORIGINS"
BOOTSTRAP_DIRECTORY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bootstrap")


def origins_from_text(text: str) -> str | list[str]:
    """``"auto"`` or a comma-separated list of origins, as `install()` takes them; ValueError names the problem."""
    text = text.strip()
    if text.lower() == "auto":
        return "auto"
    origins = [item.strip() for item in text.split(",") if item.strip()]
    if not origins:
        raise ValueError("it names no origin; give 'auto' or origins such as 'http://127.0.0.1:8080'")
    return origins


def install_from_environment(environ: Mapping[str, str] | None = None) -> Installation | None:
    """`install()` with the origins in ``LLAMA_GUARD_ORIGINS``; None (and nothing patched) when it is unset."""
    environ = os.environ if environ is None else environ
    text = environ.get(ORIGINS_VARIABLE)
    if text is None:
        return None
    try:
        return install(origins=origins_from_text(text))
    except ValueError as exc:
        raise ValueError(f"{ORIGINS_VARIABLE}={text!r}: {exc}") from None
