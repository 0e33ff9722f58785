"""Does a request body ask llama-server for a stream? Read the way llama-server reads it.

llama-server parses the whole body with nlohmann::json and streams when the top-level ``"stream"`` is the JSON
boolean ``true``. Python's json module differs from nlohmann's parser in what it accepts, so the differences are
handled here, each in the direction of llama-server:

- the body must be UTF-8 (``json.loads`` on bytes would also detect UTF-16 and UTF-32);
- ``NaN``, ``Infinity`` and numbers beyond a double's range are errors;
- an escaped lone surrogate (``"\\ud800"``) is an error; an escaped backslash followed by ``ud800`` is not one;
- nesting deeper than Python's recursion limit is fine (nlohmann keeps its own stack): the top-level keys are then
  found by an iterative scan.

A body llama-server rejects streams nothing, so it is "not a stream" when it is parsed.

Cost: below 64 KiB, one ``json.loads`` (C speed) when the body holds "stream" or an escape, and checks that run
only when the answer would be "a stream" (they can only turn it into "not a stream"). Above 64 KiB the parse would
cost more than the request's own work, so: a byte filter (`could_stream`) answers "not a stream" unless a colon is
followed by ``true`` and preceded by a key that reads ``stream``; then `top_level_stream_without_parse` reads the
last top-level ``"stream"`` from the body's structure (a few string ends passed from the end of the body), exact for
every body llama-server accepts, while a large body it refuses may then read as a stream (the only effect is one
``Connection: close`` on a request the server answers with an error); only a body with too many strings after its
key is parsed and checked as above. Sans-I/O; tested in ``tests/test_fuzz.py`` against llama-server's rules and in
``tests/test_decisions.py`` as a table.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Final

__all__ = ["could_stream", "top_level_stream_without_parse", "wants_stream"]

# Below this size two searches for "stream" and an escape answer most bodies; above it `could_stream` does, which
# costs a few microseconds more and a pass at memchr speed rather than two multi-byte searches.
BYTE_CHECK_LIMIT: Final = 64 * 1024
# parse_int: a C callable that returns a constant is faster than building each integer, whose value never decides
# the answer (False in the document: not the boolean true).
_NO_INTEGER: Final = frozenset[str]().__contains__


class _DuplicateKeys(Exception):
    """An object repeats a key: the value it overwrites is out of the document's reach, but must be valid too."""


def wants_stream(body: bytes) -> bool:
    """True when a JSON request body asks for ``"stream": true`` at its top level, as llama-server reads it."""
    # bytes.find, not the `in` operator: `x in body` first tries x as an integer, and raises and discards a
    # formatted TypeError before it searches (CPython 3.11), which cost more than the searches themselves.
    # A body with neither "stream" nor an escape (which could spell the key) cannot ask for a stream.
    if len(body) < BYTE_CHECK_LIMIT:
        if body.find(b"stream") == -1 and body.find(b"\\u") == -1:
            return False
    elif not could_stream(body):
        return False
    else:
        read = top_level_stream_without_parse(body)
        if read is not None:
            return read
    try:
        text = body.decode("utf-8-sig")  # nlohmann skips a UTF-8 byte order mark too
    except UnicodeDecodeError:
        return False
    # A small body's text is searched for lone surrogates at once; a large one's parsed strings are walked instead,
    # when they are few (a search costs a pass that is slow where escapes are dense).
    try:
        return _reads_as_stream(body, text, walk=len(body) >= BYTE_CHECK_LIMIT)
    except _DuplicateKeys:  # rare: a repeated key's overwritten value is out of the walk's reach
        return _reads_as_stream(body, text, walk=False)


# A key that reads "stream": each letter as itself or as its \u00XX escape (JSON can write a letter no other way),
# ending where the text before a colon, its whitespace stripped, ends.
_STREAM_KEY: Final = re.compile(rb'"(?:s|\\u0073)(?:t|\\u0074)(?:r|\\u0072)(?:e|\\u0065)(?:a|\\u0061)(?:m|\\u006[dD])"')
_STREAM_KEY_AT_END: Final = re.compile(_STREAM_KEY.pattern + rb"\Z")
_LONGEST_STREAM_KEY: Final = 2 + 6 * len("\\u0073")
_KEY_WINDOW: Final = 64
_TRUE_AFTER_COLON: Final = re.compile(rb"[ \t\r\n]*true")
_COLON_TRUE: Final = re.compile(rb":[ \t\r\n]*true")
# Colons looked at one by one, from the end (found at memchr speed; clients write "stream" after the messages);
# before these, a regular expression skips the colons not followed by true at C speed.
COLONS_ONE_BY_ONE: Final = 64
# Colons followed by true whose key is looked at; past these the parse decides (a body of many booleans).
_TRUE_CANDIDATES: Final = 64


def could_stream(body: bytes) -> bool:
    """False only when ``body`` cannot ask for ``"stream": true``: no colon in it is followed by ``true`` and
    preceded by a key that reads ``stream``. llama-server's top-level ``"stream": true`` is such a colon, so a
    False is always right; a True (also for a colon inside a string, or a nested key) leaves it to the parse."""
    end = len(body)
    for _ in range(COLONS_ONE_BY_ONE):
        colon = body.rfind(b":", 0, end)
        if colon == -1:
            return False
        if _TRUE_AFTER_COLON.match(body, colon + 1) and _stream_key_before(body, colon):
            return True
        end = colon
    # The colons before `end`: a match of ':', whitespace and true holds one colon, so it ends before that one.
    for candidates, found in enumerate(_COLON_TRUE.finditer(body, 0, end)):
        if candidates == _TRUE_CANDIDATES or _stream_key_before(body, found.start()):
            return True
    return False


# A body's strings passed from its end, per 8 KiB of it (at least 16), before the scan leaves it to the parse: a
# string costs about a microsecond, so the scan stays a small part of what the parse would then cost.
_STRINGS_PER_BYTES: Final = 8192
_MIN_STRINGS: Final = 16
_BACKSLASH_WINDOW: Final = 64
_COLON: Final = re.compile(rb"[ \t\r\n]*:[ \t\r\n]*")


def top_level_stream_without_parse(body: bytes) -> bool | None:
    """Whether the last top-level ``"stream"`` member is ``true``, read without a parse: from the body's end, or
    from its start when the first member is the only key that can read ``stream``. None when the body holds too
    many strings (or too long a run of backslashes) to pass cheaply from the end: then the parse decides.

    Exact for every body llama-server accepts: in valid JSON the quotes not escaped by an odd run of backslashes
    are exactly the strings' ends, so the strings can be passed from the end, and the brackets between them give
    the depth. llama-server keeps the last of repeated keys, so the last top-level ``"stream"`` decides. A body it
    refuses (not JSON, a lone surrogate, NaN...) may be read as a stream here, and is then sent with
    ``Connection: close``: the server answers it with an error either way, so the cost is one new connection,
    while checking what nlohmann refuses would cost more than a ``json.loads`` of the body."""
    if _only_key_is_first_stream_true(body):
        return True
    end = len(body.rstrip(b" \t\r\n"))
    if not body.endswith(b"}", 0, end):
        return False  # not an object (a valid body's last character closes its top level)
    budget = max(_MIN_STRINGS, end // _STRINGS_PER_BYTES)
    depth = 0  # containers open around `end`, outside strings
    while True:
        closing = body.rfind(b'"', 0, end)
        # Between two strings only structure: a closer passed from the end opens a level, an opener closes one.
        depth += (body.count(b"}", closing + 1, end) + body.count(b"]", closing + 1, end)) - (
            body.count(b"{", closing + 1, end) + body.count(b"[", closing + 1, end)
        )
        if closing == -1 or depth < 1:
            return False  # the top level passed without a "stream" key (or not JSON)
        opening = closing
        while True:
            budget -= 1
            if budget < 0:
                return None
            opening = body.rfind(b'"', 0, opening)
            if opening == -1:
                return False
            escaped = _escaped(body, opening)
            if escaped is None:
                return None
            if not escaped:
                break
        if depth == 1:
            colon = _COLON.match(body, closing + 1)
            if colon is not None and _STREAM_KEY.fullmatch(body, opening, closing + 1):
                return body.startswith(b"true", colon.end())
        end = opening


# A body that opens with "stream": true (after a UTF-8 byte order mark and whitespace).
_FIRST_MEMBER_STREAM_TRUE: Final = re.compile(
    rb'(?:\xef\xbb\xbf)?[ \t\r\n]*{[ \t\r\n]*"stream"[ \t\r\n]*:[ \t\r\n]*true'
)


def _only_key_is_first_stream_true(body: bytes) -> bool:
    """Whether the body opens with ``{"stream": true`` and no other key can read ``stream``: the word appears once,
    and no escape writes one of its letters (``\\u006X``, ``\\u007X``). Then no later member overrides it."""
    opening = _FIRST_MEMBER_STREAM_TRUE.match(body)
    return (
        opening is not None
        and body.find(b"stream", opening.end()) == -1
        and body.find(b"\\u006") == -1
        and body.find(b"\\u007") == -1
    )


def _escaped(body: bytes, quote: int) -> bool | None:
    """Whether the quote at ``quote`` is escaped: an odd run of backslashes before it (None: a run too long to
    count cheaply)."""
    if quote == 0 or body[quote - 1] != 0x5C:
        return False
    start = max(0, quote - _BACKSLASH_WINDOW)
    window = body[start:quote]
    run = len(window) - len(window.rstrip(b"\\"))
    if run == len(window) and start:
        return None
    return run % 2 == 1


def _stream_key_before(body: bytes, colon: int) -> bool:
    """Whether a key that reads ``stream`` may end before ``colon`` (True too when whitespace hides what is before
    it: then the parse decides)."""
    start = max(0, colon - _KEY_WINDOW)
    head = body[start:colon].rstrip(b" \t\r\n")
    if start and len(head) < _LONGEST_STREAM_KEY:
        return True
    return _STREAM_KEY_AT_END.search(head) is not None


def _reads_as_stream(body: bytes, text: str, *, walk: bool) -> bool:
    """Parse, then check what nlohmann refuses and Python accepts. ``walk``: objects are checked for repeated keys
    (`_DuplicateKeys`), so that lone surrogates may be looked for in the parsed strings rather than in the text."""
    floats: list[str] = []
    try:
        document = json.loads(
            text,
            object_pairs_hook=_object if walk else None,
            parse_constant=_refuse,
            parse_float=floats.append,
            parse_int=_NO_INTEGER,
        )
    except RecursionError:
        return _top_level_stream(text) and not _has_lone_surrogate_escape(text)
    except ValueError:
        return False
    if not (isinstance(document, dict) and document.get("stream") is True):
        return False
    if any(map(math.isinf, map(float, floats))) or _integer_out_of_range(body, text):
        return False
    lone = _has_lone_surrogate(document, budget=len(text) // _WALK_BUDGET_DIVISOR) if walk else None
    return not (_has_lone_surrogate_escape(text) if lone is None else lone)


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    document = dict(pairs)
    if len(document) != len(pairs):
        raise _DuplicateKeys
    return document


def _refuse(constant: str) -> float:
    raise ValueError(f"{constant} is not JSON")


# The longest integer a double holds finitely has 309 digits; one of 309 may still fit, and is converted.
_LONGEST_FINITE_INTEGER: Final = 308
_DIGITS_AS_ZERO: Final = bytes.maketrans(b"0123456789", b"0" * 10)
# A run of 309 digits covers 3 consecutive multiples of 100 and 30 of 10: samples of every hundredth, then every
# tenth byte, find every such run; each finer search runs only when the coarser one found a candidate.
_SAMPLES: Final = tuple((step, b"0" * ((_LONGEST_FINITE_INTEGER + 1) // step)) for step in (100, 10, 1))


def _integer_out_of_range(body: bytes, text: str) -> bool:
    """Whether an integer is beyond a double's range (nlohmann stores one beyond 64 bits as a double).

    Only a run of 309 digits can be one. Samples of the body rule that out in a small part of a pass (a body of
    long numbers may need the full search); a body with such a run (in a number or a string) is parsed again with
    its integers kept as text.
    """
    for step, run in _SAMPLES:
        if body[::step].translate(_DIGITS_AS_ZERO).find(run) == -1:
            return False
    integers: list[str] = []
    json.loads(text, parse_int=integers.append)
    return any(math.isinf(float(integer)) for integer in integers if len(integer) > _LONGEST_FINITE_INTEGER)


# A body with more containers and strings than its length over this (one per 1 KiB) is read for lone surrogates
# from its text, a pass at C speed, rather than walked node by node in Python.
_WALK_BUDGET_DIVISOR: Final = 1024


def _has_lone_surrogate(document: dict[str, Any], budget: int) -> bool | None:
    """Whether a string in the parsed document (which repeats no key) holds a surrogate code point; None when the
    document has more than ``budget`` (at least 64) containers and strings.

    Python's json joins an escaped pair into one character and keeps a lone escape as a surrogate, and valid UTF-8
    holds no surrogates: so one found here was a lone escape in the body. ASCII strings are passed over at no
    cost, and so is an array of numbers and literals (token ids) at C speed.
    """
    pending: list[Any] = [document]
    budget = max(budget, 64)
    while pending:
        budget -= 1
        if budget < 0:
            return None
        item = pending.pop()
        if type(item) is str:
            if not item.isascii() and _holds_surrogate(item):
                return True
        elif type(item) is dict:
            pending.extend(item)
            pending.extend(item.values())
        elif type(item) is list and not _only_literals(item):
            pending.extend(item)
    return False


def _holds_surrogate(text: str) -> bool:
    # Latin-1 holds no surrogate, and encoding to it is a copy for a string of such characters (it fails at the
    # first wider one otherwise); UTF-8 refuses a surrogate. Both C passes, faster than a regular expression.
    try:
        text.encode("latin-1")
        return False
    except UnicodeEncodeError:
        pass
    try:
        text.encode()
        return False
    except UnicodeEncodeError:
        return True


def _only_literals(array: list[Any]) -> bool:
    """An array of integers (False here), floats (None) and literals: no string or container inside."""
    size = len(array)
    found = array.count(False)  # the commonest first: one count answers a list of token ids
    if found != size:
        found += array.count(None)
    if found != size:
        found += array.count(True)
    return found == size


# A high surrogate escape not followed by a low one, or a low one not preceded by a high one. Both start with the
# literal \u, so the search skips to backslashes at C speed (a lookbehind in front would be tried at every place).
_LONE_SURROGATE_ESCAPE: Final = re.compile(
    r"\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F][0-9a-fA-F]{2})"
    r"|\\u[dD][c-fC-F][0-9a-fA-F]{2}(?<!\\u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2})"
)


# Any surrogate escape, lone or paired: a text without one holds no lone surrogate.
_SURROGATE_ESCAPE: Final = re.compile(r"\\u[dD][89a-fA-F]")


def _has_lone_surrogate_escape(text: str) -> bool:
    """Whether the JSON text holds an escaped lone surrogate.

    In ``\\\\ud800`` the first backslash escapes the second: a backslash and the letters ``ud800``. So the raw text
    is searched only for any surrogate escape, which answers most bodies alone; where there is one, lone ones are
    searched for after escaped backslashes are replaced, left to right as a JSON reader pairs them, by a character
    that cannot join its neighbours into an escape. (A search of the raw text for lone ones can miss one: in
    ``\\\\ud800\\udc00`` the low half looks paired, but its high half is letters after an escaped backslash.)
    """
    if _SURROGATE_ESCAPE.search(text) is None:
        return False
    return _LONE_SURROGATE_ESCAPE.search(text.replace("\\\\", "#")) is not None


_STRING: Final = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
# A string's quote, a comma, or a run of opening or closing brackets (a run is counted at once: deep nesting is
# mostly such runs).
_STRUCTURE: Final = re.compile(r'"|,|[\[{]+|[\]}]+')
_WHITESPACE: Final = re.compile(r"[ \t\r\n]*")
_TRUE_END: Final = frozenset(" \t\r\n,}")


def _top_level_stream(text: str) -> bool:
    """The top-level ``"stream"`` of a document too deep for ``json.loads``, found without recursion.

    Checks the structure (brackets balanced, strings closed, a top-level object closed by a brace), not every
    value nor the kind of every inner bracket: this runs only for bodies nested thousands deep, which an
    application does not send by accident.
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
        run = found.end() - position
        position = found.end()
        if char in "{[":
            depth += run
            expecting_key = depth == 1
        elif char in "}]":
            if run >= depth:  # the top-level object closes in this run, with a brace, and nothing may follow it
                return run == depth and text[position - 1] == "}" and stream and not text[position:].strip()
            depth -= run
        elif depth == 1:
            expecting_key = True  # a comma between top-level members
    return False
