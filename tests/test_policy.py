"""GuardPolicy: validated, immutable, keyword-only; per-request overrides."""

from __future__ import annotations

import dataclasses
import math
import re

import pytest

from llama_guard import GuardPolicy, Origin


def test_defaults_are_safe_for_slow_requests() -> None:
    """By default nothing cuts a healthy slow request: no first-byte deadline; the probe catches stalls."""
    policy = GuardPolicy()
    assert policy.first_byte_timeout is None
    assert policy.probe is True
    assert policy.origins == "all"
    assert policy.stream_mode == "close"


def test_keyword_only_and_frozen() -> None:
    with pytest.raises(TypeError):
        GuardPolicy("all")  # type: ignore[misc]
    policy = GuardPolicy()
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.max_attempts = 2  # type: ignore[misc]


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("first_byte_timeout", -1, "first_byte_timeout must be a number of seconds >= 0.001"),
        ("first_byte_timeout", 1e-9, "first_byte_timeout must be a number of seconds >= 0.001 (1 ms, the resolution"),
        ("first_byte_timeout", 0.0009, "expires on every attempt"),
        ("first_byte_timeout", 0, "first_byte_timeout"),
        ("first_byte_timeout", math.nan, "first_byte_timeout"),
        ("first_byte_timeout", math.inf, "first_byte_timeout"),
        ("first_byte_timeout", "5", "first_byte_timeout"),
        ("first_byte_timeout", True, "first_byte_timeout"),
        ("max_attempts", 0, "max_attempts must be a whole number from 1 to 100"),
        ("max_attempts", 2.0, "max_attempts"),
        ("max_attempts", 101, "max_attempts"),
        ("stream_mode", "sometimes", "stream_mode must be one of 'close', 'drop', 'off'"),
        ("origins", "http://x:1", "origins must be 'all'"),
        ("origins", [], "at least one origin"),
        ("origins", ["ftp://x"], "origins: 'ftp://x' is not an origin"),
        (
            "origins",
            ["localhost:8080"],
            "it has no scheme; expected 'http://host[:port]' or 'https://host[:port]' "
            "(did you mean 'http://localhost:8080'?)",
        ),
        ("origins", ["http://x:1/v1"], "give only scheme, host and port"),
        ("origins", ["http://x:99999"], "the port must be a whole number from 1 to 65535, not '99999'"),
        ("origins", ["http://x:0"], "the port must be a whole number from 1 to 65535, not '0'"),
        ("origins", ["http://exa mple"], "'http://exa mple' is not a valid origin: it holds a space"),
        ("origins", ["http://exa\tmple:1"], "holds a space or a control character"),
        ("origins", ["http://ex<a>mple"], "the host 'ex<a>mple' may hold only letters, digits"),
        ("origins", ["http://[::zz]:1"], "'http://[::zz]:1' is not a valid origin"),
        (
            "origins",
            {"http://x:1": True},
            "origins must be a list of origins such as ['http://127.0.0.1:8080'], not a dict",
        ),
        ("probe", 1, "probe must be True or False"),
        ("probe_timeout", 0, "probe_timeout"),
        ("probe_timeout", 1e-6, "probe_timeout must be a number of seconds >= 0.001"),
        ("probe_timeout_max", 0.0001, "probe_timeout_max must be a number of seconds >= 0.001"),
        ("probe_timeout_max", 0.1, "probe_timeout_max must be >= probe_timeout"),
        ("backoff", -0.1, "backoff must be a number of seconds >= 0"),
        ("backoff_max", None, "backoff_max"),
        ("max_retry_time", -5, "max_retry_time"),
        ("max_retry_after", math.inf, "max_retry_after"),
        ("retry_non_idempotent", "yes", "retry_non_idempotent"),
        ("probe_learning", "on", "probe_learning must be True or False"),
        ("probe_kick", 1, "probe_kick must be True or False"),
        ("probe_learning_factor", 0.5, "probe_learning_factor must be a number from 1 to 1000"),
        ("probe_learning_factor", math.nan, "probe_learning_factor"),
        ("probe_learning_factor", True, "probe_learning_factor"),
        ("probe_timeout_min", 0, "probe_timeout_min must be a number of seconds >= 0.001"),
        ("connect_admission", "sometimes", "connect_admission must be one of 'after_stall', 'always', 'off'"),
    ],
)
def test_bad_values_name_the_field_and_the_range(field: str, value: object, words: str) -> None:
    """A bad value raises ValueError naming the field and what it accepts."""
    with pytest.raises(ValueError) as info:
        GuardPolicy(**{field: value})
    assert words in str(info.value)


@pytest.mark.parametrize("field", ["first_byte_timeout", "probe_timeout", "probe_timeout_min"])
def test_the_shortest_deadline_is_accepted(field: str) -> None:
    """1 ms is the floor, inclusive; an override below it is refused like the field itself."""
    policy = GuardPolicy(**{field: 0.001})
    assert getattr(policy, field) == 0.001
    with pytest.raises(ValueError, match=f"^{field} must be a number of seconds >= 0.001"):
        GuardPolicy().merged({field: 0.0005})


def test_origins_are_normalised() -> None:
    policy = GuardPolicy(origins=["HTTP://LocalHost:8080/", "http://localhost:8080", "https://[::1]"])
    assert policy.origins == (Origin("http", "localhost", 8080), Origin("https", "::1", 443))
    assert str(policy.origins[1]) == "https://[::1]:443"


def test_origin_values_are_checked_and_normalised_as_their_urls() -> None:
    """An `Origin` given as such is spelt as the guard spells origins (an upper-case host or a str port matched no
    request: its traffic passed through unguarded) and checked as a string origin is."""
    given = [Origin("http", "LOCALHOST", 8080), Origin("http", "a", "81"), Origin("https", "::1", 443)]  # type: ignore[arg-type]
    assert GuardPolicy(origins=given).origins == (
        Origin("http", "localhost", 8080),
        Origin("http", "a", 81),
        Origin("https", "::1", 443),
    )
    for bad, words in [
        (Origin("ftp", "a", 1), "origins: Origin(scheme='ftp', host='a', port=1) as 'ftp://a:1' is not an origin"),
        (Origin("http", "a b", 1), "it holds a space"),
        (Origin("http", "a", 0), "the port must be a whole number from 1 to 65535, not '0'"),
    ]:
        with pytest.raises(ValueError, match=re.escape(words)):
            GuardPolicy(origins=[bad])


def test_repr_is_useful() -> None:
    text = repr(GuardPolicy(first_byte_timeout=2.0))
    assert text.startswith("GuardPolicy(")
    assert "first_byte_timeout=2.0" in text


def test_merged_overrides() -> None:
    """A request's overrides produce a new policy; the shared one is unchanged."""
    base = GuardPolicy()
    merged = base.merged({"first_byte_timeout": 3.0, "max_attempts": 2})
    assert merged.first_byte_timeout == 3.0
    assert merged.max_attempts == 2
    assert base.first_byte_timeout is None
    assert base.merged(None) is base
    assert base.merged({}) is base
    replacement = GuardPolicy(max_attempts=1, origins=["http://a:1"])
    assert base.merged(replacement).max_attempts == 1
    assert base.merged(replacement).origins == "all"  # origins are transport-wide


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        ({"first_byte_timout": 1}, "unknown or transport-wide keys ['first_byte_timout']"),
        ({"origins": "auto"}, "transport-wide"),
        ({"first_byte_timeout": -1}, "first_byte_timeout must be"),
        (5, "must be a dict of GuardPolicy fields"),
    ],
)
def test_bad_overrides(overrides: object, words: str) -> None:
    with pytest.raises(ValueError) as info:
        GuardPolicy().merged(overrides)  # type: ignore[arg-type]
    assert words in str(info.value)


def test_adaptive_probe_fields_default_on_and_show_in_repr() -> None:
    """Learning and admission after a stall are on by default; a changed field shows in the repr."""
    policy = GuardPolicy()
    assert (policy.probe_learning, policy.probe_learning_factor, policy.probe_timeout_min) == (True, 4.0, 0.05)
    assert policy.connect_admission == "after_stall"
    changed = GuardPolicy(probe_learning=False, connect_admission="always")
    assert repr(changed) == "GuardPolicy(probe_learning=False, connect_admission='always')"
    assert policy.merged({"connect_admission": "off"}).connect_admission == "off"
