"""A live `headstart serve` for tests: uvicorn on a free loopback port in a thread, over a tiny model."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest
import uvicorn
from openai import OpenAI

from headstart.runtime.apps.server.app import ServeConfig, build_app
from headstart.runtime.drafters.base import Drafter
from headstart.runtime.drafters.registry import make_drafter
from headstart.runtime.engine import Engine
from headstart.runtime.models import load_model

NAME = "tiny"


class SlowDrafter(Drafter):
    """Wraps a drafter; sleeps before each round so a generation is long enough to interrupt."""

    def __init__(self, inner, delay_s: float) -> None:
        self.inner, self.delay_s = inner, delay_s
        self.name, self.feature_layers = inner.name, inner.feature_layers

    def clear(self) -> None:
        self.inner = self.inner.fork()

    def start(self, *args):
        return self.inner.start(*args)

    def propose(self, context):
        time.sleep(self.delay_s)
        return self.inner.propose(context)

    def observe(self, *args):
        return self.inner.observe(*args)


class LiveServer:
    """uvicorn serving `build_app(engine, config)` on a free loopback port, in a thread."""

    def __init__(self, engine: Engine, api_key: str | None = None, **config) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        app = build_app(engine, ServeConfig(NAME, **config), api_key)
        self.app = app
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 20
        while not self.server.started:
            assert time.time() < deadline, "server did not start"
            time.sleep(0.02)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=20)

    def gather(self, n: int) -> None:
        """The next round waits until `n` requests are in the batch or queued behind it (the first to arrive is
        prefilled alone, the rest join the round after), so `n` requests sent at once share the batch however
        fast the tiny model answers them one by one."""
        worker = self.app.state.worker
        batch = worker.batch
        round_ = batch.round

        def gathered():
            del batch.round  # once: the class's round from here on
            wait_until(lambda: len(worker.running) + worker.jobs.qsize() >= n, what=f"{n} requests at once")
            return round_()

        batch.round = gathered

    def client(self, api_key: str = "unused") -> OpenAI:
        return OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0)

    def metric(self, name: str, **labels) -> float:
        text = httpx.get(self.url + "/metrics").text
        want = ",".join(f'{k}="{v}"' for k, v in labels.items())
        for line in text.splitlines():
            key, _, value = line.rpartition(" ")
            if key == (f"{name}{{{want}}}" if labels else name):
                return float(value)
        return 0.0


def wait_until(condition, seconds: float = 10.0, what: str = "") -> float:
    """Seconds it took `condition()` to hold; fails past `seconds`."""
    t0 = time.perf_counter()
    while not condition():
        assert time.perf_counter() - t0 < seconds, f"not within {seconds} s: {what}"
        time.sleep(0.02)
    return time.perf_counter() - t0


def leave_after(url: str, body: dict, seconds: float) -> None:
    """A client that gives up after `seconds` (curl -m)."""
    with pytest.raises(httpx.TimeoutException):
        httpx.post(url + "/v1/completions", json=body, timeout=seconds)


def leave_at_first_token(url: str, body: dict) -> None:
    """A streaming client that hangs up once its first token arrives: mid-way however fast the server decodes (a
    client leaving after a fixed time saw all 400 tokens of a tiny model's answer on a fast CPU, and never left)."""
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        next(line for line in r.iter_lines() if line.startswith("data: "))


def tiny_engine(model_dir, drafter: str = "lookup", delay_s: float = 0.0) -> Engine:
    model, tokenizer = load_model(str(model_dir))
    inner = make_drafter(drafter, model, tokenizer)
    return Engine(model, tokenizer, SlowDrafter(inner, delay_s) if delay_s else inner)
