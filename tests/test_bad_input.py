"""Bad origins and absurd deadlines are refused before anything is sent, by every entry point that takes them,
with an error that names the value and says what is accepted."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

import llama_guard
from llama_guard import GuardPolicy
from llama_guard._cli.launch import exec_guarded
from llama_guard._core.origins import parse_origin
from llama_guard._install.environment import install_from_environment
from llama_guard._install.patching import installation
from llama_guard.testing import LlamaServerEmulator

PORT = "the port must be a whole number from 1 to 65535"
BAD_ORIGINS = [
    pytest.param("http://exa mple", "it holds a space or a control character", id="space-in-host"),
    pytest.param("http://exa\tmple:8080", "it holds a space or a control character", id="tab-in-host"),
    pytest.param("http://ex|ample:8080", "the host 'ex|ample' may hold only letters, digits", id="bar-in-host"),
    pytest.param("http://[::1x]:8080", "is not a valid origin", id="bad-ipv6"),
    pytest.param("http://127.0.0.1:0", f"{PORT}, not '0'", id="port-0"),
    pytest.param("http://127.0.0.1:65536", f"{PORT}, not '65536'", id="port-65536"),
    pytest.param("http://127.0.0.1:-1", f"{PORT}, not '-1'", id="port-negative"),
    pytest.param("http://127.0.0.1:8o8o", f"{PORT}, not '8o8o'", id="port-letters"),
]


@pytest.fixture(autouse=True)
def nothing_installed_afterwards() -> Iterator[None]:
    yield
    llama_guard.uninstall()


@pytest.mark.parametrize(("origin", "words"), BAD_ORIGINS)
def test_a_bad_origin_is_refused_everywhere(origin: str, words: str, capsys: pytest.CaptureFixture[str]) -> None:
    """parse_origin, GuardPolicy, install(), LLAMA_GUARD_ORIGINS, llama-guard run: the same words, the value named."""
    with pytest.raises(ValueError, match=re.escape(words)) as info:
        parse_origin(origin)
    assert repr(origin) in str(info.value)
    with pytest.raises(ValueError, match=re.escape(words)):
        GuardPolicy(origins=[origin])
    with pytest.raises(ValueError, match=re.escape(words)):
        llama_guard.install(origins=[origin])
    assert installation() is None
    with pytest.raises(ValueError, match=re.escape(words)):
        install_from_environment({"LLAMA_GUARD_ORIGINS": f"http://127.0.0.1:8080,{origin}"})
    assert installation() is None
    assert exec_guarded(["true"], origins=origin, environ={}) == 2  # refused before exec: it returns
    assert words in capsys.readouterr().err


@pytest.mark.parametrize(
    "origins",
    [{"http://127.0.0.1:8080": True}, {"http://127.0.0.1:8080": "llama"}],
    ids=["dict-of-bools", "dict-of-text"],
)
def test_a_dict_is_not_a_list_of_origins(origins: dict[str, Any]) -> None:
    """Iterating a dict would take its keys and drop the rest without a word."""
    words = "origins must be a list of origins such as ['http://127.0.0.1:8080'], not a dict"
    with pytest.raises(ValueError, match=re.escape(words)):
        GuardPolicy(origins=origins)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=re.escape(words)):
        llama_guard.install(origins=origins)  # type: ignore[arg-type]
    assert installation() is None


@pytest.mark.parametrize(
    ("field", "value"),
    [("first_byte_timeout", 1e-9), ("first_byte_timeout", 0.0), ("probe_timeout", 1e-4), ("probe_timeout_min", 0)],
)
def test_an_absurd_deadline_as_a_request_option_sends_nothing(field: str, value: float) -> None:
    """The issue's case: first_byte_timeout=1e-9 ran one completion 4 times on the server. Refused, as a policy
    and as one request's override, before a byte is written."""
    with pytest.raises(ValueError, match=f"^{field} must be a number of seconds >= 0.001 "):
        GuardPolicy(**{field: value})
    with LlamaServerEmulator() as server:
        with (
            httpx.Client(base_url=server.url, transport=llama_guard.GuardTransport()) as client,
            pytest.raises(ValueError, match=f"^{field} must be a number of seconds >= 0.001 "),
        ):
            client.post("/v1/chat/completions", json={"messages": []}, extensions={"llama_guard": {field: value}})
        stats = server.stats()
    assert stats.connections_accepted == 0
    assert stats.completions_started == 0
