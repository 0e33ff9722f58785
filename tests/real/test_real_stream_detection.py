"""What the guard reads as a request for a stream, against what the real llama-server streams.

`wants_stream` is checked against a model of llama-server's JSON reading (nlohmann's ``json::parse``, then
``json_value(body, "stream", false)``) in ``tests/test_fuzz.py``. Here the bodies that model was made from, and the
fuzzer's finds, go to real b11434: a body it answers with an event stream is one the guard must read as a stream, and
a body it refuses, or answers whole, one it must not. Each case also says what the server does, so a server that
reads JSON differently fails here rather than in the guard's users' pools.
"""

from __future__ import annotations

import codecs

import httpx
import pytest

from llama_guard._core.stream_detection import wants_stream

from ._raw_http import CHAT

pytestmark = pytest.mark.real_server


def chat(members: str) -> bytes:
    """A one-token chat completion with ``members`` (raw JSON text) after its messages."""
    return ('{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, ' + members + "}").encode()


# (what the case is, the body, whether llama-server streams its answer)
CASES: list[tuple[str, bytes, bool]] = [
    ("stream true", chat('"stream": true'), True),
    ("stream false", chat('"stream": false'), False),
    ("no stream member", chat('"temperature": 0'), False),
    ("the key spelt with an escape", chat('"str\\u0065am": true'), True),
    ("repeated key, the last false", chat('"stream": true, "stream": false'), False),
    ("repeated key, the last true", chat('"stream": false, "stream": true'), True),
    ("a UTF-8 byte order mark first", codecs.BOM_UTF8 + chat('"stream": true'), True),
    ("the number 1, not a boolean", chat('"stream": 1'), False),
    ("the string true", chat('"stream": "true"'), False),
    ("stream true nested only", chat('"options": {"stream": true}'), False),
    ("a surrogate pair", chat('"x": "\\ud83d\\ude00", "stream": true'), True),
    ("a lone high surrogate", chat('"x": "\\ud800", "stream": true'), False),
    ("a lone low surrogate", chat('"x": "\\udc00", "stream": true'), False),
    ("an escaped backslash, then the letters ud800", chat('"x": "\\\\ud800", "stream": true'), True),
    ("an escaped backslash, then a lone surrogate", chat('"x": "\\\\\\ud800", "stream": true'), False),
    # A find of the fuzz test: the raw text holds a pair, but its high half is letters after an escaped backslash.
    (
        "letters ud800 after an escaped backslash, then a low half",
        chat('"x": "\\\\ud800\\udc00", "stream": true'),
        False,
    ),
    (
        "a lone surrogate in a value a repeated key overwrites",
        chat('"x": "\\ud800", "x": "y", "stream": true'),
        False,
    ),
    ("NaN", chat('"x": NaN, "stream": true'), False),
    ("a number beyond a double", chat('"x": 1e400, "stream": true'), False),
    ("not JSON after the stream member", chat('"stream": true,'), False),
]


def test_the_guard_reads_as_a_stream_what_llama_server_streams(real_server) -> None:  # type: ignore[no-untyped-def]
    server = real_server()
    seen: list[str] = []
    wrong: list[str] = []
    with httpx.Client(base_url=server.url, timeout=60.0, headers={"Connection": "close"}) as client:
        for what, body, streams in CASES:
            response = client.post(CHAT, content=body, headers={"Content-Type": "application/json"})
            streamed = response.status_code == 200 and response.headers.get("content-type", "").startswith(
                "text/event-stream"
            )
            seen.append(f"{what}: HTTP {response.status_code}, {'streamed' if streamed else 'not streamed'}")
            if streamed is not streams:
                wrong.append(
                    f"{what}: llama-server {'streamed' if streamed else 'did not stream'}, not as the case says"
                )
            read = wants_stream(body)
            if read is not streamed:
                wrong.append(f"{what}: the guard reads {read}, llama-server streamed: {streamed}")
    # Each case's own answer from the server is checked too: a server that refused every body (a changed chat API)
    # fails here, rather than passing the guard's reading of refused bodies alone.
    assert not wrong, "\n".join([*wrong, "", *seen])
