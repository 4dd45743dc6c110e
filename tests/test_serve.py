"""`headstart serve` on a loopback port over a tiny Llama: the openai client, concurrency, bad inputs, disconnects."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from headstart.cli import main
from headstart.runtime.apps.server.app import ServeConfig, build_app
from headstart.runtime.sizing.planner import Planner
from helpers.server import NAME, LiveServer, leave_at_first_token, tiny_engine, wait_until

PROMPTS = ["the cat sat on", "a dog ran far", "one two three", "red blue green and", "then it was good"]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    live = LiveServer(tiny_engine(tiny_model_dir))
    yield live
    live.close()


def cli_text(model_dir, prompt: str, capsys, raw: bool = False) -> str:
    argv = [
        "generate",
        "--model",
        str(model_dir),
        "--drafter",
        "lookup",
        "--prompt",
        prompt,
        "--max-new-tokens",
        "20",
        "--json",
    ] + (["--raw"] if raw else [])
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])["text"]


def test_openai_client_chat_and_completions_match_headstart_generate(server, tiny_model_dir, capsys):
    client = server.client()
    assert [m.id for m in client.models.list().data] == [NAME]
    prompt = PROMPTS[0]
    expected_chat = cli_text(tiny_model_dir, prompt, capsys)
    expected_raw = cli_text(tiny_model_dir, prompt, capsys, raw=True)

    chat = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": prompt}], max_tokens=20, temperature=0
    )
    assert chat.choices[0].message.content == expected_chat
    assert chat.usage.completion_tokens > 0 and chat.usage.total_tokens > chat.usage.completion_tokens
    extra = chat.model_extra["headstart"]
    assert extra["target_passes"] >= 1 and extra["acceptance_length"] >= 1

    chunks = list(
        client.chat.completions.create(
            model=NAME,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected_chat
    assert chunks[-2].choices[0].finish_reason in ("stop", "length")
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens

    done = client.completions.create(model=NAME, prompt=prompt, max_tokens=20, temperature=0)
    assert done.choices[0].text == expected_raw
    streamed = client.completions.create(model=NAME, prompt=prompt, max_tokens=20, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == expected_raw


def test_stop_strings_and_finish_reasons(server):
    client = server.client()
    full = client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=12, temperature=0).choices[0]
    assert full.finish_reason in ("length", "stop")
    words = full.text.split()
    assert len(words) >= 3, full.text
    cut = client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=12, temperature=0, stop=[words[2]])
    assert cut.choices[0].finish_reason == "stop"
    assert words[2] not in cut.choices[0].text.split() or full.text.index(words[2]) > len(cut.choices[0].text)


def test_sixteen_concurrent_clients_equal_the_sequential_results(server):
    client = server.client()

    def ask(i: int) -> str:
        messages = [{"role": "user", "content": PROMPTS[i % len(PROMPTS)] + " " + "one two"[: i % 7]}]
        out = client.chat.completions.create(model=NAME, messages=messages, max_tokens=16, temperature=0)
        return out.choices[0].message.content

    before = server.metric("headstart_requests_total", endpoint="/v1/chat/completions", status="200")
    sequential = [ask(i) for i in range(16)]
    with ThreadPoolExecutor(16) as pool:
        concurrent = list(pool.map(ask, range(16)))
    assert concurrent == sequential
    after = server.metric("headstart_requests_total", endpoint="/v1/chat/completions", status="200")
    assert after - before == 32
    assert httpx.get(server.url + "/health").json()["queue_depth"] == 0
    assert server.metric("headstart_queue_depth") == 0
    assert server.metric("headstart_generated_tokens_total") > 0
    assert server.metric("headstart_acceptance_length_count") >= 32


BAD = [
    ("not json", "invalid JSON", None),
    ({"model": NAME}, "messages", "messages"),
    ({"model": NAME, "messages": "hello"}, "messages", "messages"),
    ({"model": NAME, "messages": []}, "at least 1", "messages"),
    ({"model": NAME, "messages": [{"role": "user", "content": 5}]}, "content", None),
    ({"model": NAME, "messages": [{"role": "wizard", "content": "hi"}]}, "role", None),
    ({"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}, "not served here", "model"),
    ({"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}, "max_tokens", None),
    ({"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**9}, "context", "max_tokens"),
    ({"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": "ten"}, "max_tokens", None),
    ({"model": NAME, "messages": [{"role": "user", "content": "hi"}], "temperature": -0.5}, "temperature", None),
    ({"model": NAME, "messages": [{"role": "user", "content": "hi"}], "top_p": 0}, "top_p", None),
    ({"model": NAME, "messages": [{"role": "user", "content": "hi"}], "top_p": 1.5}, "top_p", None),
    ({"model": NAME, "messages": [{"role": "user", "content": "hi"}], "n": 2}, "'n' is not supported", None),
    ({"model": NAME, "messages": [{"role": "user", "content": "hi"}], "logprobs": True}, "logprobs", None),
    ({"model": NAME, "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, "tools", None),
    ({"model": NAME, "messages": [{"role": "user", "content": "hi"}], "colour": "red"}, "unknown parameter", None),
    ({"model": NAME, "messages": [{"role": "user", "content": "the " * 600}]}, "context", "messages"),
]


@pytest.mark.parametrize("body, message, param", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_inputs_get_a_400_with_an_openai_error_body(server, body, message, param):
    payload = {"content": body} if isinstance(body, str) else {"json": body}
    r = httpx.post(server.url + "/v1/chat/completions", headers={"content-type": "application/json"}, **payload)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert message in error["message"], error
    if param:
        assert error["param"] == param
    ok = httpx.post(server.url + "/v1/completions", json={"model": NAME, "prompt": "the cat", "max_tokens": 3})
    assert ok.status_code == 200 and 1 <= ok.json()["usage"]["completion_tokens"] <= 3  # still serving


def test_completion_prompt_errors(server):
    for body, message in [
        ({"model": NAME, "prompt": ["a", "b"], "max_tokens": 2}, "one prompt"),
        ({"model": NAME, "prompt": "", "max_tokens": 2}, "empty prompt"),
        ({"model": NAME, "prompt": [3, 99999], "max_tokens": 2}, "token ids"),
        ({"model": NAME, "prompt": "the", "echo": True}, "'echo' is not supported"),
    ]:
        r = httpx.post(server.url + "/v1/completions", json=body)
        assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
    assert httpx.get(server.url + "/v1/nowhere").json()["error"]["code"] == "404"


def test_full_queue_gets_429_and_a_disconnect_frees_the_worker(tiny_model_dir):
    live = LiveServer(tiny_engine(tiny_model_dir, "none", delay_s=0.05), max_queue=1, max_batch=1)  # one decodes
    body = {"model": NAME, "prompt": "the cat", "max_tokens": 200, "stream": True}
    try:
        with (
            httpx.Client(base_url=live.url, timeout=30) as first,
            first.stream("POST", "/v1/completions", json=body) as stream,
        ):
            lines = stream.iter_lines()
            assert next(lines).startswith("data: ")  # the first generation is running
            waiting = threading.Thread(
                target=httpx.post,
                args=(live.url + "/v1/completions",),
                kwargs={"json": {**body, "stream": False, "max_tokens": 2}, "timeout": 60},
            )
            waiting.start()  # fills the queue (max_queue=1)
            deadline = time.time() + 30  # a loaded 2-core CI machine once took 10 s
            while live.metric("headstart_queue_depth") < 1:
                assert time.time() < deadline
                time.sleep(0.05)
            busy = httpx.post(live.url + "/v1/completions", json={**body, "stream": False})
            assert busy.status_code == 429 and busy.headers["retry-after"] == "5"
            assert busy.json()["error"]["code"] == "queue_full"
        # the client closed the stream after one chunk: the worker stops at its next round
        waiting.join(timeout=30)
        t0 = time.perf_counter()
        r = httpx.post(live.url + "/v1/completions", json={**body, "stream": False, "max_tokens": 3}, timeout=30)
        assert r.status_code == 200 and time.perf_counter() - t0 < 5  # not behind 200 tokens at 50 ms each
        deadline = time.time() + 10
        while live.metric("headstart_requests_total", endpoint="/v1/completions", status="499") < 1:
            assert time.time() < deadline, "the disconnect was not counted"
            time.sleep(0.05)
        assert live.metric("headstart_generated_tokens_total") < 200  # the interrupted generation stopped early
        assert live.metric("headstart_rounds_total", mode="plain") >= 1  # drafter none: plain rounds
    finally:
        live.close()


def test_time_limit_ends_a_request(tiny_model_dir):
    engine = tiny_engine(tiny_model_dir, "none", delay_s=0.05)
    engine.eos_ids = frozenset()  # the request samples (temperature 1): an early <eos> would end it first
    live = LiveServer(engine, time_limit_s=0.5)
    try:
        r = httpx.post(
            live.url + "/v1/completions", json={"model": NAME, "prompt": "the cat", "max_tokens": 200}, timeout=30
        )
        out = r.json()
        assert r.status_code == 200 and out["choices"][0]["finish_reason"] == "length"
        assert out["headstart"]["timed_out"] and out["usage"]["completion_tokens"] < 200
    finally:
        live.close()


def test_serve_flag_errors_are_one_line(capsys):
    for argv, message in [
        (["serve", "--port", "0"], "--port"),
        (["serve", "--max-queue", "0"], "--max-queue"),
        (["serve", "--time-limit", "-1"], "--time-limit"),
        (["serve", "--prefix-cache-gb", "-1"], "--prefix-cache-gb"),
    ]:
        assert main(argv) == 2
        assert message in capsys.readouterr().err


def test_loadtest_reports_every_level(server, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": str(i), "turns": [p]}) + "\n" for i, p in enumerate(PROMPTS)))
    out = tmp_path / "load.json"
    argv = [
        "loadtest",
        "--url",
        server.url,
        "--clients",
        "1,3",
        "--requests-per-client",
        "2",
        "--max-tokens",
        "6",
        "--prompts",
        str(prompts),
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert "| lookup | 1 | 2 | 0 |" in table and "| lookup | 3 | 6 | 0 |" in table
    levels = json.loads(out.read_text())["levels"]
    assert [lv["requests"] for lv in levels] == [2, 6]
    assert all(lv["tokens_per_s"] > 0 and lv["p95_latency_s"] >= lv["p50_latency_s"] > 0 for lv in levels)
    assert all(lv["p95_request_tokens_per_s"] > 0 for lv in levels)
    assert levels[0]["steady_tokens_per_s"] > 0  # 3 clients of 6 tokens may never be busy at once: 0 then
    assert main(["loadtest", "--url", "http://127.0.0.1:9"]) == 2


def test_speculation_steps_aside_when_the_queue_fills(tiny_model_dir):
    """step_aside_queue=0: any waiting request makes the running one decode plainly; outputs unchanged (one
    decoding at a time, so that requests wait)."""
    live = LiveServer(tiny_engine(tiny_model_dir, "lookup", delay_s=0.01), step_aside_queue=0, max_batch=1)
    try:
        client = live.client()

        def ask(i: int) -> str:
            out = client.completions.create(model=NAME, prompt=PROMPTS[i % len(PROMPTS)], max_tokens=24, temperature=0)
            return out.choices[0].text

        sequential = [ask(i) for i in range(4)]  # alone: plain rounds only where lookup finds no match
        plain_alone = live.metric("headstart_rounds_total", mode="plain")
        spec_alone = live.metric("headstart_rounds_total", mode="speculative")
        live.gather(4)
        with ThreadPoolExecutor(4) as pool:
            assert list(pool.map(ask, range(4))) == sequential
        plain_busy = live.metric("headstart_rounds_total", mode="plain") - plain_alone
        spec_busy = live.metric("headstart_rounds_total", mode="speculative") - spec_alone
        assert plain_busy > plain_alone and spec_busy < spec_alone
    finally:
        live.close()


def test_acceptance_gate_backs_off_and_probes_again():
    from headstart.runtime.sizing.gate import AcceptanceGate

    gate = AcceptanceGate(min_acceptance=1.5, window=4, backoff=3)
    for tokens in (1, 2, 1, 1):  # mean 1.25 < 1.5 over a full window
        assert gate.speculate()
        gate.record(tokens)
    assert [gate.speculate() for _ in range(4)] == [False, False, False, True]  # 3 plain rounds, then a probe
    for tokens in (3, 2, 2, 1):  # mean 2.0: keeps speculating
        gate.record(tokens)
        assert gate.speculate()


def test_an_api_key_lets_in_only_its_users(tiny_model_dir, tmp_path, capsys):
    """With --api-key every /v1/ route wants the key (the official openai client, streaming too); /health and
    /metrics stay open; refusals are OpenAI 401 bodies counted in /metrics; the key is in neither the metrics
    nor the server's log line; loadtest and engine distillation send it."""
    import openai

    key = "sk-test-7f3a9c"
    live = LiveServer(tiny_engine(tiny_model_dir), api_key=key)
    try:
        ok = live.client(key).chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": "the cat"}], max_tokens=4
        )
        assert ok.choices[0].message.content is not None
        stream = live.client(key).completions.create(model=NAME, prompt="the cat", max_tokens=4, stream=True)
        assert sum(1 for _ in stream) >= 1
        for wrong in ("sk-wrong", key + "x", key[:-1]):
            with pytest.raises(openai.AuthenticationError) as refused:
                live.client(wrong).completions.create(model=NAME, prompt="the cat", max_tokens=4)
            assert refused.value.status_code == 401 and refused.value.body["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            live.client(wrong).completions.create(model=NAME, prompt="the cat", max_tokens=4, stream=True)
        bare = httpx.get(live.url + "/v1/models")  # no Authorization header at all
        assert bare.status_code == 401 and bare.json()["error"]["type"] == "authentication_error"
        assert httpx.get(live.url + "/health").status_code == 200
        metrics = httpx.get(live.url + "/metrics").text
        assert (
            key not in metrics
            and live.metric("headstart_requests_total", endpoint="/v1/completions", status="401") == 4
        )
        prompts = tmp_path / "prompts.jsonl"
        prompts.write_text(json.dumps({"id": "0", "turns": ["the cat sat"]}) + "\n")
        argv = [
            "loadtest",
            "--url",
            live.url,
            "--clients",
            "1",
            "--requests-per-client",
            "1",
            "--max-tokens",
            "4",
            "--prompts",
            str(prompts),
        ]
        assert main([*argv, "--api-key", key]) == 0
        assert "| lookup | 1 | 1 | 0 |" in capsys.readouterr().out
        from headstart.train.distill_remote import EngineClient

        client = EngineClient(live.url + "/v1", api_key=key, retries=0)  # the base-URL form OpenAI clients take
        assert client.model == NAME
    finally:
        live.close()


def test_serving_beyond_loopback_without_a_key_warns(monkeypatch, capsys):
    from headstart.commands import common

    monkeypatch.delenv("HEADSTART_API_KEY", raising=False)
    monkeypatch.setattr(common, "load_engine", lambda args: (_ for _ in ()).throw(common.UserError("stop here")))
    assert main(["serve", "--host", "0.0.0.0"]) == 2
    err = capsys.readouterr().err
    assert "without an API key" in err and err.count("\n") == 2
    assert main(["serve", "--host", "0.0.0.0", "--api-key", "k"]) == 2
    assert "without an API key" not in capsys.readouterr().err


def test_requests_decode_together_each_as_it_would_alone(tiny_model_dir):
    """Eight clients at once on a server that batches: each greedy answer (its own max_tokens, stop strings) is the
    one it gets alone, beside sampling neighbours (their own temperature and seed); more than one request decoded
    at a time; a client that leaves mid-way frees its slot and its neighbours finish unharmed. (A sampled answer's
    tokens for a seed may differ alone, where it speculates, and in a batch, where it decodes plainly: the same
    distribution, tests/test_batch.py.)"""
    engine = tiny_engine(tiny_model_dir, "lookup")
    engine.eos_ids = frozenset()  # every request runs to its own limit
    live = LiveServer(engine, max_batch=4)
    bodies = [
        {"prompt": p, "max_tokens": 12 + 5 * i, "temperature": 0} | ({"stop": [" the"]} if i == 1 else {})
        for i, p in enumerate(PROMPTS)
    ]
    bodies += [{"prompt": PROMPTS[0], "max_tokens": 15, "temperature": 0.9, "seed": s} for s in (1, 2, 3)]

    def ask(body):
        r = httpx.post(live.url + "/v1/completions", json={"model": NAME, **body}, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    try:
        alone = [ask(b) for b in bodies]
        peak, stop = [0.0], threading.Event()

        def watch():
            while not stop.is_set():
                peak[0] = max(peak[0], live.metric("headstart_running_requests"))

        watcher = threading.Thread(target=watch)
        watcher.start()
        with ThreadPoolExecutor(len(bodies) + 1) as pool:
            leaver = pool.submit(leave_at_first_token, live.url, {"model": NAME, "prompt": "x", "max_tokens": 400})
            together = list(pool.map(ask, bodies))
            leaver.result()
        stop.set()
        watcher.join()
        greedy = [i for i, b in enumerate(bodies) if b["temperature"] == 0]
        assert [together[i] for i in greedy] == [alone[i] for i in greedy]
        assert all(together[i] for i in range(len(bodies)) if i not in greedy)
        assert peak[0] > 1
        wait_until(lambda: live.metric("headstart_running_requests") == 0, what="the leaver still running")
    finally:
        live.close()


@pytest.mark.parametrize("drafter", ["lookup", "eagle"])
def test_requests_in_a_batch_each_draft_their_own_tree(tiny_model_dir, drafter):
    """Four greedy requests at once, each drafting with its own fork of the engine's drafter (EAGLE: random heads
    on the tiny target, features per sequence): their trees are verified in the batched forward, as many rounds
    speculate as when each ran alone, and every answer is its answer alone. With `speculate_up_to=1` the same
    four decode plainly while they share the batch."""
    engine = tiny_engine(tiny_model_dir, "lookup")
    if drafter == "eagle":
        from headstart.runtime.drafters.eagle import EagleDrafter
        from headstart.runtime.engine import Engine
        from helpers.exactness import random_heads

        m = engine.target.model
        engine = Engine(
            m, engine.tokenizer, EagleDrafter(random_heads("eagle", m, 0.1), m.model.embed_tokens, m.lm_head)
        )
    engine.eos_ids = frozenset()  # every request runs to its limit

    def run(live: LiveServer) -> tuple[list[str], list[str], float, float]:
        def ask(i: int) -> str:
            out = live.client().completions.create(
                model=NAME, prompt=PROMPTS[i % len(PROMPTS)], max_tokens=20, temperature=0
            )
            return out.choices[0].text

        alone = [ask(i) for i in range(4)]
        spec_alone = live.metric("headstart_rounds_total", mode="speculative")
        live.gather(4)
        with ThreadPoolExecutor(4) as pool:
            together = list(pool.map(ask, range(4)))
        return alone, together, spec_alone, live.metric("headstart_rounds_total", mode="speculative") - spec_alone

    for up_to in (4, 1):
        live = LiveServer(engine, max_batch=4, speculate_up_to=up_to)
        try:
            alone, together, spec_alone, spec_busy = run(live)
        finally:
            live.close()
        assert together == alone and spec_alone > 0
        if up_to == 4:
            assert spec_busy == pytest.approx(spec_alone, rel=0.25), (spec_busy, spec_alone)
        else:
            assert spec_busy < 0.75 * spec_alone, (spec_busy, spec_alone)


@pytest.mark.parametrize("curve", ["steep", "flat"])
def test_the_budget_sizes_trees_by_load(tiny_model_dir, monkeypatch, curve):
    """By default (no switch given) the server sizes every round's trees by the budget, from the batched cost model
    measured at start (here given): alone a request speculates on either curve; four at once decode plainly
    while they share the batch on a steep curve (a row costs 5 % of a forward) and keep speculating on a flat
    one. Every answer is its answer alone."""
    from headstart.runtime.sizing.batch_cost import BatchCost
    from headstart.runtime.sizing.budgeted import Budgeted

    cost = {"steep": BatchCost.linear(10.0, 0.5, 0.0), "flat": BatchCost.linear(10.0, 0.001, 0.0)}[curve]
    monkeypatch.setattr("headstart.runtime.sizing.batch_cost.batch_cost", lambda target, cache: cost)
    # the planner's checks against measured time (`trees_lose`, `plans_pay`: tests/test_budget.py) follow the clock
    # here (a tiny random model whose grafts are seldom accepted, the plans' own time): the plan is the model's alone
    monkeypatch.setattr(Planner, "MEASURED_LEAST", 10**9)
    engine = tiny_engine(tiny_model_dir, "lookup")
    engine.eos_ids = frozenset()
    live = LiveServer(engine, max_batch=4)
    try:
        assert isinstance(live.app.state.worker.drafter, Budgeted)

        def ask(i: int) -> str:
            out = live.client().completions.create(
                model=NAME, prompt=PROMPTS[i % len(PROMPTS)], max_tokens=20, temperature=0
            )
            return out.choices[0].text

        spec = lambda: live.metric("headstart_rounds_total", mode="speculative")  # noqa: E731
        plain = lambda: live.metric("headstart_rounds_total", mode="plain")  # noqa: E731
        alone = [ask(i) for i in range(4)]
        spec_alone, plain_alone = spec(), plain()
        with ThreadPoolExecutor(4) as pool:
            together = list(pool.map(ask, range(4)))
        spec_busy, plain_busy = spec() - spec_alone, plain() - plain_alone
    finally:
        live.close()
    assert together == alone and spec_alone > 0
    if curve == "steep":
        assert spec_busy < 0.25 * plain_busy, (spec_busy, plain_busy)
    else:
        assert spec_busy == pytest.approx(spec_alone, rel=0.25), (spec_busy, spec_alone)


def test_each_answer_carries_its_acceptance_as_vllm_writes_it(tiny_model_dir):
    """--per-request-spec-decode-metrics summary: every answer's `metrics.speculative_decoding` holds vLLM's
    summary (a step is a round with a tree, its draft tokens the tree's nodes), whole and streamed (on the last
    chunk); /metrics adds the same counts under vLLM's counter names. Off (the default), answers carry none."""
    # every round drafts (no load budget, whose plans follow measured times): the same rounds again, streamed
    live = LiveServer(
        tiny_engine(tiny_model_dir, "lookup"), per_request_spec_decode_metrics="summary", speculate_up_to=8
    )
    body = {"model": NAME, "prompt": PROMPTS[0] + " " + PROMPTS[0], "max_tokens": 24, "temperature": 0}
    try:
        answer = httpx.post(live.url + "/v1/completions", json=body, timeout=60).json()
        spec = answer["metrics"]["speculative_decoding"]
        steps, hist = spec["num_spec_steps"], spec["acceptance_histogram"]
        assert steps > 0 and sum(hist) == steps and answer["headstart"]["target_passes"] >= steps
        assert (
            spec["num_accepted_draft_tokens"]
            == sum(k * n for k, n in enumerate(hist))
            == sum(spec["accepted_per_depth"])
        )
        assert spec["num_draft_tokens"] >= spec["num_accepted_draft_tokens"] > 0
        assert spec["mean_acceptance_length"] == pytest.approx(1 + spec["num_accepted_draft_tokens"] / steps)
        assert spec["draft_acceptance_rate"] == pytest.approx(
            spec["num_accepted_draft_tokens"] / spec["num_draft_tokens"]
        )
        assert live.metric("headstart:spec_decode_num_drafts_total") == steps
        treeless, rounds = (
            live.metric(f"headstart_{kind}round_phase_seconds_total", phase="layers") for kind in ("treeless_", "")
        )
        assert 0 <= treeless < rounds  # the phases of rounds where nobody drafted, within all rounds'
        assert live.metric("headstart:spec_decode_num_draft_tokens_total") == spec["num_draft_tokens"]
        assert live.metric("headstart:spec_decode_num_accepted_tokens_total") == spec["num_accepted_draft_tokens"]
        depths = spec["accepted_per_depth"]
        per_pos = [
            live.metric("headstart:spec_decode_num_accepted_tokens_per_pos_total", position=str(p))
            for p in range(len(depths))
        ]
        assert per_pos == depths
        for usage in (False, True):
            streamed = {**body, "stream": True, **({"stream_options": {"include_usage": True}} if usage else {})}
            with httpx.stream("POST", live.url + "/v1/completions", json=streamed, timeout=60) as r:
                chunks = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
            carrying = [c for c in chunks if "metrics" in c]
            assert len(carrying) == 1 and carrying[0] is chunks[-1] and ("usage" in chunks[-1]) == usage
            assert carrying[0]["metrics"]["speculative_decoding"] == spec  # greedy: the same rounds again
    finally:
        live.close()
    live = LiveServer(tiny_engine(tiny_model_dir, "lookup"))
    try:
        assert "metrics" not in httpx.post(live.url + "/v1/completions", json=body, timeout=60).json()
    finally:
        live.close()


def test_the_suffix_pool_learns_from_the_servers_traffic_and_shows_on_metrics(tiny_model_dir):
    """A suffix drafter's pool is the server's: every finished request enters it, and /metrics shows what it holds,
    its lookups, its hits (the same prompt again matches the first request) and their cost. A server whose drafter
    keeps no pool shows none."""
    live = LiveServer(tiny_engine(tiny_model_dir, "suffix"), speculate_up_to=8)  # every round drafts
    body = {"model": NAME, "prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0}
    try:
        first = httpx.post(live.url + "/v1/completions", json=body, timeout=60).json()
        held = live.metric("headstart_suffix_pool_tokens")
        assert live.metric("headstart_suffix_pool_requests") == 1
        usage = first["usage"]
        assert usage["prompt_tokens"] < held <= usage["prompt_tokens"] + usage["completion_tokens"]
        assert live.metric("headstart_suffix_pool_hits_total") == 0
        httpx.post(live.url + "/v1/completions", json=body, timeout=60).raise_for_status()
        assert live.metric("headstart_suffix_pool_requests") == 2
        assert live.metric("headstart_suffix_pool_lookups_total") >= live.metric("headstart_suffix_pool_hits_total") > 0
        assert live.metric("headstart_suffix_pool_lookup_seconds_total") > 0
        assert live.metric("headstart_suffix_pool_lookup_seconds_p95") > 0
        assert live.metric("headstart_suffix_pool_calibration") == 1.0  # `suffix` grafts onto nothing: the prior
    finally:
        live.close()
    live = LiveServer(tiny_engine(tiny_model_dir, "lookup"))
    try:
        assert "headstart_suffix_pool" not in httpx.get(live.url + "/metrics").text
    finally:
        live.close()


def test_no_suffix_pool_turns_the_pool_off_and_is_refused_where_there_is_none(monkeypatch, capsys):
    """--no-suffix-pool: a suffix drafter keeps no pool (its pool_tokens 0); with a drafter that keeps none, or
    beside --suffix-pool-tokens N, a one-line error before anything loads."""
    from headstart.commands import common
    from headstart.runtime.models import DEFAULT_MODEL

    seen = []

    def stop(args):
        seen.append(common.drafter_options(args, args.drafter))
        raise common.UserError("stop here")

    monkeypatch.setattr(common, "load_engine", stop)
    assert main(["serve", "--model", DEFAULT_MODEL, "--drafter", "eagle+suffix", "--no-suffix-pool"]) == 2
    assert seen == [{"pool_tokens": 0}]
    assert main(["serve", "--model", DEFAULT_MODEL, "--drafter", "eagle+lookup", "--no-suffix-pool"]) == 2
    assert "keeps no pool" in capsys.readouterr().err
    flags = ["--drafter", "suffix", "--no-suffix-pool", "--suffix-pool-tokens", "9"]
    assert main(["serve", "--model", DEFAULT_MODEL, *flags]) == 2
    assert "not both" in capsys.readouterr().err and len(seen) == 1


def test_serve_decodes_with_the_shipped_eagle_head_unless_told(monkeypatch, tiny_model_dir):
    """No --drafter: the embedded model serves eagle+suffix (its EAGLE head is shipped; the load budget sizes the
    trees); a model without shipped heads, or one with an adapter (the heads were trained on the base), plain; a
    given --drafter is kept."""
    from headstart.commands import common
    from headstart.runtime.models import DEFAULT_MODEL

    seen = []

    def stop(args):
        seen.append(args.drafter)
        raise common.UserError("stop here")

    monkeypatch.setattr(common, "load_engine", stop)
    for argv in (
        ["--model", DEFAULT_MODEL],
        ["--model", str(tiny_model_dir)],
        ["--model", DEFAULT_MODEL, "--adapter", str(tiny_model_dir)],
        ["--model", DEFAULT_MODEL, "--drafter", "lookup"],
    ):
        assert main(["serve", *argv]) == 2
    assert seen == ["eagle+suffix", "none", "none", "lookup"]


def test_the_warm_up_caches_the_chat_prefix_and_leaves_no_trace(tiny_model_dir):
    """`headstart serve` decodes one request of its own before it opens its port: afterwards the chat template's
    shared prefix is cached, the drafters' pool holds nothing, and a request decodes in the
    served batch to the very tokens `generate` gives."""
    from headstart.runtime.drafters.suffix import pool_of
    from headstart.runtime.generate import Request

    engine = tiny_engine(tiny_model_dir, "suffix")
    app = build_app(engine, ServeConfig(NAME, speculate_up_to=8), worker_thread=False)
    worker = app.state.worker
    prefix = worker.batch.prefix
    assert prefix.ids == engine.encode(PROMPTS[0])[:2] and prefix.kv is None  # the tiny template's first two tokens
    assert worker.warm_up(tokens=6) > 0
    assert prefix.kv is not None
    assert pool_of(engine.drafter).stats()["requests"] == 0
    prompt = engine.encode(PROMPTS[1])
    request = worker.batch.add(Request(prompt, worker.drafter.fork(), max_new_tokens=12))
    made = []
    while not request.done:
        made += [t for r, chunk in worker.batch.round() for t in chunk.tokens]
    assert made == engine.generate(prompt, max_new_tokens=12).token_ids


def test_sigterm_only_sets_flags_so_a_server_always_stops(tiny_model_dir):
    """SIGTERM's handler runs on the worker's thread, maybe inside the lock of the queue an idle worker waits on:
    there it must take no lock (it did: `Worker.stop`'s put hung a server that never exited). Held lock, the
    handler returns at once; a served process stops on SIGTERM."""
    import signal
    import socket
    import subprocess
    import sys

    from headstart.commands.serving import stop_on_signal

    app = build_app(tiny_engine(tiny_model_dir), ServeConfig(NAME), worker_thread=False)
    worker, server = app.state.worker, type("Server", (), {"should_exit": False})()
    with worker.jobs.mutex:  # where the signal can land: inside the idle worker's queue.get
        handler = threading.Thread(target=stop_on_signal(server, worker), daemon=True)
        handler.start()
        handler.join(timeout=5)
        assert not handler.is_alive(), "the handler waited for the queue's lock"
    assert worker.stopping and server.should_exit

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cli = "import sys; from headstart.cli import main; sys.exit(main())"
    argv = ["serve", "--model", str(tiny_model_dir), "--drafter", "none", "--port", str(port)]
    proc = subprocess.Popen([sys.executable, "-c", cli, *argv], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_until(lambda: _answers(f"http://127.0.0.1:{port}/health") or proc.poll() is not None, 120, "serving")
        body = {"model": tiny_model_dir.name, "prompt": PROMPTS[0], "max_tokens": 4}
        assert httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60).status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
        proc.wait()


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_a_prompt_sent_again_starts_from_the_prefix_cache(tiny_model_dir):
    """The server keeps finished prompts' blocks (32 tokens): the same long prompt again finds them (/metrics counts
    prompt tokens looked up and found, as vLLM's prefix_cache_queries / _hits) and gets the same answer;
    `--prefix-cache-gb 0` keeps none."""
    prompt = " ".join(PROMPTS * 4)  # 80 tokens under the tiny template: two whole blocks
    body = {"model": NAME, "messages": [{"role": "user", "content": prompt}], "max_tokens": 8, "temperature": 0}
    live = LiveServer(tiny_engine(tiny_model_dir, "lookup"))
    try:
        first = httpx.post(live.url + "/v1/chat/completions", json=body, timeout=60).json()
        assert live.metric("headstart_prefix_cache_hits_total") == 0
        assert live.metric("headstart_prefix_cache_blocks") == 2
        again = httpx.post(live.url + "/v1/chat/completions", json=body, timeout=60).json()
        assert again["choices"][0]["message"] == first["choices"][0]["message"]
        assert live.metric("headstart_prefix_cache_hits_total") == 2 * 32
        assert live.metric("headstart_prefix_cache_queries_total") == 2 * (80 - 2)  # all but each prompt's last two
    finally:
        live.close()
    live = LiveServer(tiny_engine(tiny_model_dir, "lookup"), prefix_cache_gb=0)
    try:
        httpx.post(live.url + "/v1/chat/completions", json=body, timeout=60).raise_for_status()
        assert "headstart_prefix_cache" not in httpx.get(live.url + "/metrics").text
    finally:
        live.close()


def test_a_model_without_a_chat_template_serves_completions(tiny_model_dir):
    """No template: no shared chat prefix, a raw warm-up, /v1/completions answers (chat is refused, as before)."""
    engine = tiny_engine(tiny_model_dir)
    engine.tokenizer.chat_template = None
    app = build_app(engine, ServeConfig(NAME), worker_thread=False)
    assert app.state.worker.batch.prefix is None
    assert app.state.worker.warm_up(tokens=4) > 0
    live = LiveServer(engine)
    try:
        body = {"model": NAME, "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0}
        answer = httpx.post(live.url + "/v1/completions", json=body, timeout=60)
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 4
        chat = {"model": NAME, "messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": 4}
        assert httpx.post(live.url + "/v1/chat/completions", json=chat, timeout=60).status_code == 400
    finally:
        live.close()


def test_the_speculation_policy_is_chosen_by_name(tiny_model_dir):
    """runtime/sizing/policy.py builds what the worker runs: budget (the load planner) by default, fixed when a switch
    is given, off (plain) by name or for the drafter none; a switch beside budget or off is refused, before the model
    loads on the command line."""
    from headstart.runtime.drafters.base import Drafter
    from headstart.runtime.sizing.budgeted import Budgeted
    from headstart.runtime.sizing.gate import GatedDrafter

    engine = tiny_engine(tiny_model_dir, "lookup")
    for config, policy, drafter, planned in (
        ({}, "budget", Budgeted, True),
        ({"speculate_up_to": 2}, "fixed", GatedDrafter, False),
        ({"speculation": "fixed"}, "fixed", GatedDrafter, False),
        ({"speculation": "off"}, "off", Drafter, False),
    ):
        worker = build_app(engine, ServeConfig(NAME, **config), worker_thread=False).state.worker
        assert worker.policy == policy and type(worker.drafter) is drafter, config
        assert (worker.batch.planner is not None) == planned, config
    plain = build_app(tiny_engine(tiny_model_dir, "none"), ServeConfig(NAME), worker_thread=False).state.worker
    assert plain.policy == "off"
    argv = ["serve", "--model", str(tiny_model_dir), "--speculation", "budget", "--speculate-up-to", "2"]
    assert main(argv) == 2  # one line, no model loaded
