"""The model worker: one thread owns the Engine and runs queued jobs one at a time, first in, first out.

Handlers submit a Job and read its events from an asyncio queue: ("delta", text), then one final
("done", finish_reason) or ("error", message). A job is cancelled (its client went away) or runs
out of time between rounds of the decode loop, so the worker is free again within one round; a job
cancelled while it waits gives its queue slot back at once. When the worker thread dies, every job
still waiting gets an error and new ones are refused (`WorkerDeadError`): the server answers 503.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from dataclasses import dataclass, field

from headstart.runtime.drafters.gate import AcceptanceGate, GatedDrafter
from headstart.runtime.engine import Engine
from headstart.runtime.generate import GenerationStats
from headstart.runtime.sampling import SamplingParams
from headstart.runtime.server.metrics import ServerMetrics


class QueueFullError(Exception):
    """The wait queue holds `max_queue` jobs already."""


class WorkerDeadError(Exception):
    """The worker thread is not running: no job can be served."""


@dataclass
class Job:
    prompt_ids: list[int]
    sampling: SamplingParams
    max_tokens: int
    seed: int | None
    stop: list[str]
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    arrived: float = field(default_factory=time.perf_counter)
    first_token_s: float | None = None  # arrival to first generated token
    stats: GenerationStats = field(default_factory=GenerationStats)
    timed_out: bool = False
    token_ids: list[int] = field(default_factory=list)  # generated so far (cut at a stop string)

    def send(self, kind: str, value: str) -> None:
        """From the worker thread: hand one event to the handler's event loop."""
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))


class Worker:
    """`step_aside_queue`: decode plainly while more requests than this wait (None: never);
    `min_acceptance`: decode plainly for a while when recent rounds accept fewer tokens than this."""

    def __init__(
        self,
        engine: Engine,
        metrics: ServerMetrics,
        max_queue: int,
        time_limit_s: float,
        step_aside_queue: int | None = None,
        min_acceptance: float | None = None,
    ) -> None:
        self.engine, self.metrics, self.time_limit_s, self.max_queue = engine, metrics, time_limit_s, max_queue
        self.jobs: queue.Queue[Job | None] = queue.Queue()
        self.waiting: set[int] = set()  # ids of submitted jobs not yet started nor cancelled
        self.lock = threading.Lock()
        gate = AcceptanceGate(min_acceptance) if min_acceptance else None
        speculate = (lambda: self.queue_depth <= step_aside_queue) if step_aside_queue is not None else (lambda: True)
        self.drafter = GatedDrafter(engine.drafter, speculate, gate)
        self.thread = threading.Thread(target=self._run, name="headstart-worker", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.jobs.put(None)
        self.thread.join(timeout=10)

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()

    @property
    def queue_depth(self) -> int:
        """Jobs waiting whose clients are still there."""
        return len(self.waiting)

    def submit(self, job: Job) -> None:
        if not self.alive:
            raise WorkerDeadError
        with self.lock:
            if len(self.waiting) >= self.max_queue:
                raise QueueFullError
            self.waiting.add(id(job))
        self.jobs.put(job)
        self.metrics.queue_depth.set(self.queue_depth)

    def cancel(self, job: Job) -> None:
        """The client left: a waiting job gives its slot back now, a running one stops after its round."""
        job.cancelled.set()
        with self.lock:
            self.waiting.discard(id(job))
        self.metrics.queue_depth.set(self.queue_depth)

    def _take(self, job: Job) -> bool:
        """Start `job` unless it was cancelled while it waited."""
        with self.lock:
            if id(job) not in self.waiting:
                return False
            self.waiting.discard(id(job))
        self.metrics.queue_depth.set(self.queue_depth)
        return not job.cancelled.is_set()

    def _run(self) -> None:
        try:
            while (job := self.jobs.get()) is not None:
                if not self._take(job):
                    continue
                self.metrics.running.set(1)
                try:
                    finish = self._generate(job)
                    job.send("done", finish)
                except Exception as e:
                    job.send("error", f"generation failed: {type(e).__name__}: {e}")
                finally:
                    self.metrics.running.set(0)
                    self.metrics.record_generation(job.stats)
                    self.metrics.latency.observe(time.perf_counter() - job.arrived)
        finally:  # stopped or died: whoever still waits is told, nobody waits forever
            while True:
                try:
                    job = self.jobs.get_nowait()
                except queue.Empty:
                    break
                if job is not None and self._take(job):
                    job.send("error", "the model worker stopped")

    def _generate(self, job: Job) -> str:
        """Run the decode loop for `job`, sending text deltas; returns the finish reason."""
        deadline = time.perf_counter() + self.time_limit_s
        finish = "length"
        for chunk in self.engine.stream(
            job.prompt_ids,
            job.sampling,
            job.max_tokens,
            job.seed,
            job.stop,
            stats=job.stats,
            drafter=self.drafter,
            deadline=deadline,
        ):
            if job.first_token_s is None and chunk.tokens:
                job.first_token_s = time.perf_counter() - job.arrived
                self.metrics.ttft.observe(job.first_token_s)
            job.token_ids += chunk.tokens
            if chunk.text:
                job.send("delta", chunk.text)
            if job.cancelled.is_set():
                return "cancelled"
            finish = chunk.finish_reason or finish
        job.timed_out = finish == "time"
        return "length" if job.timed_out else finish
