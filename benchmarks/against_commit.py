"""This checkout's guard beside an earlier commit's, in interleaved runs of ``alternatives.py`` on one machine.

Whether a change moved the guard's figures, or the machine did: the earlier commit is checked out in a git worktree,
and each pair of runs is one ``alternatives.py --runs 1`` from each tree (each tree's own script and package), in
alternating order, so that the load the machine goes through falls on both alike. Every run is saved; the summary
prints, per (round trip, kind), the median ok req/s and slowest first response of each tree, and for the guard's
kinds the probes' kicks and give-ups; for forced *reuse* beside the fixed pool, how many runs kept within the pool's
floor + 0.3 s (issue 22's target)::

    python benchmarks/against_commit.py a88cbca --pairs 20 -- --scenarios burst --round-trips loopback \\
        --kinds "guard reuse"

Arguments after ``--`` go to both trees' ``alternatives.py`` (``--runs``, ``--save`` and ``--out`` are set here).
Needs what ``alternatives.py`` needs (the llama-server builds, nginx for its kind) and a commit whose
``alternatives.py`` takes the same arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
FLOOR = "fixed pool: plain httpx"
FLOOR_MARGIN = 0.3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("commit", help="the earlier commit (anything git rev-parse takes)")
    parser.add_argument("--pairs", type=int, default=10, help="pairs of runs (default 10)")
    parser.add_argument("--keep", type=Path, help="folder for every run's saved results (default: a temporary one)")
    args, rest = parser.parse_known_args()
    forwarded = rest[1:] if rest[:1] == ["--"] else rest
    if args.pairs < 1:
        parser.error(f"--pairs must be at least 1, got {args.pairs}")
    with tempfile.TemporaryDirectory(prefix="llama-guard-against-") as scratch:
        keep = args.keep or Path(scratch) / "runs"
        keep.mkdir(parents=True, exist_ok=True)
        worktree = Path(scratch) / "earlier"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(worktree), args.commit], check=True)
        try:
            trees = {"this": ROOT, args.commit: worktree}
            for pair in range(args.pairs):
                order = list(trees) if pair % 2 == 0 else list(reversed(trees))
                for name in order:
                    _run(trees[name], keep / f"{pair:03d}-{name}.json", forwarded, scratch)
            print(_summary(keep, list(trees)))
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(worktree)], check=False)
    return 0


def _run(tree: Path, save: Path, forwarded: list[str], scratch: str) -> None:
    """One ``alternatives.py --runs 1`` from ``tree``, with ``tree``'s package first on the path."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    command = [
        sys.executable,
        "benchmarks/alternatives.py",
        "--runs",
        "1",
        "--out",
        f"{scratch}/img",
        "--save",
        str(save),
    ]
    print(f"{save.stem} ...", flush=True)
    subprocess.run([*command, *forwarded], cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL)


def _summary(folder: Path, trees: list[str]) -> str:
    cells: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for path in sorted(folder.glob("*.json")):
        tree = path.stem.split("-", 1)[1]
        results = json.loads(path.read_text())["results"]
        floors = {r["trip"]: max(r["block"]["first_responses"]) for r in results if r["kind"] == FLOOR}
        for result in results:
            block = result["block"]
            cells.setdefault((result["trip"], result["kind"], tree), []).append(
                {
                    "ok_per_s": sum(o["ok"] for o in block["outcomes"]) / block["seconds"],
                    "slowest": max(block["first_responses"]),
                    "floor": floors.get(result["trip"]),
                    "guard": block.get("guard") or {},
                }
            )
    lines = []
    for trip, kind in sorted({(trip, kind) for trip, kind, _ in cells}):
        for tree in trees:
            runs = cells.get((trip, kind, tree), [])
            if not runs:
                continue
            slowest = [1000 * r["slowest"] for r in runs]
            line = (
                f"{trip:10} {kind:26} {tree:>9}: {len(runs)} runs, ok req/s "
                f"{statistics.median(r['ok_per_s'] for r in runs):6.1f}, slowest first response median "
                f"{statistics.median(slowest):5.0f} ms (max {max(slowest):.0f})"
            )
            if runs[0]["guard"]:
                line += (
                    f", runs with kicks {sum(r['guard'].get('probe_kicks', 0) > 0 for r in runs)}, probes given up "
                    f"{sum(r['guard'].get('probes_given_up', 0) for r in runs)} (answered late "
                    f"{sum(r['guard'].get('probes_answered_late', 0) for r in runs)})"
                )
            if kind == "guard reuse" and all(r["floor"] is not None for r in runs):
                within = sum(r["slowest"] <= r["floor"] + FLOOR_MARGIN for r in runs)
                line += f", within the fixed pool's floor + {FLOOR_MARGIN} s in {within} of {len(runs)}"
            lines.append(line)
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
