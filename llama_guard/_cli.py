"""The ``llama-guard`` command (also ``python -m llama_guard``)."""

from __future__ import annotations

import argparse
import logging
import sys

__all__ = ["main"]


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1; got {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0; got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llama-guard",
        description="Make pooled httpx clients safe against llama.cpp's llama-server.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = commands.add_parser(
        "demo",
        help="show both llama-server defects and the guard's fix on the built-in emulator (no server needed)",
        description="Runs a proxy-like load and a connection burst against the built-in llama-server emulator, "
        "with plain httpx and with the guard, and prints a table. Exit status 0 when the guard lost nothing.",
    )
    demo.add_argument("--requests", type=_positive_int, default=600, help="requests in the proxy-like load (600)")
    demo.add_argument("--clients", type=_positive_int, default=32, help="connections in the burst (32)")
    demo.add_argument("--seconds", type=_positive_float, default=5.0, help="length of each burst run (5)")
    demo.add_argument("-v", "--verbose", action="store_true", help="show the guard's warnings as it recovers")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.verbose else logging.ERROR, format="%(message)s")
    if args.command == "demo":
        from ._demo import run_demo

        return run_demo(requests=args.requests, clients=args.clients, seconds=args.seconds)
    return 2  # pragma: no cover - argparse rejects unknown commands


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
