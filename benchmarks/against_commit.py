"""This checkout's guard beside an earlier commit's, in interleaved runs of ``alternatives.py`` on one machine.

Whether a change moved the guard's figures, or the machine did: the earlier commit is checked out in a git worktree,
and each pair of runs is one ``alternatives.py --runs 1`` from each tree (each tree's own script and package), in
alternating order, so that the load the machine goes through falls on both alike. Every run is saved; the summary
prints, per (round trip, kind), the median ok req/s and slowest first response of each tree, and for the guard's
kinds the probes' kicks and give-ups; for the default and forced *reuse* in a burst beside the fixed pool, how many
runs kept within its floor + 0.05 s and + 0.3 s (issue 22's targets, ``alternatives.FLOOR_MARGINS``)::

    python benchmarks/against_commit.py a88cbca --pairs 20 -- --scenarios burst --round-trips loopback \\
        --kinds "guard reuse"

Arguments after ``--`` go to both trees' ``alternatives.py`` (``--runs``, ``--save`` and ``--out`` are set here).
Needs what ``alternatives.py`` needs (the llama-server builds, nginx for its kind) and a commit whose
``alternatives.py`` takes the same arguments.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from alternatives import FIXED, FLOOR_MARGINS, Result, load, seconds_or_stuck

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


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
    """Per (round trip, kind), each tree's runs read back with ``alternatives.load``; a guard kind with a floor
    target (``FLOOR_MARGINS``) is paired with the fixed pool's plain client of the same run (the same file)."""
    cells: dict[tuple[str, str, str], list[tuple[Result, float | None]]] = {}
    for path in sorted(folder.glob("*.json")):
        tree = path.stem.split("-", 1)[1]
        results, _ = load(path)
        floors = {r.trip: r.slowest for r in results if r.kind == FIXED and r.scenario == "burst"}
        for result in results:
            cells.setdefault((result.trip, result.kind, tree), []).append((result, floors.get(result.trip)))
    lines = []
    for trip, kind in sorted({(trip, kind) for trip, kind, _ in cells}):
        for tree in trees:
            runs = cells.get((trip, kind, tree), [])
            if not runs:
                continue
            slowest = [r.slowest for r, _ in runs]
            line = (
                f"{trip:10} {kind:26} {tree:>9}: {len(runs)} runs, ok req/s "
                f"{statistics.median(r.block.rate for r, _ in runs):6.1f}, slowest first response median "
                f"{seconds_or_stuck(statistics.median(slowest))} (max {seconds_or_stuck(max(slowest))})"
            )
            guard = [r.block.guard for r, _ in runs if r.block.guard]
            if guard:
                line += (
                    f", runs with kicks {sum(g.get('probe_kicks', 0) > 0 for g in guard)}, probes given up "
                    f"{sum(g.get('probes_given_up', 0) for g in guard)} (answered late "
                    f"{sum(g.get('probes_answered_late', 0) for g in guard)})"
                )
            margin = FLOOR_MARGINS.get(kind)
            paired = [(r.slowest, floor) for r, floor in runs if floor is not None]
            if margin is not None and paired:
                within = sum(own <= floor + margin for own, floor in paired)
                line += f", within the fixed pool's floor + {margin:g} s in {within} of {len(paired)}"
            lines.append(line)
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
