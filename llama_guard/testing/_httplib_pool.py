"""A line-by-line model of cpp-httplib's dynamic ``ThreadPool``.

cpp-httplib hands every accepted socket to ``ThreadPool::enqueue`` as one job;
the thread that dequeues it runs that connection's whole keep-alive loop, so a
thread is "busy" for as long as the client keeps the connection.  The pool
starts ``base`` threads and may add *dynamic* threads up to ``max``.  The
shipped code (``httplib.cpp``, before llama.cpp b11737) is::

    bool ThreadPool::enqueue(std::function<void()> fn) {
      { lock;
        jobs_.push_back(std::move(fn));
        if (idle_thread_count_ == 0 &&
            threads_.size() + dynamic_threads_.size() < max_thread_count_) {
          cleanup_finished_threads();
          dynamic_threads_.emplace_back(std::thread([this] { worker(true); }));
        } }
      cond_.notify_one();
    }

    void ThreadPool::worker(bool is_dynamic) {
      for (;;) {
        { lock;
          idle_thread_count_++;
          if (is_dynamic) { if (!cond_.wait_for(lock, 3s, pred)) { idle--; exit; } }
          else            { cond_.wait(lock, pred); }
          idle_thread_count_--;            // <- only once the woken thread runs
          if (shutdown_ && jobs_.empty()) break;
          fn = jobs_.front(); jobs_.pop_front(); }
        fn();
        if (is_dynamic) { lock; if (jobs_.empty()) { exit; } }
      }
    }

The bug: ``idle_thread_count_`` is decremented by the *woken* thread after it
re-acquires the mutex.  A thread that was notified for job 1 but has not run
yet still counts as idle, so when the accept loop enqueues job 2, 3, ... in a
burst it sees ``idle != 0`` and spawns nothing.  Once the few base threads
finally run they each take one connection and keep it (keep-alive), and the
surplus jobs sit in ``jobs_`` -- their requests unread in the kernel's Recv-Q --
until some connection closes.  Later enqueues that do see ``idle == 0`` spawn a
dynamic thread, but it takes the *front* (oldest) job, so the backlog moves to
the most recently accepted connections.

Python cannot reproduce the C++ scheduler's timing by accident, so the window
is modelled explicitly: a notified thread waits ``wakeup_latency`` seconds (the
OS wake-up latency, microseconds in C++ on an idle box, milliseconds on a busy
one) before it re-takes the lock, and stays counted as idle meanwhile; a new
dynamic thread likewise needs ``wakeup_latency`` to start.  With a latency
larger than the client's connect burst the stall is deterministic.

``idle_counter_bug=False`` models the fixed pool: it spawns whenever the queued
jobs outnumber the idle threads (``jobs_.size() > idle_thread_count_``), which
is correct no matter how late the notified threads run.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["HttplibThreadPool", "PoolCounters"]

#: cpp-httplib's CPPHTTPLIB_THREAD_POOL_IDLE_TIMEOUT: how long a dynamic thread
#: waits for work before it exits.
DYNAMIC_IDLE_TIMEOUT = 3.0

Job = Callable[[], None]


@dataclass(frozen=True)
class PoolCounters:
    """A consistent view of the pool's bookkeeping, taken under its mutex."""

    base_threads: int
    dynamic_threads: int
    idle_threads: int
    queued_jobs: int
    dynamic_spawned: int
    peak_threads: int


# The settings are the fields (keyword-only); the mutable state is made in __post_init__. eq=False: a pool is
# equal only to itself (and stays hashable).
@dataclass(eq=False, kw_only=True)
class HttplibThreadPool:
    """cpp-httplib's ``ThreadPool`` with the idle-counter bug switchable.

    ``stop_event`` lets a notified thread's simulated wake-up latency end early
    on shutdown, so ``shutdown`` stays bounded in time.
    """

    base_threads: int
    max_threads: int
    idle_counter_bug: bool
    wakeup_latency: float
    stop_event: threading.Event
    name: str = "llama-http"
    dynamic_idle_timeout: float = DYNAMIC_IDLE_TIMEOUT

    def __post_init__(self) -> None:
        if self.max_threads < self.base_threads:
            raise ValueError("max_threads must be >= base_threads")
        self._mutex = threading.Lock()
        self._cond = threading.Condition(self._mutex)
        self._jobs: collections.deque[Job] = collections.deque()
        self._threads: list[threading.Thread] = []
        self._dynamic: list[threading.Thread] = []
        self._finished: list[threading.Thread] = []
        self._idle = 0
        self._shutdown = False
        self._spawned = 0
        self._peak = 0
        self._started = False

    # -- lifecycle ---------------------------------------------------------

    def start(self) -> None:
        """Spawn the base threads, as the C++ constructor does."""
        with self._mutex:
            if self._started:
                raise RuntimeError("pool already started")
            self._started = True
            for index in range(self.base_threads):
                self._start_worker_locked(dynamic=False, name=f"{self.name}-{index}")
            self._peak = len(self._threads)

    def enqueue(self, job: Job) -> bool:
        """Queue one connection; spawn a dynamic thread by the chosen rule."""
        with self._mutex:
            if self._shutdown:
                return False
            self._jobs.append(job)
            total = len(self._threads) + len(self._dynamic)
            needs_thread = self._idle == 0 if self.idle_counter_bug else len(self._jobs) > self._idle
            if needs_thread and total < self.max_threads:
                self._cleanup_finished_locked()
                self._spawn_dynamic_locked()
            # C++ notifies just after unlocking; Python insists on holding the
            # lock, which only delays the woken thread until we return.
            self._cond.notify()
        return True

    def shutdown(self) -> list[Job]:
        """Stop accepting work; return the jobs no thread ever dequeued.

        In C++ the workers drain such jobs after shutdown, but because the
        server socket is already invalid ``process_server_socket`` skips the
        keep-alive loop and just closes the socket.  Returning them lets the
        owner do exactly that (and account for how long they waited).
        """
        with self._mutex:
            self._shutdown = True
            pending = list(self._jobs)
            self._jobs.clear()
            self._cond.notify_all()
        return pending

    def join(self, deadline: float) -> list[threading.Thread]:
        """Join every thread until ``deadline`` (monotonic); return stragglers."""
        with self._mutex:
            threads = [*self._threads, *self._dynamic, *self._finished]
        stragglers = []
        for thread in threads:
            if thread is threading.current_thread():
                continue
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                stragglers.append(thread)
        with self._mutex:
            self._finished = [t for t in self._finished if t.is_alive()]
        return stragglers

    def counters(self) -> PoolCounters:
        with self._mutex:
            return PoolCounters(
                base_threads=len(self._threads),
                dynamic_threads=len(self._dynamic),
                idle_threads=self._idle,
                queued_jobs=len(self._jobs),
                dynamic_spawned=self._spawned,
                peak_threads=self._peak,
            )

    # -- internals (all *_locked methods need self._mutex) ----------------------

    def _spawn_dynamic_locked(self) -> None:
        self._spawned += 1
        self._start_worker_locked(dynamic=True, name=f"{self.name}-dyn{self._spawned}")
        self._peak = max(self._peak, len(self._threads) + len(self._dynamic))

    def _start_worker_locked(self, *, dynamic: bool, name: str) -> None:
        thread = threading.Thread(target=self._worker, args=(dynamic,), name=name, daemon=True)
        (self._dynamic if dynamic else self._threads).append(thread)
        thread.start()

    def _cleanup_finished_locked(self) -> None:
        # C++ joins exited dynamic threads here; ours have returned (or are
        # about to), so only forget the dead ones -- never block under the lock.
        self._finished = [t for t in self._finished if t.is_alive()]

    def _move_to_finished_locked(self) -> None:
        me = threading.current_thread()
        if me in self._dynamic:
            self._dynamic.remove(me)
            self._finished.append(me)

    def _has_work(self) -> bool:
        return bool(self._jobs) or self._shutdown

    def _wait_for_work_locked(self, is_dynamic: bool) -> bool:
        """Block until there is work; False if a dynamic thread timed out.

        Between ``notify`` and the moment this thread really runs again it is
        still counted in ``self._idle`` -- that is the bug's window.  The
        simulated wake-up latency is spent *outside* the mutex, as a sleeping
        OS thread does not hold it either.
        """
        deadline = time.monotonic() + self.dynamic_idle_timeout
        while True:
            if self._has_work():
                # The predicate already holds: C++'s cond_.wait(lock, pred) returns at once, with no sleep and so
                # no wake-up latency (a worker going back to a non-empty queue takes the next job immediately).
                return True
            if is_dynamic:
                remaining = deadline - time.monotonic()
                if not self._cond.wait_for(self._has_work, timeout=max(0.0, remaining)):
                    return False
            else:
                self._cond.wait_for(self._has_work)
            if self.wakeup_latency <= 0.0 or self._shutdown:
                return True
            self._mutex.release()
            try:
                self.stop_event.wait(self.wakeup_latency)
            finally:
                self._mutex.acquire()
            if self._has_work():
                return True
            # Another thread took the job while we were waking up: go back to
            # sleep, still idle -- exactly what a spurious C++ wake-up does.

    def _worker(self, is_dynamic: bool) -> None:
        if is_dynamic and self.wakeup_latency > 0.0:
            # Thread creation is not free either; until the new thread runs it
            # is not idle, so further enqueues may spawn more (as in C++).
            self.stop_event.wait(self.wakeup_latency)
        while True:
            with self._mutex:
                self._idle += 1
                if not self._wait_for_work_locked(is_dynamic):
                    self._idle -= 1
                    self._move_to_finished_locked()
                    return
                self._idle -= 1
                if self._shutdown and not self._jobs:
                    self._move_to_finished_locked()
                    return
                job = self._jobs.popleft()
            # As in b11434's ThreadPool::worker, a dynamic thread goes back to idle after its job (for up to 3 s)
            # rather than exiting: a second burst within that time finds it idle.
            job()
