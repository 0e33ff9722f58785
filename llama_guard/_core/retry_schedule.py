"""When a guarded request is sent again, and when the guard stops: the retry schedule, free of I/O.

A driver judges each attempt into its `RequestState` (``judge_failure``/``judge_response``), then asks
`RetrySchedule.next_delay()`: the seconds to sleep before the next attempt, or None to stop. The driver's loop is
then the same on every stack::

    schedule = RetrySchedule(run)
    while (delay := schedule.next_delay()) is not None:
        sleep(delay)
        outcome = attempt()          # judged into run; a failure is kept, not raised
    return outcome                   # a response as it is; a failure raised as the guard's final error

The rules are `RequestState`'s tenacity callables (``stop``, ``wait``, ``retry``, ``before_sleep``), run in
tenacity's order (retry, then wait, then stop, which sees the upcoming sleep; then before_sleep) on a
`tenacity.RetryCallState`; no event loop, no sleep here.
"""

from __future__ import annotations

from typing import Any

import tenacity

__all__ = ["RetrySchedule"]


class RetrySchedule:
    """The retry schedule of one request (``run``: its `RequestState`), whose first attempt was judged already."""

    __slots__ = ("_before_sleep", "_retry", "_state", "_stop", "_wait")

    def __init__(self, run: Any) -> None:
        rules = run.retrying_kwargs()
        self._retry = rules["retry"]
        self._wait = rules["wait"]
        self._stop = rules["stop"]
        self._before_sleep = rules["before_sleep"]
        self._state = tenacity.RetryCallState(retry_object=None, fn=None, args=(), kwargs={})  # type: ignore[arg-type]

    def next_delay(self) -> float | None:
        """After an attempt was judged: seconds to wait before the next one, or None when the guard stops (the
        verdict says no retry, or the stop rule: attempts, retry time, loading wait)."""
        state = self._state
        if not self._retry(state):
            return None
        delay: float = self._wait(state)
        state.upcoming_sleep = delay
        if self._stop(state):
            return None
        self._before_sleep(state)
        state.attempt_number += 1
        return delay
