"""``llama-guard doctor URL``: examine a running llama-server from the client side.

Runs the checks of ``_doctor_checks`` in order (identity, the two keep-alive checks, the pooled load, the optional
burst), turns them into verdicts (``_doctor_verdict``) and prints them, as text or ``--json``, with progress on
stderr. Exit status: 0 no defect found, 1 affected, 2 could not run; a problem that stops doctor is one line on
stderr, never a traceback.
"""

from __future__ import annotations

import dataclasses
import json
import os
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from ..._burst import MAX_BURST
from ..._core.llama_server import build_has_pool_defect
from ..exits import run_command
from ..load import LoadRow
from .checks import (
    BURST_PAUSE,
    BURST_ROUNDS,
    BURST_WINDOW,
    LOAD_CONNECTIONS,
    LOAD_WORKERS,
    burst_check,
    burst_window,
    keepalive_check,
    load_check,
    locate,
    stuck_bound,
)
from .model import AFFECTED, COULD_NOT_TELL, DoctorError, DoctorRun, Finding, Target, parse_target, redact_url
from .progress import Waits
from .report import check_report_path, write_report
from .verdict import OTHER_CLIENTS, LoadShape, client_finding, exit_code, findings

__all__ = ["DoctorOptions", "doctor_json", "format_text", "run_doctor"]

_LABELS = {"affected": "AFFECTED", "not_affected": "not affected", "could_not_tell": "could not tell"}


@dataclass(frozen=True)
class DoctorOptions:
    url: str
    #: Requests of the pooled load per client kind; 0 skips the load.
    requests: int = 100
    #: Connections of the burst test; 0 skips it.
    burst: int = 0
    timeout: float = 10.0
    max_tokens: int = 4
    #: The server's API key; None reads ``LLAMA_API_KEY``. Sent as a bearer token, never printed.
    api_key: str | None = None
    json: bool = False
    report: Path | None = None
    quiet: bool = False


def run_doctor(options: DoctorOptions, *, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Run doctor; the exit status. Whatever stops it is one line on ``err`` (and a JSON error with ``--json``)."""

    def body(out: TextIO, err: TextIO) -> int:
        return _diagnose(options, out, err)

    # The URL as given goes into a --json error: never with its password.
    return run_command("doctor", body, DoctorError, out=out, err=err, json=options.json, url=redact_url(options.url))


def _diagnose(options: DoctorOptions, out: TextIO, err: TextIO) -> int:
    target = parse_target(options.url)
    if not 0 <= options.burst <= MAX_BURST:
        raise DoctorError(f"--burst {options.burst}: expected a whole number from 0 (off) to {MAX_BURST:,}")
    if options.report is not None:
        check_report_path(options.report)
    api_key = options.api_key if options.api_key is not None else os.environ.get("LLAMA_API_KEY") or None
    key_from = None if not api_key else "--api-key" if options.api_key else "LLAMA_API_KEY"
    run = DoctorRun(target, started=time.monotonic())
    progress = None if options.quiet else err
    waits = Waits(progress)
    steps: list[tuple[str, Callable[[], None]]] = []

    def step(title: str) -> Callable[[Callable[[], None]], Callable[[], None]]:
        def add(function: Callable[[], None]) -> Callable[[], None]:
            steps.append((title, function))
            return function

        return add

    shorter = " (then under each shorter path, down to the root)" if target.prefix else ""

    @step(f"identity: GET /health and GET /props on {target.url}{shorter}")
    def _identity() -> None:
        nonlocal target
        found, run.identity = locate(target, options.timeout, api_key, key_from=key_from, waits=waits)
        if found != target:
            run.given_url, run.target, target = target.url, found, found
        if not options.quiet:
            where = f" (the URL given was {run.given_url})" if run.given_url else ""
            print(f"      found llama-server at {target.url}{where}", file=err, flush=True)

    @step("a streamed completion on a new connection: does the server close it after the final chunk?")
    def _stream() -> None:
        run.stream = keepalive_check(
            target, stream=True, timeout=options.timeout, max_tokens=options.max_tokens, api_key=api_key, waits=waits
        )

    @step("a non-streamed completion, then a second request on the same connection")
    def _nonstream() -> None:
        run.nonstream = keepalive_check(
            target, stream=False, timeout=options.timeout, max_tokens=options.max_tokens, api_key=api_key, waits=waits
        )

    def bound() -> float:
        return stuck_bound(
            [None if check is None else check.complete for check in (run.stream, run.nonstream)], options.timeout
        )

    if options.requests:

        @step(f"pooled load with plain httpx: {options.requests} requests")
        def _plain() -> None:
            _say_bound(bound(), err if not options.quiet else None)
            run.plain = _load(options, target, api_key, guarded=False, progress=progress, stuck_after=bound())

        @step(f"pooled load with the guard: {options.requests} requests")
        def _guard() -> None:
            run.guard = _load(options, target, api_key, guarded=True, progress=progress, stuck_after=bound())

    if options.burst:

        @step(f"burst: {options.burst} connections opened at once, GET /health on each")
        def _burst() -> None:
            waits.say(
                f"a connection with no answer within {burst_window(options.timeout):g} s counts as stalled (the "
                f"burst's window: {BURST_WINDOW:g} s, or --timeout if shorter); up to {BURST_ROUNDS} bursts, "
                f"{BURST_PAUSE:g} s apart, until one stalls"
            )
            run.burst = burst_check(target, options.burst, options.timeout, waits)

    for number, (title, function) in enumerate(steps, 1):
        if not options.quiet:
            print(f"[{number}/{len(steps)}] {title} ...", file=err, flush=True)
        function()
    assert run.identity is not None
    assert run.stream is not None
    assert run.nonstream is not None
    shape = LoadShape(LOAD_WORKERS, LOAD_CONNECTIONS)
    # The pooled load is the unguarded client's own finding (what it lost, and why), not a line of defect 1's.
    run.findings = findings(run.identity, run.stream, run.nonstream, run.burst)
    stream_close = any(item.defect == "stream-close" and item.status == AFFECTED for item in run.findings)
    client = client_finding(run.plain, run.guard, stream_close=stream_close, shape=shape)
    if client is not None:
        run.findings.append(client)
    run.seconds = time.monotonic() - run.started
    code = exit_code(run.findings)
    if options.report is not None:
        write_report(run, options.report, code)
        if not options.quiet:
            print(f"report written to {options.report}", file=err)
    if options.json:
        print(json.dumps(doctor_json(run, code), indent=2), file=out)
    else:
        print(format_text(run, code), file=out)
    return code


def _say_bound(seconds: float, err: TextIO | None) -> None:
    if err is not None:
        print(
            f"      a request with no answer within {seconds:g} s counts as stuck (10 x the slowest completion so "
            "far, at least 1 s, at most --timeout)",
            file=err,
            flush=True,
        )


def _load(
    options: DoctorOptions,
    target: Target,
    api_key: str | None,
    *,
    guarded: bool,
    progress: TextIO | None,
    stuck_after: float,
) -> LoadRow:
    return load_check(
        target,
        guarded=guarded,
        requests=options.requests,
        timeout=options.timeout,
        max_tokens=options.max_tokens,
        api_key=api_key,
        progress=progress,
        stuck_after=stuck_after,
    )


def _wrap(text: str, indent: str) -> str:
    return textwrap.fill(
        text, width=110, initial_indent=indent, subsequent_indent=indent + "  ", break_on_hyphens=False
    )


def _finding_text(item: Finding) -> list[str]:
    lines = [f"{_LABELS[item.status]:<15} {item.title}"]
    lines += [_wrap(f"- {line}", "    ") for line in item.evidence]
    if item.fix:
        lines.append(_wrap(f"fix: {item.fix}", "    "))
    return lines


def format_text(run: DoctorRun, code: int) -> str:
    identity = run.identity
    lines = [f"llama-guard doctor {run.target.url}"]
    if run.given_url:
        lines.append(f"(llama-server found at {run.target.url}; the URL given was {run.given_url})")
    if identity is not None:
        build = identity.build_info or "not reported"
        number = f" = b{identity.build_number}" if identity.build_number is not None else " (build number unknown)"
        slots = f", {identity.total_slots} slots" if identity.total_slots is not None else ""
        lines.append(
            f"server: {identity.server_header or 'no Server header'}, build {build}{number}, "
            f"model {identity.model or '?'}{slots}"
        )
    for item in run.findings:
        lines += ["", *_finding_text(item)]
    affected = [item.defect for item in run.findings if item.status == AFFECTED]
    unknown = [item.defect for item in run.findings if item.status == COULD_NOT_TELL]
    if affected:
        verdict = f"a client here is exposed: affected: {', '.join(affected)}" + (
            f"; could not tell: {', '.join(unknown)}" if unknown else ""
        )
        lines += [
            "",
            _wrap(
                f"for clients that cannot use llama_guard (another language, a proxy in front of llama-server): "
                f"{OTHER_CLIENTS} (nginx's default upstream, or 'Connection: close' on every request)",
                "",
            ),
        ]
    elif unknown:
        verdict = f"could not tell: {', '.join(unknown)} (no defect found, but not every defect was examined)"
    else:
        verdict = "no defect found"
    lines += ["", f"result: {verdict} (exit status {code}; checks took {run.seconds:.1f} s)"]
    return "\n".join(lines)


def _load_json(row: LoadRow | None) -> dict[str, Any] | None:
    if row is None:
        return None
    return {
        "requests": row.requests,
        "errors": row.errors,
        "stuck": row.stuck,
        "stuck_after": row.stuck_after,
        "error_kinds": dict(sorted(row.error_kinds.items())),
        "median_first_byte": round(row.median, 6),
        "max_first_byte": round(row.maximum, 6),
    }


def doctor_json(run: DoctorRun, code: int) -> dict[str, Any]:
    """The ``--json`` document (its shape is documented in docs/cli.md)."""
    identity = run.identity
    burst = run.burst
    return {
        "url": run.target.url,
        "given_url": run.given_url,
        "server": None
        if identity is None
        else {
            **dataclasses.asdict(identity),
            "build_has_pool_defect": build_has_pool_defect(identity.build_info),
        },
        "findings": [dataclasses.asdict(item) | {"evidence": list(item.evidence)} for item in run.findings],
        "checks": {
            "stream": None if run.stream is None else dataclasses.asdict(run.stream),
            "nonstream": None if run.nonstream is None else dataclasses.asdict(run.nonstream),
        },
        "load": None
        if run.plain is None
        else {
            "workers": LOAD_WORKERS,
            "connections": LOAD_CONNECTIONS,
            "plain": _load_json(run.plain),
            "guard": _load_json(run.guard),
        },
        "burst": None
        if burst is None
        else {
            "connections": burst.connections,
            "error": burst.error,
            "rounds": [
                {
                    "window": item.window,
                    "stalled": item.stalled,
                    "first_bytes": [None if v is None else round(v, 6) for v in item.first_bytes],
                }
                for item in burst.rounds
            ],
        },
        "seconds": round(run.seconds, 3),
        "exit_code": code,
    }
