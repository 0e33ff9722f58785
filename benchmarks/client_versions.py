"""Does upgrading the HTTP client fix llama-server's stream defect? Plain vs guarded, on the client installed here.

httpcore2 2.17.0 moved its check for an idle connection the server has closed from the pool's hand-out
(``has_expired()``) to the moment a request takes the connection: later, so it sees more end-of-files. This runs the
proxy-like load (``alternatives.py``'s: 16 threads share one client with a 4-connection pool, every other request
streamed and read to the end, ``--requests`` per run) on a fresh real llama-server b11434 with the tiny model, for
plain keep-alive and for the guard (``connection="reuse"``: on loopback the default closes every connection, which
loses nothing by construction), alternating, ``--runs`` times, and prints the requests lost. Run it in one
environment per client version to compare them::

    python benchmarks/client_versions.py --library httpx2 --runs 8      # with httpx2 2.16.2 installed, then 2.17.0

Needs the real server (``scripts/get_llama_server.py``) and, unless ``--model`` names one, the ``real`` extra to
write the tiny model.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

from _common import machine, rotated, table

from llama_guard._cli.load import ClientErrors, LoadRow, proxy_load
from llama_guard.testing import RealLlamaServer, find_llama_server, write_tiny_model

VARIANTS = ("plain", "guard")


def run_load(library: str, variant: str, model: Path, binary: Path, requests: int) -> Counter[str]:
    """One run on a fresh server: the errors of the requests lost, by kind (empty: none lost)."""
    lib: Any = importlib.import_module(library)
    inner = lib.HTTPTransport(limits=lib.Limits(max_connections=4, max_keepalive_connections=4))
    transport = inner
    if variant == "guard":
        guard: Any = importlib.import_module("llama_guard" if library == "httpx" else "llama_guard.httpx2")
        transport = guard.GuardTransport(inner, policy=guard.GuardPolicy(connection="reuse"))
    row = LoadRow(scenario="proxy-like", client=f"{variant} {library}")
    with (
        RealLlamaServer(model, binary=binary) as server,
        lib.Client(transport=transport, base_url=server.url, timeout=30.0) as client,
    ):
        proxy_load(
            client,
            row,
            requests=requests,
            workers=16,
            path="/v1/chat/completions",
            body_for=_body,
            errors=ClientErrors(lib.HTTPError, lib.TimeoutException),
        )
    return Counter(row.error_kinds)


def _body(index: int) -> dict[str, object]:
    """Every other request streamed, 4 tokens each."""
    return {"messages": [{"role": "user", "content": f"r {index}"}], "max_tokens": 4, "stream": index % 2 == 1}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--library", choices=("httpx", "httpx2"), default="httpx")
    parser.add_argument("--runs", type=int, default=4, help="runs per variant (default 4)")
    parser.add_argument("--requests", type=int, default=600, help="requests per run (default 600)")
    parser.add_argument("--model", type=Path, help="a GGUF model (default: the tiny model, written now)")
    args = parser.parse_args(argv)
    binary = find_llama_server()
    if binary is None:
        print("no llama-server: python scripts/get_llama_server.py", file=sys.stderr)
        return 2
    core = "httpcore" if args.library == "httpx" else "httpcore2"
    versions = ", ".join(f"{name} {importlib.import_module(name).__version__}" for name in (args.library, core))
    print(f"machine: {machine()}; {versions}; llama-server {binary}")
    lost: dict[str, list[int]] = {variant: [] for variant in VARIANTS}
    kinds: dict[str, Counter[str]] = {variant: Counter() for variant in VARIANTS}
    with tempfile.TemporaryDirectory() as folder:
        model = args.model if args.model is not None else write_tiny_model(Path(folder) / "tiny.gguf")
        for run in range(args.runs):
            for variant in rotated(VARIANTS, run):
                errors = run_load(args.library, variant, Path(model), binary, args.requests)
                lost[variant].append(sum(errors.values()))
                kinds[variant].update(errors)
    rows = []
    for variant in VARIANTS:
        total = sum(lost[variant])
        share = f"{100 * total / (args.requests * args.runs):.1f}%"
        rows.append([f"{variant} {args.library}", " ".join(map(str, lost[variant])), f"{total} ({share})"])
    print(table(["client", f"lost per run of {args.requests}", "lost in all"], rows))
    for variant in VARIANTS:
        for kind, count in kinds[variant].most_common():
            print(f"  {variant}: {count} x {kind}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
