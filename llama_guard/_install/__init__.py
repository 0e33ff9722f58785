"""`install()`, `guard()`, and the start-up hook of ``llama-guard run`` (``bootstrap/sitecustomize.py``)."""

from .patching import Installation, install, installation, uninstall

__all__ = ["Installation", "install", "installation", "uninstall"]
