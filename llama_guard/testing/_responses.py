"""What llama-server puts on the wire: status lines, headers, JSON and SSE.

Framing is copied from cpp-httplib's ``Server::write_response_core``:

* every response carries the server's default header ``Server: llama.cpp``;
* llama-server's pre-routing handler adds
  ``Access-Control-Allow-Origin: <the request's Origin>`` -- an *empty* value
  when the request had no ``Origin`` (cpp-httplib accepts empty field values);
* ``Connection: close`` when this is the last request cpp-httplib will serve on
  the connection (``keepalive_max`` reached), when the request said
  ``Connection: close`` (exact, case-sensitive value), or when the status is
  ``>= 400`` ("don't leave connections open after errors"); otherwise
  ``Keep-Alive: timeout=5, max=100`` -- also on the streams after which it
  closes the connection anyway (defect 1);
* a body becomes ``Content-Length``; a chunked content provider becomes
  ``Transfer-Encoding: chunked`` with lower-case hex sizes, one chunk per
  ``sink.write`` and a bare ``0\\r\\n\\r\\n`` terminator;
* streams add llama-server's ``X-Accel-Buffering: no``.

cpp-httplib keeps headers in a hash map, so its order is arbitrary; the
emulator writes them sorted case-insensitively (cpp-httplib's older ``std::multimap``
order), which is deterministic and just as legal.

JSON is compact (``nlohmann::json::dump()`` without indent).  Error bodies use
the key order measured on b11434:
``{"error":{"code":503,"message":"Loading model","type":"unavailable_error"}}``.
"""

from __future__ import annotations

import json
import random
import string
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "Completion",
    "build_head",
    "chunk",
    "error_body",
    "dumps",
    "health_body",
    "models_body",
    "props_body",
    "slots_body",
]

LAST_CHUNK = b"0\r\n\r\n"
JSON_TYPE = "application/json; charset=utf-8"
SSE_TYPE = "text/event-stream"

REASONS: Mapping[int, str] = {
    100: "Continue",
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    404: "Not Found",
    413: "Payload Too Large",
    414: "URI Too Long",
    429: "Too Many Requests",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    501: "Not Implemented",
    503: "Service Unavailable",
}

# A fixed "vocabulary" so generated text is deterministic and easy to assert.
WORDS = ("The", " quick", " brown", " fox", " jumps", " over", " the", " lazy", " dog", ".")

N_CTX = 4096


def dumps(value: object) -> str:
    """Compact JSON, UTF-8 kept as is (like ``json::dump()``)."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def token_text(index: int) -> str:
    return WORDS[index % len(WORDS)]


def generated_text(n_tokens: int) -> str:
    """The full text the emulator generates for ``n_tokens`` tokens."""
    return "".join(token_text(i) for i in range(n_tokens))


def random_id(length: int = 32) -> str:
    """llama-server's ``random_string()``: 32 alphanumerics."""
    alphabet = string.ascii_letters + string.digits
    return "".join(random.choices(alphabet, k=length))


def build_head(status: int, headers: Sequence[tuple[str, str]]) -> bytes:
    """Status line + headers (sorted as documented) + blank line."""
    reason = REASONS.get(status, "Unknown")
    lines = [f"HTTP/1.1 {status} {reason}\r\n"]
    for name, value in sorted(headers, key=lambda item: item[0].lower()):
        lines.append(f"{name}: {value}\r\n")
    lines.append("\r\n")
    return "".join(lines).encode("latin-1")


def chunk(data: bytes) -> bytes:
    """One ``sink.write``: lower-case hex size, CRLF, data, CRLF."""
    return b"%x\r\n%s\r\n" % (len(data), data)


def error_body(code: int, message: str, error_type: str) -> bytes:
    return dumps({"error": {"code": code, "message": message, "type": error_type}}).encode()


def health_body() -> bytes:
    return dumps({"status": "ok"}).encode()


def _meta() -> dict[str, int]:
    return {
        "vocab_type": 2,
        "n_vocab": 32000,
        "n_ctx_train": N_CTX,
        "n_embd": 64,
        "n_params": 1_000_000,
        "size": 2_000_000,
    }


def models_body(model: str, created: int) -> bytes:
    entry = {
        "name": model,
        "model": model,
        "modified_at": "",
        "size": "",
        "digest": "",
        "type": "model",
        "description": "",
        "tags": [""],
        "capabilities": ["completion"],
        "parameters": "",
        "details": {
            "parent_model": "",
            "format": "gguf",
            "family": "",
            "families": [""],
            "parameter_size": "",
            "quantization_level": "",
        },
    }
    data: dict[str, Any] = {
        "id": model,
        "object": "model",
        "created": created,
        "owned_by": "llamacpp",
        "meta": _meta(),
    }
    return dumps({"models": [entry], "object": "list", "data": [data]}).encode()


def _params(n_predict: int) -> dict[str, Any]:
    return {
        "n_predict": n_predict,
        "seed": 4294967295,
        "temperature": 0.8,
        "top_k": 40,
        "top_p": 0.95,
        "min_p": 0.05,
        "stream": False,
        "stop": [],
    }


@dataclass(frozen=True)
class SlotView:
    """What ``/slots`` shows of one slot."""

    id: int
    id_task: int
    is_processing: bool
    n_decoded: int
    n_remain: int


def slot_json(slot: SlotView, n_predict: int) -> dict[str, Any]:
    return {
        "id": slot.id,
        "id_task": slot.id_task,
        "n_ctx": N_CTX,
        "speculative": False,
        "is_processing": slot.is_processing,
        "params": _params(n_predict),
        "prompt": "",
        "next_token": {
            "has_next_token": slot.is_processing,
            "has_new_line": False,
            "n_remain": slot.n_remain,
            "n_decoded": slot.n_decoded,
            "stopping_word": "",
        },
    }


def slots_body(slots: Sequence[SlotView], n_predict: int) -> bytes:
    return dumps([slot_json(slot, n_predict) for slot in slots]).encode()


def props_body(*, model: str, build: str, total_slots: int, n_predict: int) -> bytes:
    idle = SlotView(id=0, id_task=-1, is_processing=False, n_decoded=0, n_remain=-1)
    return dumps(
        {
            "default_generation_settings": slot_json(idle, n_predict),
            "total_slots": total_slots,
            "model_alias": model,
            "model_path": f"/models/{model}",
            "modalities": {"vision": False, "audio": False},
            "chat_template": "{% for message in messages %}{{ message['content'] }}{% endfor %}",
            "bos_token": "<s>",
            "eos_token": "</s>",
            "build_info": build,
        }
    ).encode()


def sse(payload: object) -> bytes:
    """llama-server's ``format_sse``: ``data: <json>`` and a blank line."""
    return b"data: " + dumps(payload).encode() + b"\n\n"


DONE_EVENT = b"data: [DONE]\n\n"


@dataclass(frozen=True)
class Completion:
    """Everything needed to render one completion, streamed or not.

    ``kind`` is ``"chat"`` (``/v1/chat/completions``), ``"oai"``
    (``/v1/completions``) or ``"native"`` (``/completion``).
    """

    kind: str
    model: str
    build: str
    n_tokens: int
    prompt_tokens: int
    limited: bool  # the request set max_tokens / n_predict
    slot_id: int
    stream: bool
    id: str
    created: int

    @property
    def finish_reason(self) -> str:
        return "length" if self.limited else "stop"

    def _timings(self, elapsed: float) -> dict[str, float]:
        predicted_ms = max(elapsed, 1e-6) * 1000.0
        n = max(self.n_tokens, 1)
        return {
            "prompt_n": self.prompt_tokens,
            "prompt_ms": 1.0,
            "prompt_per_token_ms": 1.0 / max(self.prompt_tokens, 1),
            "prompt_per_second": 1000.0 * self.prompt_tokens,
            "predicted_n": self.n_tokens,
            "predicted_ms": predicted_ms,
            "predicted_per_token_ms": predicted_ms / n,
            "predicted_per_second": 1000.0 * n / predicted_ms,
        }

    def _usage(self) -> dict[str, int]:
        return {
            "completion_tokens": self.n_tokens,
            "prompt_tokens": self.prompt_tokens,
            "total_tokens": self.n_tokens + self.prompt_tokens,
        }

    def _oai_envelope(self, choices: list[dict[str, Any]], obj: str) -> dict[str, Any]:
        return {
            "choices": choices,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.build,
            "object": obj,
            "id": self.id,
        }

    # -- non-streamed ---------------------------------------------------------

    def body(self, elapsed: float) -> bytes:
        text = generated_text(self.n_tokens)
        if self.kind == "chat":
            choice = {
                "finish_reason": self.finish_reason,
                "index": 0,
                "message": {"role": "assistant", "content": text},
            }
            out = self._oai_envelope([choice], "chat.completion")
            out["usage"] = self._usage()
            out["timings"] = self._timings(elapsed)
            return dumps(out).encode()
        if self.kind == "oai":
            choice = {
                "text": text,
                "index": 0,
                "logprobs": None,
                "finish_reason": self.finish_reason,
            }
            out = self._oai_envelope([choice], "text_completion")
            out["usage"] = self._usage()
            out["timings"] = self._timings(elapsed)
            return dumps(out).encode()
        return dumps(self._native_final(text, elapsed)).encode()

    def _native_final(self, content: str, elapsed: float) -> dict[str, Any]:
        return {
            "index": 0,
            "content": content,
            "tokens": [],
            "id_slot": self.slot_id,
            "stop": True,
            "model": self.model,
            "tokens_predicted": self.n_tokens,
            "tokens_evaluated": self.prompt_tokens,
            "generation_settings": {"n_predict": self.n_tokens, "stream": self.stream},
            "prompt": "",
            "has_new_line": False,
            "truncated": False,
            "stop_type": "limit" if self.limited else "eos",
            "stopping_word": "",
            "tokens_cached": self.prompt_tokens + self.n_tokens,
            "timings": self._timings(elapsed),
        }

    # -- streamed ---------------------------------------------------------------

    def opening_events(self) -> Iterator[bytes]:
        """Events sent right after the head, before the first token."""
        if self.kind == "chat":
            choice = {
                "finish_reason": None,
                "index": 0,
                "delta": {"role": "assistant", "content": None},
            }
            yield sse(self._oai_envelope([choice], "chat.completion.chunk"))

    def token_event(self, index: int) -> bytes:
        text = token_text(index)
        if self.kind == "chat":
            choice: dict[str, Any] = {"finish_reason": None, "index": 0, "delta": {"content": text}}
            return sse(self._oai_envelope([choice], "chat.completion.chunk"))
        if self.kind == "oai":
            choice = {"text": text, "index": 0, "logprobs": None, "finish_reason": None}
            return sse(self._oai_envelope([choice], "text_completion"))
        return sse(
            {
                "index": 0,
                "content": text,
                "tokens": [],
                "stop": False,
                "id_slot": -1,
                "tokens_predicted": index + 1,
                "tokens_evaluated": self.prompt_tokens,
            }
        )

    def closing_events(self, elapsed: float) -> Iterator[bytes]:
        """The final result event(s); OpenAI-style streams end with ``[DONE]``."""
        if self.kind == "native":
            yield sse(self._native_final("", elapsed))
            return
        choice: dict[str, Any]
        if self.kind == "chat":
            choice = {"finish_reason": self.finish_reason, "index": 0, "delta": {}}
            out = self._oai_envelope([choice], "chat.completion.chunk")
        else:
            choice = {"text": "", "index": 0, "logprobs": None, "finish_reason": self.finish_reason}
            out = self._oai_envelope([choice], "text_completion")
        out["usage"] = self._usage()
        out["timings"] = self._timings(elapsed)
        yield sse(out)
        yield DONE_EVENT


def now() -> int:
    return int(time.time())
