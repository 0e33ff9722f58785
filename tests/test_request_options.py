"""``request_options()`` of llama_guard.aiohttp and llama_guard.requests: a mistake is refused at the call, in the
function's own name, with the fields a request may set."""

from __future__ import annotations

import importlib
import re
from typing import Any

import pytest

from llama_guard._core.policy import per_request_fields

MODULES = ["llama_guard.requests", "llama_guard.aiohttp"]


def request_options(module: str) -> Any:
    pytest.importorskip(module.rpartition(".")[2])
    return importlib.import_module(module).request_options


@pytest.mark.parametrize("module", MODULES)
def test_an_unknown_key_is_refused_at_the_call_naming_request_options(module: str) -> None:
    """Not ``request.extensions["llama_guard"]``, which the caller never touched; and at the call, not when the
    block is entered (or a request sent)."""
    accepted = ", ".join(sorted(per_request_fields()))
    with pytest.raises(ValueError) as info:
        request_options(module)(foo=1)
    assert str(info.value) == (
        f"request_options() got unknown or transport-wide keys ['foo']; it takes the GuardPolicy fields a request "
        f"may set: {accepted}"
    )
    with pytest.raises(
        ValueError, match=re.escape("keys ['origins'] (origins: the guard's own, set on its GuardPolicy)")
    ):
        request_options(module)(origins="all")


@pytest.mark.parametrize("module", MODULES)
def test_a_bad_value_is_refused_at_the_call_naming_request_options(module: str) -> None:
    with pytest.raises(
        ValueError, match=r"^request_options\(\): max_attempts must be a whole number from 1 to 100; got 0$"
    ):
        request_options(module)(max_attempts=0)
