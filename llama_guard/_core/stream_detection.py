"""Does a request body ask llama-server for a stream? Read the way llama-server reads it.

llama-server parses the whole body with nlohmann::json and streams when the top-level ``"stream"`` is the JSON
boolean ``true``. Python's json module differs from nlohmann's parser in what it accepts, so the differences are
handled here, each in the direction of llama-server:

- the body must be UTF-8 (``json.loads`` on bytes would also detect UTF-16 and UTF-32);
- ``NaN``, ``Infinity`` and numbers beyond a double's range are errors;
- an escaped lone surrogate (``"\\ud800"``) is an error;
- nesting deeper than Python's recursion limit is fine (nlohmann keeps its own stack): the top-level keys are then
  found by an iterative scan.

A body llama-server rejects streams nothing, so it is "not a stream". Sans-I/O; tested in ``tests/test_fuzz.py``
against these rules and in ``tests/test_decisions.py`` as a table.
"""

from __future__ import annotations

import json
import math
import re
from typing import Final

__all__ = ["wants_stream"]

# A high surrogate escape not followed by a low one, or a low one not preceded by a high one.
_LONE_SURROGATE: Final = re.compile(
    r"\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F][0-9a-fA-F]{2})"
    r"|(?<!\\u[dD][89abAB][0-9a-fA-F]{2})\\u[dD][c-fC-F][0-9a-fA-F]{2}"
)


def wants_stream(body: bytes) -> bool:
    """True when a JSON request body asks for ``"stream": true`` at its top level, as llama-server reads it.

    A cheap byte check comes first: a body that contains neither ``stream`` nor a JSON escape (which could spell
    the key) cannot ask for a stream, so most bodies are never parsed.
    """
    # bytes.find, not the `in` operator: `x in body` first tries x as an integer, and raises and discards a
    # formatted TypeError before it searches (CPython 3.11), which cost more than the searches themselves.
    if body.find(b"stream") == -1 and body.find(b"\\u") == -1:
        return False
    try:
        text = body.decode("utf-8-sig")  # nlohmann skips a UTF-8 byte order mark too
    except UnicodeDecodeError:
        return False
    if "\\u" in text and _LONE_SURROGATE.search(text):
        return False
    try:
        document = json.loads(text, parse_constant=_refuse, parse_float=_finite_float, parse_int=_finite_int)
    except RecursionError:
        return _top_level_stream(text)
    except ValueError:
        return False
    return isinstance(document, dict) and document.get("stream") is True


def _refuse(constant: str) -> float:
    raise ValueError(f"{constant} is not JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"number out of range: {text[:20]}...")
    return value


def _finite_int(text: str) -> int:
    # nlohmann stores an integer beyond 64 bits as a double: one beyond a double's range is an error.
    if len(text) > 300 and math.isinf(float(text)):
        raise ValueError(f"number out of range: {text[:20]}...")
    return int(text)


_STRING: Final = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_STRUCTURE: Final = re.compile(r'["{}\[\],]')
_WHITESPACE: Final = re.compile(r"[ \t\r\n]*")
_TRUE_END: Final = frozenset(" \t\r\n,}")


def _top_level_stream(text: str) -> bool:
    """The top-level ``"stream"`` of a document too deep for ``json.loads``, found without recursion.

    Checks the structure (brackets balanced, strings closed, a top-level object), not every value: this runs
    only for bodies nested thousands deep, which an application does not send by accident.
    """
    start = _WHITESPACE.match(text, 0)
    position = start.end() if start else 0
    if not text.startswith("{", position):
        return False
    depth = 0
    expecting_key = False
    stream = False
    while True:
        found = _STRUCTURE.search(text, position)
        if found is None:
            break
        position = found.start()
        char = text[position]
        if char == '"':
            string = _STRING.match(text, position)
            if string is None:
                return False  # an unterminated string
            position = string.end()
            if depth == 1 and expecting_key:
                expecting_key = False
                colon = _WHITESPACE.match(text, position)
                position = colon.end() if colon else position
                if not text.startswith(":", position):
                    return False
                value = _WHITESPACE.match(text, position + 1)
                position = value.end() if value else position + 1
                if json.loads(string.group()) == "stream":  # the key may be spelt with escapes
                    end = position + 4
                    stream = text.startswith("true", position) and (end == len(text) or text[end] in _TRUE_END)
            continue
        if char in "{[":
            depth += 1
            expecting_key = depth == 1
        elif char in "}]":
            depth -= 1
            if depth < 0:
                return False
            if depth == 0:
                return stream and not text[position + 1 :].strip()
        elif depth == 1:
            expecting_key = True  # a comma between top-level members
        position += 1
    return False
