"""When a guarded request is sent again, and when the guard stops: free of I/O, of sleeping and of logging.

The request's machine (``request_machine.py``) hands each attempt's `Verdict` here (`RetryPacing.follow`) and asks
for the seconds to wait before the next attempt (`next_delay`), None when the guard stops:

- a server loading a model (a 503) is waited for up to ``max_loading_wait`` in all (a last attempt when it has
  passed; a wait broken by another failure goes on from where it was, not from zero), polled at most every
  `STATUS_BACKOFF` from the request's second loading answer, and the attempts that found it loading are not counted
  in ``max_attempts``, nor their time in ``max_retry_time``;
- any other retry is bounded by ``max_attempts`` and ``max_retry_time``;
- the wait: an explicit ``Retry-After``; none after a dead pooled connection; else full jitter, over a window as wide
  as the probe deadline in force for a stalled connection (reconnects of one burst spread over less reach the server
  as a new burst and stall again), at least `STATUS_BACKOFF` wide for a 503 without ``Retry-After``.

tenacity computes the jitter (`tenacity.wait_random_exponential`); the order is tenacity's own (retry, then wait,
then stop, which sees the upcoming sleep).
"""

from __future__ import annotations

from typing import Final

import tenacity

from .decisions import PROBE_LOADING, Verdict
from .policy import GuardPolicy

__all__ = ["STATUS_BACKOFF", "RetryPacing"]

# The smallest backoff window for a 503 without Retry-After (doubling: 0.5, 1, 2 s with the default cap).
STATUS_BACKOFF: Final = 0.5


class RetryPacing:
    """The retry pace of one request: its loading wait and the retry clock, across its attempts."""

    __slots__ = ("_policy", "_state", "loading_attempts", "loading_since", "loading_spent", "retry_clock")

    def __init__(self, policy: GuardPolicy, started: float) -> None:
        """``started``: when the guard received the request (`time.monotonic`), where ``max_retry_time`` counts
        from."""
        self._policy = policy
        # What tenacity's wait reads (attempt_number); one per request, its count advanced with each retry.
        self._state = tenacity.RetryCallState(retry_object=None, fn=None, args=(), kwargs={})  # type: ignore[arg-type]
        self.loading_attempts = 0  # attempts that found the server loading
        self.loading_since: float | None = None  # since when it is loading (None while it is not)
        self.loading_spent = 0.0  # seconds of loading waits ended earlier (a 503, a dead connection, a 503 again)
        self.retry_clock = started  # moved on by the time spent waiting for the server to load

    def follow(self, verdict: Verdict | None, now: float) -> None:
        """After a verdict: start or end the wait for a loading server."""
        if verdict is not None and verdict.loading and verdict.retry:
            self.loading_attempts += 1
            if self.loading_since is None:
                self.loading_since = now
        elif self.loading_since is not None:
            self.retry_clock += now - self.loading_since
            self.loading_spent += now - self.loading_since
            self.loading_since = None

    def next_delay(self, verdict: Verdict | None, *, attempts: int, probe_deadline: float, now: float) -> float | None:
        """Seconds to wait before the next attempt after ``attempts`` attempts whose last ended with ``verdict``, or
        None when the guard stops (no retry, or a bound reached). ``probe_deadline``: the one the request's last
        probe waited, the width of a stalled connection's reconnect window."""
        if verdict is None or not verdict.retry:
            return None
        delay = self._wait(verdict, probe_deadline)
        if self.loading_since is not None and verdict is not PROBE_LOADING:
            if self.loading_attempts > 1:
                # The loading wait is bounded in time, not in attempts: a server still loading is polled at most
                # every STATUS_BACKOFF, whatever Retry-After (0, from a proxy) or backoff_max (0, in tests) say.
                delay = max(delay, STATUS_BACKOFF)
            left = self.loading_since + self._policy.max_loading_wait - self.loading_spent - now
            if left <= 0 or (verdict.delay is not None and verdict.delay >= left):  # or the server says: not by then
                return None
            delay = min(delay, left)  # the guard's own wait: the last poll as max_loading_wait passes, not before
        elif self._stop(verdict, attempts, now + delay):
            return None
        self._state.attempt_number += 1
        return delay

    def _wait(self, verdict: Verdict, probe_deadline: float) -> float:
        if not verdict.backoff:
            return 0.0
        if verdict.delay is not None:
            return verdict.delay
        policy = self._policy
        if verdict.stall:
            multiplier = max(policy.backoff, probe_deadline)
        elif verdict.status:
            # A 503 without Retry-After: llama-server loading a model, which takes seconds, not milliseconds.
            multiplier = max(policy.backoff, STATUS_BACKOFF)
        else:
            multiplier = policy.backoff
        wait: float = tenacity.wait_random_exponential(multiplier=multiplier, max=policy.backoff_max)(self._state)
        return wait

    def _stop(self, verdict: Verdict, attempts: int, resumes: float) -> bool:
        """Whether the guard stops instead of sending again at ``resumes`` (after the wait), out of a loading wait."""
        policy = self._policy
        if verdict is PROBE_LOADING:
            # The probe found the server loading: the request itself has not been sent. It goes once, unprobed (the
            # server reads connections), so the caller gets the server's own answer, whatever max_loading_wait is.
            return False
        if attempts - self.loading_attempts >= policy.max_attempts:
            return True
        return policy.max_retry_time is not None and resumes - self.retry_clock >= policy.max_retry_time

    def counted(self, attempts: int) -> int:
        """Of ``attempts``, those counted in ``max_attempts`` (not the ones that found the server loading)."""
        return attempts - self.loading_attempts

    def why_stopped(self, verdict: Verdict | None, attempts: int) -> str:
        """Why the guard stopped, for the caller's error message."""
        policy = self._policy
        if verdict is not None and not verdict.retry:
            return f"not retried: {verdict.reason}"
        if self.loading_since is not None:
            return f"max_loading_wait={policy.max_loading_wait:g} s reached while the server was loading"
        if self.counted(attempts) >= policy.max_attempts:
            return f"max_attempts={policy.max_attempts} reached"
        return f"max_retry_time={policy.max_retry_time:g} s reached"
