"""Smoke test of every public entry point on the default install, without any extra (no aiohttp, no httpx2).

    python3 -m venv /tmp/venv-noextras && /tmp/venv-noextras/bin/pip install -e .
    /tmp/venv-noextras/bin/python scripts/smoke_no_extras.py

``.ci/run`` runs it so. It needs nothing but the package itself (no pytest): against the built-in emulator, with
its stream defect on every time, it runs ``install()`` (origins listed, then auto) -> requests -> ``uninstall()``,
``guard()`` on sync and async clients, ``llama-guard run -- python -c ...``, and checks that the optional flavours
(``llama_guard.aiohttp``, ``llama_guard.httpx2``, ``llama_guard.requests``) and ``llama-guard --version`` name the
extra they need. Each check prints a line; the first
failure stops the script with exit status 1 and says what went wrong.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import os
import subprocess
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import httpx

import llama_guard
from llama_guard._install import installation as active_installation
from llama_guard.testing import LlamaServerEmulator

CHAT = "/v1/chat/completions"
EXTRAS = {"aiohttp": "aiohttp", "httpx2": "httpx2", "requests": "requests"}  # extra -> the module it brings
REQUESTS = 6  # every other one streamed: unguarded, the emulator drops each request after a stream


class SmokeFailure(Exception):
    pass


def check(condition: bool, what: str) -> None:
    if not condition:
        raise SmokeFailure(what)


def chat(stream: bool) -> dict[str, object]:
    return {"messages": [{"role": "user", "content": "hi"}], "stream": stream, "max_tokens": 2}


def sync_exchange(client: httpx.Client, *, stream_first: bool = False) -> list[bool]:
    """Alternate plain and streamed completions on one pooled client; for each, whether the guard answered it."""
    guarded = []
    for index in range(REQUESTS):
        with client.stream("POST", CHAT, json=chat(stream=index % 2 == (0 if stream_first else 1))) as response:
            response.read()
            check(response.status_code == 200, f"request {index} answered {response.status_code}")
            guarded.append("llama_guard" in response.extensions)
    return guarded


async def async_exchange(client: httpx.AsyncClient) -> list[bool]:
    guarded = []
    for index in range(REQUESTS):
        async with client.stream("POST", CHAT, json=chat(stream=index % 2 == 1)) as response:
            await response.aread()
            check(response.status_code == 200, f"request {index} answered {response.status_code}")
            guarded.append("llama_guard" in response.extensions)
    return guarded


def no_extras_installed() -> None:
    present = [module for module in EXTRAS.values() if importlib.util.find_spec(module) is not None]
    check(not present, f"this must run without the extras, but {present} can be imported: use a venv without them")


def install_listed(url: str) -> None:
    installation = llama_guard.install(origins=[url])
    with httpx.Client(base_url=url) as client:
        check(all(sync_exchange(client)), "install(origins=[url]): a request to the listed origin was not guarded")
    with_async = asyncio.run(_async_client_exchange(url))
    check(all(with_async), "install(origins=[url]): an async request to the listed origin was not guarded")
    check(installation.stats.snapshot().requests == 2 * REQUESTS, "the installation did not count its requests")
    llama_guard.uninstall()
    check(active_installation() is None, "uninstall() left an installation active")
    with httpx.Client(base_url=url) as client:
        response = client.get("/health")
        check("llama_guard" not in response.extensions, "after uninstall() a request was still guarded")


async def _async_client_exchange(url: str) -> list[bool]:
    async with httpx.AsyncClient(base_url=url) as client:
        return await async_exchange(client)


def install_auto(url: str) -> None:
    installation = llama_guard.install()
    with httpx.Client(base_url=url) as client:
        guarded = sync_exchange(client, stream_first=True)
    # The first response (a stream: its connection must still be dropped) is how the server says it is llama.cpp;
    # every later one is guarded.
    check(guarded == [False] + [True] * (REQUESTS - 1), f"install() in auto mode guarded {guarded}")
    check(len(installation.known_origins()) == 1, "install() in auto mode learnt no origin")
    llama_guard.uninstall()
    check(active_installation() is None, "uninstall() left an installation active")


def guard_clients(url: str) -> None:
    with llama_guard.guard(httpx.Client(base_url=url)) as client:
        check(all(sync_exchange(client)), "guard(httpx.Client): a request was not guarded")
    check(all(asyncio.run(_guarded_async_exchange(url))), "guard(httpx.AsyncClient): a request was not guarded")


async def _guarded_async_exchange(url: str) -> list[bool]:
    async with llama_guard.guard(httpx.AsyncClient(base_url=url)) as client:
        return await async_exchange(client)


CHILD = """
import httpx
with httpx.Client(base_url={url!r}) as client:
    for index in range({n}):
        stream = index % 2 == 1
        body = {{"messages": [{{"role": "user", "content": "hi"}}], "stream": stream, "max_tokens": 2}}
        with client.stream("POST", "/v1/chat/completions", json=body) as response:
            response.read()
            assert response.status_code == 200, response.status_code
            assert "llama_guard" in response.extensions, "not guarded"
print("child: all guarded")
"""


def console_script() -> Path:
    """The ``llama-guard`` console script next to this Python: the one the installed package brings."""
    script = Path(sys.executable).with_name("llama-guard")
    check(script.exists(), f"the console script {script} is missing: is the package installed in this venv?")
    return script


def run_command(url: str) -> None:
    """``llama-guard run``: the console script, with the child Python under it."""
    script = console_script()
    env = {key: value for key, value in os.environ.items() if key != "LLAMA_GUARD_ORIGINS"}
    command = [str(script), "run", "--origins", url, "--", sys.executable, "-c", CHILD.format(url=url, n=REQUESTS)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120, check=False)
    check(
        done.returncode == 0 and "child: all guarded" in done.stdout,
        f"llama-guard run exited {done.returncode}; stdout: {done.stdout!r}; stderr: {done.stderr[-2000:]!r}",
    )


def version_names_the_missing_extras() -> None:
    """``llama-guard --version`` works without the extras, and says how to install each library they bring."""
    done = subprocess.run([str(console_script()), "--version"], capture_output=True, text=True, timeout=60, check=False)
    check(done.returncode == 0, f"llama-guard --version exited {done.returncode}; stderr: {done.stderr[-2000:]!r}")
    for extra, module in EXTRAS.items():
        library = "urllib3" if extra == "requests" else module  # the requests extra's line is urllib3's (its pools)
        line = f"{library}: not installed (pip install 'llama-guard[{extra}]')"
        check(line in done.stdout, f"llama-guard --version does not say {line!r}: {done.stdout!r}")


def missing_extras_are_named() -> None:
    for extra, module in EXTRAS.items():
        try:
            importlib.import_module(f"llama_guard.{module}")
        except ImportError as exc:
            check(
                f"llama-guard[{extra}]" in str(exc),
                f"import llama_guard.{module}: the error does not name the extra {extra!r}: {exc}",
            )
        else:
            raise SmokeFailure(f"import llama_guard.{module} worked without {module} installed")


def main() -> int:
    steps: list[tuple[str, Callable[[str], None]]] = [
        ("install(origins=[url]) -> requests -> uninstall()", install_listed),
        ("install() (auto) -> requests -> uninstall()", install_auto),
        ("guard(httpx.Client), guard(httpx.AsyncClient)", guard_clients),
        ("llama-guard run --origins url -- python -c ...", run_command),
        ("a missing extra is named when its flavour is imported", lambda url: missing_extras_are_named()),
        ("llama-guard --version names the missing extras", lambda url: version_names_the_missing_extras()),
    ]
    try:
        no_extras_installed()
    except SmokeFailure as exc:
        print(f"smoke_no_extras: FAILED before starting: {exc}", file=sys.stderr)
        return 1
    # Deterministic stream defect: unguarded, the request after a stream on the same connection is lost.
    with LlamaServerEmulator(stream_close="on_reuse") as server:
        for name, step in steps:
            try:
                step(server.url)
            except Exception as exc:  # the first failure, whatever it is, fails the smoke test loudly
                traceback.print_exc()
                print(f"smoke_no_extras: FAILED: {name}: {exc}", file=sys.stderr)
                return 1
            print(f"smoke_no_extras: ok: {name}")
        stats = server.stats()
    if stats.requests_dropped_after_stream:
        print(f"smoke_no_extras: FAILED: {stats.requests_dropped_after_stream} request(s) lost", file=sys.stderr)
        return 1
    print("smoke_no_extras: every entry point works without extras")
    return 0


if __name__ == "__main__":
    sys.exit(main())
