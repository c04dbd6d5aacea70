"""The engine thread of a server: one thread owns the decoding loop, everyone else talks to it.

Handlers (any thread, or an asyncio event loop) `submit` a job and read its events from the
job's own sink; the engine thread moves submitted jobs into the engine's queue between cycles
(`Engine.serve` polls the inbox), so requests join the running batch as they arrive and leave it
as they end. `cancel` frees a job's row before the next cycle (a client that went away). The
engine thread alone touches the model: captured CUDA graphs and the measured product plan keep
per-thread state, and a blocking forward never runs on the event loop. No HTTP and no terminal
code here: server.py speaks the protocol.
"""
from __future__ import annotations

import queue as _queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from .engine import Request
from .events import StepEvent, Summary


class QueueFull(Exception):
    """More jobs are waiting than the bound allows (a server answers 429)."""


@dataclass
class Job:
    ids: list[int]
    gen: object                 # GenerationSettings
    sink: object                # callable(kind, payload), called from the engine thread: ("event", StepEvent),
    #                             ("done", (Summary, tokens)), ("error", message)
    keep: bool = True           # keep its KV for a client that resends the conversation (prefix.py)
    key: int = 0
    started: bool = False       # its first event came (it holds a row)
    submitted: float = field(default_factory=time.time)


class EngineWorker:
    """Runs `engine` on a thread of its own. `max_queue`: jobs that may wait beyond one per row
    of the engine's batch (`submit` raises QueueFull past it)."""

    def __init__(self, engine, max_queue: int = 64):
        self.engine, self.max_queue = engine, max_queue
        self.inbox: _queue.Queue = _queue.Queue()
        self.jobs: dict[int, Job] = {}
        self._lock = threading.Lock()
        self._cancel: set[int] = set()
        self._next = 0
        self._closing = threading.Event()
        self.tick = time.time()      # the engine thread's last sign of life: a cycle, or an idle wait
        self.busy_since = None       # when the current run started (None: idle)
        self.totals = {"requests": 0, "finished": 0, "cancelled": 0, "errors": 0, "new_tokens": 0, "prompt_tokens": 0,
                       "cached_tokens": 0, "target_forwards": 0, "cycles": 0, "tree_tokens": 0}
        self.recent: deque = deque()  # (time, tokens emitted): tokens per second over the last minute
        self.thread = threading.Thread(target=self._loop, name="eagle2-engine", daemon=True)

    def start(self) -> "EngineWorker":
        self.thread.start()
        return self

    # -- handlers' side (any thread) ----------------------------------------------------------
    @property
    def waiting(self) -> int:
        """Jobs submitted and not yet decoding."""
        with self._lock:
            return sum(1 for j in self.jobs.values() if not j.started)

    @property
    def running(self) -> int:
        with self._lock:
            return sum(1 for j in self.jobs.values() if j.started)

    def submit(self, job: Job) -> int:
        """Queue a job; returns its key. Raises QueueFull when `max_queue` jobs already wait."""
        with self._lock:
            if self._closing.is_set():
                raise QueueFull("the server is shutting down")
            if len(self.jobs) >= self.engine.batch + self.max_queue:  # every row busy, and the queue full
                raise QueueFull(f"{len(self.jobs)} requests are already running or waiting")
            self._next += 1
            job.key = self._next
            self.jobs[job.key] = job
            self.totals["requests"] += 1
        self.inbox.put(job)
        return job.key

    def cancel(self, key: int) -> None:
        """End a job now (its row is freed before the next cycle); nothing if it has ended."""
        with self._lock:
            if key in self.jobs:
                self._cancel.add(key)
        self.inbox.put(None)  # wake an idle engine thread

    def close(self, wait: float = 5.0) -> None:
        """Cancel every job left and stop the thread."""
        self._closing.set()
        with self._lock:
            self._cancel.update(self.jobs)
        self.inbox.put(None)
        self.thread.join(wait)

    def heartbeat_age(self) -> float:
        """Seconds since the engine thread last completed a cycle or woke while idle."""
        return time.time() - max(self.tick, self.engine.heartbeat)

    def tokens_per_s(self, window: float = 60.0) -> float:
        now = time.time()
        with self._lock:
            while self.recent and self.recent[0][0] < now - window:
                self.recent.popleft()
            n = sum(k for _, k in self.recent)
            first = self.recent[0][0] if self.recent else now
        span = min(window, max(now - first, 1.0))
        return n / span

    # -- the engine thread ----------------------------------------------------------------------
    def _poll(self, queue) -> set[int]:
        """Between cycles: submitted jobs join the engine's queue; returns the keys to cancel."""
        self.tick = time.time()
        while True:
            try:
                job = self.inbox.get_nowait()
            except _queue.Empty:
                break
            if job is not None:
                queue.append(Request(job.key, job.ids, job.gen, job.keep))
        with self._lock:
            cancel, self._cancel = self._cancel, set()
        return cancel

    def _deliver(self, key, ev, tokens) -> None:
        job = self.jobs.get(key)
        if job is None:
            return
        if isinstance(ev, StepEvent):
            job.started = True
            with self._lock:
                self.recent.append((time.time(), len(ev.token_ids)))
            self._send(job, "event", ev)
            return
        assert isinstance(ev, Summary)
        with self._lock:
            self.jobs.pop(key, None)
            t = self.totals
            if ev.finish_reason == "cancelled":
                t["cancelled"] += 1
            else:
                t["finished"] += 1
            for name in ("new_tokens", "prompt_tokens", "cached_tokens", "target_forwards", "cycles", "tree_tokens"):
                t[name] += getattr(ev, name)
        self._send(job, "done", (ev, tokens))

    def _fail_all(self, message: str) -> None:
        with self._lock:
            jobs, self.jobs = list(self.jobs.values()), {}
            self.totals["errors"] += len(jobs)
        for job in jobs:
            self._send(job, "error", message)

    @staticmethod
    def _send(job: Job, kind: str, payload) -> None:
        try:
            job.sink(kind, payload)
        except RuntimeError:  # its handler's event loop has closed (the server is gone): nobody to tell
            pass

    def _loop(self) -> None:
        while True:
            try:
                item = self.inbox.get(timeout=0.5)
            except _queue.Empty:
                self.tick = time.time()
                if self._closing.is_set() and not self.jobs:
                    return
                continue
            self.tick = time.time()
            q: deque = deque()
            if item is not None:
                q.append(Request(item.key, item.ids, item.gen, item.keep))
            cancel = self._poll(q)  # the rest of the inbox, and cancels (a None only wakes us for those)
            for req in [r for r in q if r.key in cancel]:
                q.remove(req)
                self._deliver(req.key, Summary(prompt_tokens=len(req.ids), finish_reason="cancelled"), [])
            if not q:
                continue
            self.busy_since = time.time()
            try:
                for key, ev, tokens in self.engine.serve(q, self._poll):
                    self._deliver(key, ev, tokens)
            except Exception as e:  # noqa: BLE001 - the server goes on: every job of this run gets the error
                first = str(e).strip().splitlines()[0] if str(e).strip() else ""
                self._fail_all(f"the engine failed: {type(e).__name__}: {first}")
            finally:
                self.busy_since = None
                self.tick = time.time()
