"""The model worker: one thread owns the Engine and decodes up to `max_batch` jobs at once in the one decode loop
(`generate.Batch`), continuous batching: a job joins between rounds and leaves when done; more wait in a FIFO queue.

Handlers submit a Job and read its events from an asyncio queue: ("delta", text), then one final
("done", finish_reason) or ("error", message). A job is cancelled (its client went away) or runs
out of time between rounds, so its slot is free again within one round; a job cancelled while it waits gives
its queue slot back at once. When the worker thread dies, every job still waiting or decoding gets an error
and new ones are refused (`WorkerDeadError`): the server answers 503.

Speculation: each job drafts with its own fork of the drafter its speculation policy gives (runtime/sizing/policy.py,
built there: the worker only runs it), and every job's tree is verified in the one batched forward. By default (the
`budget` policy) the load planner gives each job, before each round, the tree nodes that make the most tokens per
second for the batch as it is (none when the batch fills the machine, the batch-1 tree when it empties), from a cost
model of the batched forward measured at start; `fixed` lets each job draft its own tree under the switches
(`speculate_up_to` decoding jobs, the queue's depth, the acceptance seen); `off` decodes plainly. Each job has its
own sampling, seed, stop strings, limits and statistics.
"""

from __future__ import annotations

import asyncio
import queue
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field

from headstart.runtime.apps.server.metrics import ServerMetrics
from headstart.runtime.engine import Engine, RequestText
from headstart.runtime.generate import Batch, GenerationStats, Request, kv_bytes
from headstart.runtime.prefix_cache import PrefixCache
from headstart.runtime.sampling import SamplingParams
from headstart.runtime.sizing.policy import Switches, build_policy, policy_name


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
    request: Request | None = None  # in the batch
    text: RequestText | None = None
    deadline: float = 0.0

    def send(self, kind: str, value: str) -> None:
        """From the worker thread: hand one event to the handler's event loop."""
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))


class Worker:
    """`max_batch`: jobs decoded at once; `kv_budget`: bytes the KV cache may hold (None: no limit); `prefill_chunk`:
    prompt tokens prefilled a round while others decode (None: `generate.PREFILL_CHUNK`);
    `step_aside_queue`: the drafter proposes nothing while more requests than this wait (None: never);
    `min_acceptance`: decode plainly for a while when recent rounds accept fewer tokens than this;
    `speculate_up_to`: the jobs decoding at once up to which each drafts its tree (0: never); `speculation`: the
    policy by name (runtime/sizing/policy.py; None: `budget`, every job's tree sized each round by the load planner,
    or `fixed` where one of the three switches is given). `prefix_cache`: finished prompts' keys and values, copied
    into the jobs that start the same way (None: none)."""

    def __init__(
        self,
        engine: Engine,
        metrics: ServerMetrics,
        max_queue: int,
        time_limit_s: float,
        step_aside_queue: int | None = None,
        min_acceptance: float | None = None,
        max_batch: int = 1,
        kv_budget: int | None = None,
        prefill_chunk: int | None = None,
        speculate_up_to: int | None = None,
        prefix_cache: PrefixCache | None = None,
        speculation: str | None = None,
    ) -> None:
        self.engine, self.metrics, self.time_limit_s, self.max_queue = engine, metrics, time_limit_s, max_queue
        self.max_batch = max_batch
        if engine.target.slots != max_batch:
            engine.target.set_slots(max_batch)
        full = kv_bytes(engine.target, 1, engine.target.max_len)
        if kv_budget is not None and kv_budget < full:
            raise ValueError(
                f"a KV cache of {kv_budget / 2**30:.2f} GiB cannot hold one full-length sequence of this model "
                f"({engine.target.max_len} tokens: {full / 2**30:.2f} GiB)"
            )
        self.jobs: queue.Queue[Job | None] = queue.Queue()
        self.waiting: set[int] = set()  # ids of submitted jobs not yet started nor cancelled
        self.lock = threading.Lock()
        switches = Switches(speculate_up_to, step_aside_queue, min_acceptance)
        self.policy = policy_name(speculation, switches, engine.drafter.name)
        planner, self.drafter = build_policy(  # each job decodes with a fork of the drafter
            self.policy,
            engine.target,
            engine.drafter,
            switches,
            lambda: len(self.batch.decoding),
            lambda: self.queue_depth,
            max_batch,
        )
        prefix = engine.chat_prefix()
        self.batch = Batch(engine.target, prefill_chunk, kv_budget, prefix, planner, prefix_cache=prefix_cache)
        self.running: list[Job] = []
        self.thread = threading.Thread(target=self._run, name="headstart-worker", daemon=True)
        self.stopping = False
        self.stopped = False  # the loop has ended (`serve` returns on the caller's thread, which lives on)

    def warm_up(self, tokens: int = 16) -> float:
        """Decode one short chat request before any client's, in a batch of its own: a process's first rounds pay
        for its kernels' first calls and its allocator's first requests (a fresh server's first requests at one
        client ran ~5 % under a warmed one's: docs/serving.md, "Start"), and the chat template's shared prefix is cached
        here. The served batch's planner takes no sample of it and no drafter sees it (a pool learns nothing).
        Returns its seconds."""
        t = time.perf_counter()
        engine, served = self.engine, self.batch
        batch = Batch(engine.target, served.prefill_chunk, served.kv_budget, served.prefix)
        prompt = engine.encode("Say hello to the world in one short sentence.", bool(engine.tokenizer.chat_template))
        request = batch.add(Request(prompt, max_new_tokens=tokens))  # no EOS: all `tokens` rounds
        while not request.done:
            batch.round()
        return time.perf_counter() - t

    def start(self) -> None:
        """Decode on a thread of the worker's own (tests, apps that run the server on the main thread)."""
        self.thread.start()

    def bind(self) -> None:
        """The calling thread will run `serve`: requests are taken from now on."""
        self.thread = threading.current_thread()

    def serve(self) -> None:
        """Decode on the calling thread until `stop` (`headstart serve`: the thread that loaded the model, so torch's
        thread pool is the one that already runs: a second pool on other threads costs a quarter of the speed on
        a 2-core CPU, measured)."""
        self.bind()
        self._run()

    def stop(self) -> None:
        self.stopping = True  # the loop ends after this round; whoever waits or decodes is told
        self.jobs.put(None)
        if self.thread is not threading.current_thread() and self.thread.ident is not None:
            self.thread.join(timeout=10)

    @property
    def alive(self) -> bool:
        return self.thread.is_alive() and not self.stopped

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
            while not self.stopping:
                self._admit()
                if not self.running:
                    continue
                try:
                    rounds = self.batch.round()
                except Exception as e:  # the round failed: every job in it is told, the batch starts afresh
                    print(f"headstart: a decode round failed ({len(self.running)} requests):", file=sys.stderr)
                    traceback.print_exc()  # the server's log keeps what the clients' 500s only name
                    for job in list(self.running):
                        self._finish(job, "error", f"generation failed: {type(e).__name__}: {e}")
                    continue
                for request, chunk in rounds:
                    self._deliver(request.owner, chunk)
                for job in list(self.running):  # cancelled or out of time: the slot is free for the next round
                    if job.cancelled.is_set():
                        self._finish(job, "done", "cancelled")
                    elif time.perf_counter() > job.deadline:
                        job.timed_out = True
                        self._finish(job, "done", "length", job.text.end("length").text)
                    elif job.request.done:  # done without a round (max_tokens 0)
                        self._finish(job, "done", "length")
        finally:  # stopped or died: whoever still waits or decodes is told, nobody waits forever
            self.stopped = True
            for job in list(self.running):
                job.send("error", "the model worker stopped")
            while True:
                try:
                    job = self.jobs.get_nowait()
                except queue.Empty:
                    break
                if job is not None and self._take(job):
                    job.send("error", "the model worker stopped")

    def _admit(self) -> None:
        """Queued jobs join the batch while it has room; with nothing running, wait for one."""
        while len(self.running) < self.max_batch:
            try:
                job = self.jobs.get(block=not self.running)
            except queue.Empty:
                return
            if job is None:
                self.stopping = True
                return
            if not self._take(job):
                continue
            job.deadline = time.perf_counter() + self.time_limit_s
            job.text = RequestText(self.engine.tokenizer, job.stop, self.engine.eos_ids)
            request = Request(
                job.prompt_ids,
                self.drafter.fork(),
                job.sampling,
                job.max_tokens,
                self.engine.eos_ids,
                job.seed,
                job.stats,
                owner=job,
            )
            try:
                job.request = self.batch.add(request)
            except ValueError as e:
                job.send("error", f"generation failed: {e}")
                continue
            self.running.append(job)
            self.metrics.running.set(len(self.running))

    def _deliver(self, job: Job, chunk) -> None:
        """One round's tokens of `job`: text to its client; its end when it is done."""
        if job.first_token_s is None and chunk.tokens:
            job.first_token_s = time.perf_counter() - job.arrived
            self.metrics.ttft.observe(job.first_token_s)
        out = job.text.push(chunk)
        job.token_ids += out.tokens
        if out.finish_reason:  # a stop string completed
            self._finish(job, "done", "stop", out.text)
        elif job.request.done:
            end = job.text.end("length")
            self._finish(job, "done", end.finish_reason, out.text + end.text)
        elif out.text:
            job.send("delta", out.text)

    def _finish(self, job: Job, kind: str, value: str, text: str = "") -> None:
        """`job` leaves the batch: its last text, then its end."""
        if not job.request.done:
            self.batch.remove(job.request)
        self.running.remove(job)
        if text:
            job.send("delta", text)
        job.send(kind, value)
        self.metrics.running.set(len(self.running))
        self.metrics.record_generation(job.stats)
        self.metrics.latency.observe(time.perf_counter() - job.arrived)
