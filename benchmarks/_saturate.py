"""Keep every inference slot of a llama-server busy, so the burst meets a server whose cores are saturated.

Why: a server busy with honest work answers ``GET /health`` later; an adaptive probe deadline must follow that
instead of giving up on healthy connections (issue 15). Each worker generates completions back to back on its own
connection (held for the whole run, so it takes one of the pool's threads, as a long-lived client would) and
counts the tokens the server reports in ``usage``, so that the burst's own completions can still be counted from
``tokens_predicted_total``.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx

__all__ = ["Saturator"]

CHAT = "/v1/chat/completions"


class Saturator:
    """``slots`` workers generating ``max_tokens``-token completions back to back until :meth:`stop`."""

    def __init__(self, url: str, slots: int, *, max_tokens: int = 1024) -> None:
        self.url = url
        self.slots = slots
        self.max_tokens = max_tokens
        self.tokens = 0  # completion tokens the server reported for the saturating requests
        self.completions = 0
        self.errors = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def _body(self) -> dict[str, Any]:
        return {
            "messages": [{"role": "user", "content": "tell me a long story"}],
            "max_tokens": self.max_tokens,
            "ignore_eos": True,
            "temperature": 0.0,
        }

    def _work(self) -> None:
        with httpx.Client(base_url=self.url, timeout=120.0) as client:
            while not self._stop.is_set():
                try:
                    response = client.post(CHAT, json=self._body())
                    tokens = int(response.json()["usage"]["completion_tokens"])
                except (httpx.HTTPError, ValueError, KeyError, TypeError):
                    with self._lock:
                        self.errors += 1
                    continue
                with self._lock:
                    self.tokens += tokens
                    self.completions += 1

    def start(self, busy: Any, timeout: float = 20.0) -> Saturator:
        """Start the workers; return once ``busy()`` (the server's ``requests_processing``) reaches ``slots``."""
        for _ in range(self.slots):
            thread = threading.Thread(target=self._work, daemon=True)
            thread.start()
            self._threads.append(thread)
        deadline = time.monotonic() + timeout
        while busy() < self.slots:
            if time.monotonic() >= deadline:
                self.stop()
                raise RuntimeError(f"the server did not get {self.slots} slots busy within {timeout:g} s")
            time.sleep(0.05)
        return self

    def stop(self) -> int:
        """Stop after the completions in flight; return the completion tokens of every saturating request."""
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=180.0)
        return self.tokens
