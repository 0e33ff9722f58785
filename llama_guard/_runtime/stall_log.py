"""Stalled connections rescued or replaced, counted per origin and logged once per episode.

The process's (``ProcessState.stalls``): the first stalled connection of a burst opens an episode, and a timer
thread logs one WARNING for it a little later, so that the line comes even if the process sends nothing more.
"""

from __future__ import annotations

import threading
import time

from .._core.log import logger
from .._core.origin_book import MAX_ORIGINS
from .._core.origins import Origin
from .._core.stats import OTHER_ORIGINS

__all__ = ["EPISODE_SECONDS", "StallLog"]

# A stall episode: the reconnects of one burst come within a few probe deadlines; their WARNING follows this long
# after the first of them.
EPISODE_SECONDS = 2.0


class StallLog:
    """Stalled connections rescued by a kick or replaced, counted per origin and logged once per episode: the first
    of them opens an episode, and ``episode`` seconds later one WARNING says how many there were (a timer thread,
    so that the line comes even if the process sends nothing more)."""

    def __init__(self, episode: float = EPISODE_SECONDS) -> None:
        self._episode = episode
        self._lock = threading.Lock()
        self._counts: dict[Origin, dict[str, int]] = {}
        self._timers: dict[Origin, threading.Timer] = {}
        self._started: dict[Origin, float] = {}
        self._episodes: dict[Origin, int] = {}  # episodes begun per origin, for the metrics

    def episodes(self) -> dict[Origin, int]:
        """How many stall episodes began per origin in this process (each one WARNING)."""
        with self._lock:
            return dict(self._episodes)

    def replaced(self, origin: Origin, detail: str) -> None:
        """One stalled connection to ``origin`` is being replaced; ``detail``: the DEBUG record's text."""
        self._count(origin, "replaced", detail)

    def rescued(self, origin: Origin, detail: str) -> None:
        """A connection to ``origin`` that had not answered its probe by the learnt deadline answered after a kick
        (`GuardPolicy.probe_kick`); ``detail``: the DEBUG record's text."""
        self._count(origin, "rescued", detail)

    def _count(self, origin: Origin, what: str, detail: str) -> None:
        logger.debug("%s", detail)
        with self._lock:
            counts = self._counts.setdefault(origin, {})
            counts[what] = counts.get(what, 0) + 1
            if origin in self._timers:
                return
            self._started[origin] = time.monotonic()
            episodes = self._episodes
            counted = origin if origin in episodes or len(episodes) < MAX_ORIGINS else OTHER_ORIGINS  # as the stats
            episodes[counted] = episodes.get(counted, 0) + 1
            timer = self._timers[origin] = threading.Timer(self._episode, self.flush, args=(origin,))
            timer.daemon = True
        timer.start()

    def flush(self, origin: Origin | None = None) -> None:
        """Log the episode of ``origin`` now (of every origin if None), and end it."""
        now = time.monotonic()
        with self._lock:
            origins = list(self._counts) if origin is None else [origin]
            ended = [
                (item, self._counts.pop(item, {}), self._timers.pop(item, None), self._started.pop(item, now))
                for item in origins
            ]
        for item, counts, timer, started in ended:
            if timer is not None:
                timer.cancel()
            if counts:
                # An episode flushed early (its transport closed) names the time it lasted, not the full episode's.
                seconds = max(0.1, round(min(now - started, self._episode), 1))
                logger.warning("%s", _episode_line(item, counts.get("rescued", 0), counts.get("replaced", 0), seconds))


def _episode_line(origin: Origin, rescued: int, replaced: int, seconds: float) -> str:
    """``rescued 27 and replaced 1 stalled connections to ORIGIN in the last 0.4 s (...)``."""
    done = " and ".join(f"{verb} {count}" for verb, count in (("rescued", rescued), ("replaced", replaced)) if count)
    plural = "" if rescued + replaced == 1 else "s"
    how = (
        "llama-server before b11737 did not read them"
        if not rescued
        else "llama-server before b11737 had not read them; a kick connection made it read the rescued ones"
    )
    return (
        f"{done} stalled connection{plural} to {origin} in the last {seconds:g} s ({how}; no request was lost; "
        "each one at DEBUG level on the 'llama_guard' logger)"
    )
