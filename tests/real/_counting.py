"""What a real llama-server ran, counted from its ``/metrics`` (``--metrics``), and whether a body is whole.

b11434 has no request counter, but ``llamacpp:tokens_predicted_total`` grows by exactly ``max_tokens`` for each
completion that asks for ``"ignore_eos": true`` (streamed or not; see ``test_real_server.py``). Every completion
these tests send asks for that, so tokens / ``max_tokens`` is the number of completions the server ran: a request
the guard sent twice would show up as one completion too many.
"""

from __future__ import annotations

import json
import time
from typing import Any

from llama_guard.testing._real_server import RealLlamaServer

from ._raw_http import chat_body


def completion(*, stream: bool, max_tokens: int, tag: str = "hello there") -> dict[str, Any]:
    """A chat completion that generates exactly ``max_tokens`` tokens (``ignore_eos``)."""
    return chat_body(stream=stream, max_tokens=max_tokens, messages=[{"role": "user", "content": tag}])


def settled_tokens(server: RealLlamaServer, *, timeout: float = 15.0) -> float:
    """``tokens_predicted_total`` once the server is idle: nothing processing and the counter unchanged across
    two reads 0.25 s apart (a completion a client gave up on may still be running)."""
    deadline = time.monotonic() + timeout
    last: float | None = None
    while True:
        metrics = server.metrics()
        tokens = metrics["tokens_predicted_total"]
        if metrics["requests_processing"] == 0 and tokens == last:
            return tokens
        if time.monotonic() >= deadline:
            raise AssertionError(f"llama-server did not settle within {timeout:g} s: {metrics}")
        last = tokens
        time.sleep(0.25)


def completions_ran(server: RealLlamaServer, max_tokens: int, *, since_tokens: float = 0.0) -> float:
    """Completions of ``max_tokens`` tokens the server ran since ``since_tokens`` (a whole number unless one was
    cut short)."""
    return (settled_tokens(server) - since_tokens) / max_tokens


def body_problem(body: bytes, *, stream: bool, max_tokens: int) -> str | None:
    """Why ``body`` is not a complete completion of ``max_tokens`` tokens, or None when it is."""
    text = body.decode("utf-8", "replace")
    try:
        if not stream:
            document = json.loads(text)
            if document["usage"]["completion_tokens"] != max_tokens:
                return f"usage {document['usage']}"
            if document["choices"][0]["finish_reason"] != "length":
                return f"finish_reason {document['choices'][0]['finish_reason']!r}"
            return None
        events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
        if not events or events[-1] != "[DONE]":
            return f"stream does not end with [DONE]: {events[-2:]}"
        chunks = [json.loads(event) for event in events[:-1]]
        last = chunks[-1]
        if last["choices"][0]["finish_reason"] != "length":
            return f"last chunk has finish_reason {last['choices'][0]['finish_reason']!r}"
        if last["timings"]["predicted_n"] != max_tokens:
            return f"last chunk timings {last['timings']}"
        if len({chunk["id"] for chunk in chunks}) != 1:
            return "chunks of more than one completion"
        return None
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc} in {text[:200]!r}"
