"""The httpx2 flavour, GENERATED from ``llama_guard/_httpx`` by ``scripts/unasync.py``.

Its public face is ``llama_guard.httpx2``."""
