"""Stalled connections rescued or replaced, counted per origin and logged once per episode.

The process's (``ProcessState.stalls``): the first stalled connection of a burst opens an episode, and a timer
thread logs one WARNING for it a little later, so that the line comes even if the process sends nothing more. One
timer thread at a time serves every origin (a gateway's burst may stall many at once).
"""

from __future__ import annotations

import threading
import time

from .._core.log import logger
from .._core.origins import Origin
from .._core.stats import OTHER_ORIGINS, counted_apart

__all__ = ["EPISODE_SECONDS", "StallLog"]

# A stall episode: the reconnects of one burst come within a few probe deadlines; their WARNING follows this long
# after the first of them.
EPISODE_SECONDS = 2.0


class StallLog:
    """Stalled connections rescued by a kick or replaced, counted per origin and logged once per episode: the first
    of them opens an episode, and ``episode`` seconds later one WARNING says how many there were (a timer thread,
    so that the line comes even if the process sends nothing more: one for the process, however many origins have
    an episode under way)."""

    def __init__(self, episode: float = EPISODE_SECONDS) -> None:
        self._episode = episode
        self._lock = threading.Lock()
        self._counts: dict[Origin, dict[str, int]] = {}
        # When each episode under way began, oldest first (one length for all: the order they end in).
        self._started: dict[Origin, float] = {}
        self._timer: threading.Timer | None = None  # armed for the oldest episode's end while any is under way
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
            if origin in self._started:
                return
            self._started[origin] = time.monotonic()
            episodes = self._episodes
            counted = origin if counted_apart(origin, episodes) else OTHER_ORIGINS  # as the stats
            episodes[counted] = episodes.get(counted, 0) + 1
            timer = None if self._timer is not None else self._arm(self._episode)
        if timer is not None:
            timer.start()

    def _arm(self, delay: float) -> threading.Timer:
        """The timer that ends the oldest episode, ``delay`` from now (started by the caller, out of the lock).
        Under the lock."""
        timer = threading.Timer(delay, lambda: self._end_due(timer))
        timer.daemon = True
        self._timer = timer
        return timer

    def _end_due(self, mine: threading.Timer) -> None:
        """The timer's: log the episodes that have lasted ``episode``, then wait for the next one to end."""
        now = time.monotonic()
        with self._lock:
            if mine is not self._timer:  # cancelled by a flush too late to stop it; another may be armed since
                return
            self._timer = None
            due = []
            for origin, started in self._started.items():
                if now - started < self._episode:
                    break
                due.append(origin)
            ended = self._end(due, now)
            oldest = next(iter(self._started.values()), None)
            timer = None if oldest is None else self._arm(max(0.0, oldest + self._episode - now))
        if timer is not None:
            timer.start()
        self._say(ended, now)

    def flush(self, origin: Origin | None = None) -> None:
        """Log the episode of ``origin`` now (of every origin if None), and end it."""
        now = time.monotonic()
        with self._lock:
            ended = self._end(list(self._counts) if origin is None else [origin], now)
            timer = self._timer if not self._started else None
            if timer is not None:
                self._timer = None
        if timer is not None:
            timer.cancel()
        self._say(ended, now)

    def _end(self, origins: list[Origin], now: float) -> list[tuple[Origin, dict[str, int], float]]:
        """Take the episodes of ``origins`` out of those under way. Under the lock."""
        return [(origin, self._counts.pop(origin, {}), self._started.pop(origin, now)) for origin in origins]

    def _say(self, ended: list[tuple[Origin, dict[str, int], float]], now: float) -> None:
        for origin, counts, started in ended:
            if counts:
                # An episode flushed early (its transport closed) names the time it lasted, not the full episode's.
                seconds = max(0.1, round(min(now - started, self._episode), 1))
                logger.warning(
                    "%s", _episode_line(origin, counts.get("rescued", 0), counts.get("replaced", 0), seconds)
                )


def _episode_line(origin: Origin, rescued: int, replaced: int, seconds: float) -> str:
    """``rescued 27 and replaced 1 stalled connections to ORIGIN in the last 0.4 s (...)``."""
    done = " and ".join(f"{verb} {count}" for verb, count in (("rescued", rescued), ("replaced", replaced)) if count)
    plural = "" if rescued + replaced == 1 else "s"
    # Says what the guard did, not how the requests ended: a replaced one's request may still fail on its new
    # connection (its own retry or error says so).
    if not rescued:
        how = "llama-server before b11737 did not read them; their requests went on new connections"
    elif not replaced:
        how = "llama-server before b11737 had not read them; a kick connection made it read them"
    else:
        how = (
            "llama-server before b11737 had not read them; a kick connection made it read the rescued ones, and the "
            "replaced ones' requests went on new connections"
        )
    return (
        f"{done} stalled connection{plural} to {origin} in the last {seconds:g} s ({how}; each one at DEBUG level on "
        "the 'llama_guard' logger)"
    )
