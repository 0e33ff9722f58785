"""Does a request body ask llama-server for a stream? Read the way llama-server reads it.

llama-server parses the whole body with nlohmann::json and streams when the top-level ``"stream"`` is the JSON
boolean ``true``. Python's json module differs from nlohmann's parser in what it accepts, so the differences are
handled here, each in the direction of llama-server:

- the body must be UTF-8 (``json.loads`` on bytes would also detect UTF-16 and UTF-32);
- ``NaN``, ``Infinity`` and numbers beyond a double's range are errors;
- an escaped lone surrogate (``"\\ud800"``) is an error (an escaped backslash before ``ud800`` is not one);
- nesting deeper than Python's recursion limit is fine (nlohmann keeps its own stack): the top-level keys are then
  found by an iterative scan.

A body llama-server rejects streams nothing, so it is "not a stream". The cost is one ``json.loads`` (C speed)
plus checks of what it returned, and those checks run only when the answer would otherwise be "a stream": they
can only turn it into "not a stream". Sans-I/O; tested in ``tests/test_fuzz.py`` against these rules and in
``tests/test_decisions.py`` as a table.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Final

__all__ = ["wants_stream"]

# Below this size a byte check answers most bodies without parsing; above it the check costs about as much as the
# parse it would save (both are one pass over the body), so the body is parsed at once.
BYTE_CHECK_LIMIT: Final = 64 * 1024
# The longest integer a double holds finitely has 309 digits; one that long may still fit, so it is converted.
_LONGEST_FINITE_INTEGER: Final = 308


def wants_stream(body: bytes) -> bool:
    """True when a JSON request body asks for ``"stream": true`` at its top level, as llama-server reads it."""
    # bytes.find, not the `in` operator: `x in body` first tries x as an integer, and raises and discards a
    # formatted TypeError before it searches (CPython 3.11), which cost more than the searches themselves.
    # A body with neither "stream" nor an escape (which could spell the key) cannot ask for a stream.
    if len(body) < BYTE_CHECK_LIMIT and body.find(b"stream") == -1 and body.find(b"\\u") == -1:
        return False
    try:
        text = body.decode("utf-8-sig")  # nlohmann skips a UTF-8 byte order mark too
    except UnicodeDecodeError:
        return False
    # Numbers are collected as their text (the document holds None in their place): appending is C speed, and the
    # answer never depends on a number's value, only on whether nlohmann could read it.
    integers: list[str] = []
    floats: list[str] = []
    try:
        document = json.loads(text, parse_constant=_refuse, parse_float=floats.append, parse_int=integers.append)
    except RecursionError:
        return _top_level_stream(text) and not _has_lone_surrogate_escape(text)
    except ValueError:
        return False
    if not (isinstance(document, dict) and document.get("stream") is True):
        return False
    return not (_out_of_range(integers, floats) or _has_lone_surrogate(document))


def _refuse(constant: str) -> float:
    raise ValueError(f"{constant} is not JSON")


def _out_of_range(integers: list[str], floats: list[str]) -> bool:
    """Whether a number is beyond a double's range: nlohmann stores an integer beyond 64 bits as a double."""
    if floats and any(map(math.isinf, map(float, floats))):
        return True
    if integers and max(map(len, integers)) > _LONGEST_FINITE_INTEGER:
        return any(math.isinf(float(integer)) for integer in integers if len(integer) > _LONGEST_FINITE_INTEGER)
    return False


def _has_lone_surrogate(document: Any) -> bool:
    """Whether a string in the parsed document holds a surrogate code point.

    Python's json joins an escaped pair into one character and keeps a lone escape as a surrogate, and valid UTF-8
    holds no surrogates: so one found here was a lone escape in the body. An ASCII string is skipped at no cost,
    and a list holding no strings or
    containers (token ids: numbers are None here) at C speed.
    """
    pending = [document]
    while pending:
        item = pending.pop()
        if type(item) is str:
            if not item.isascii():
                try:
                    item.encode()  # UTF-8 refuses a surrogate; a C pass, faster here than a regular expression
                except UnicodeEncodeError:
                    return True
        elif type(item) is dict:
            pending.extend(item)
            pending.extend(item.values())
        elif type(item) is list:
            if item.count(None) + item.count(True) + item.count(False) != len(item):
                pending.extend(item)
    return False


_SURROGATE_ESCAPE: Final = re.compile(r"\\u[dD][89a-fA-F]")
_SURROGATE_PAIR: Final = re.compile(r"\\u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2}")


def _has_lone_surrogate_escape(text: str) -> bool:
    """Whether the JSON text holds an escaped lone surrogate (for documents too deep to parse).

    Escaped backslashes go first, left to right as a JSON reader pairs them (``\\\\ud800`` is a backslash and
    ``ud800``), then escaped pairs; each becomes a character that cannot join its neighbours into a new escape.
    """
    if _SURROGATE_ESCAPE.search(text) is None:
        return False
    unpaired = _SURROGATE_PAIR.sub("#", text.replace("\\\\", "#"))
    return _SURROGATE_ESCAPE.search(unpaired) is not None


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
