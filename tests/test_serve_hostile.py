"""`headstart serve` against hostile and careless clients, each case reproduced against the real uvicorn server
(tiny model, 127.0.0.1), bounded in time and count: cancellation, limits, liveness, OpenAI's defaults."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest
import torch

from headstart.cli import main
from helpers.server import NAME, LiveServer, leave_after, tiny_engine, wait_until

STORY = {"model": NAME, "prompt": "the cat", "max_tokens": 400, "temperature": 1}


@pytest.fixture(scope="module")
def slow(tiny_model_dir):
    """A server whose rounds take 20 ms or more, so a long request is long; no <eos> ends it early. One request
    decodes at a time (max_batch 1), so the next ones queue."""
    engine = tiny_engine(tiny_model_dir, "none", delay_s=0.02)
    engine.eos_ids = frozenset()
    live = LiveServer(engine, max_queue=2, max_body_bytes=1 << 20, max_batch=1)
    yield live
    live.close()


def test_a_non_streaming_client_that_leaves_is_cancelled_within_a_round(slow):
    leave_after(slow.url, STORY, 1.0)
    took = wait_until(lambda: slow.metric("headstart_running_requests") == 0, 5, "generation still running")
    assert took < 1.0  # one round is 20 ms; the disconnect is noticed at once
    t0 = time.perf_counter()
    r = httpx.post(slow.url + "/v1/completions", json={**STORY, "max_tokens": 3}, timeout=30)
    assert r.status_code == 200 and time.perf_counter() - t0 < 2  # not behind 400 tokens
    assert slow.metric("headstart_requests_total", endpoint="/v1/completions", status="499") >= 1


def test_clients_that_leave_the_queue_give_their_slots_back(slow):
    running = threading.Thread(target=leave_after, args=(slow.url, STORY, 3.0))
    running.start()  # holds the worker for 3 s
    wait_until(lambda: slow.metric("headstart_running_requests") == 1, what="first request running")
    for _ in range(2):  # max_queue = 2: both wait, then leave
        leave_after(slow.url, {**STORY, "max_tokens": 2}, 0.3)
    wait_until(lambda: slow.metric("headstart_queue_depth") == 0, 2, "abandoned requests still hold the queue")
    waiting = httpx.post(slow.url + "/v1/completions", json={**STORY, "max_tokens": 2}, timeout=30)
    assert waiting.status_code == 200  # not 429 "2 requests are waiting" with nobody waiting
    running.join()


def test_bodies_past_the_limit_get_413_and_health_stays_fast(slow):
    big = json.dumps({"model": NAME, "prompt": "x" * (1 << 20)})
    r = httpx.post(slow.url + "/v1/completions", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks():  # no Content-Length: the limit holds on what arrives
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(40):
            yield b"y" * 32768
        yield b'"}'

    r = httpx.post(slow.url + "/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413
    # the largest allowed body, one after another: /health answers within 100 ms meanwhile
    allowed = json.dumps({"model": NAME, "messages": [{"role": "user", "content": "the cat " * 120_000}]})
    assert len(allowed) < 1 << 20

    def send_three():
        for _ in range(3):
            assert httpx.post(slow.url + "/v1/chat/completions", content=allowed, timeout=60).status_code == 400

    sender = threading.Thread(target=send_three)
    latencies = []
    with httpx.Client(base_url=slow.url, timeout=5) as client:
        client.get("/health")  # connected before the clock starts
        sender.start()
        while sender.is_alive():
            t0 = time.perf_counter()
            assert client.get("/health").status_code == 200
            latencies.append(time.perf_counter() - t0)
    sender.join()
    assert max(latencies) < 0.1, f"/health took up to {max(latencies):.3f} s"


def test_unknown_paths_fold_into_one_metrics_label(slow):
    size = len(httpx.get(slow.url + "/metrics").text)
    for i in range(300):
        httpx.get(f"{slow.url}/{i}-{'z' * 4000}")
    assert httpx.get(slow.url + f"/{'q' * 100}").json()["error"]["code"] == "404"
    text = httpx.get(slow.url + "/metrics").text
    assert len(text) < size + 2000 and 'endpoint="other",status="404"' in text and "zzzz" not in text


def test_openai_defaults_pass_and_wrong_types_do_not(slow):
    ok = {"model": NAME, "messages": [{"role": "user", "content": "the cat"}], "max_tokens": 2}
    for extra in [
        {"temperature": None, "top_p": None, "stream": None},
        {"response_format": {"type": "text"}},
        {"store": False},
        {"metadata": {}},
        {"tool_choice": "none"},
        {"n": 1},
        {"logprobs": False},
        {"temperature": 1e-40},
        {"temperature": 5e-324, "seed": 3},
    ]:
        r = httpx.post(slow.url + "/v1/chat/completions", json={**ok, **extra}, timeout=30)
        assert r.status_code == 200, (extra, r.text)
    for extra, param in [
        ({"max_tokens": "4"}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"temperature": "1"}, "temperature"),
        ({"stream": "yes"}, "stream"),
        ({"seed": 2**70}, "seed"),
        ({"n": 2}, "'n' is not supported"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
    ]:
        r = httpx.post(slow.url + "/v1/chat/completions", json={**ok, **extra}, timeout=30)
        assert r.status_code == 400 and param in r.json()["error"]["message"], (extra, r.text)


def test_bad_unicode_is_a_400(slow):
    body = '{"model": "tiny", "prompt": "a \\ud800 b", "max_tokens": 2}'
    r = httpx.post(slow.url + "/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400 and "lone surrogate" in r.json()["error"]["message"]


def test_an_unexpected_error_is_a_500_with_an_openai_body(tiny_model_dir, monkeypatch):
    """A bug inside a route (here: the worker refuses every job with a RuntimeError) answers that request with
    OpenAI's error body and a 500, counted in /metrics; the server goes on answering."""
    live = LiveServer(tiny_engine(tiny_model_dir, "none"))
    try:

        def broken(job):
            raise RuntimeError("a bug")

        monkeypatch.setattr(live.app.state.worker, "submit", broken)
        r = httpx.post(live.url + "/v1/completions", json={"model": NAME, "prompt": "the", "max_tokens": 2})
        assert r.status_code == 500
        assert r.json()["error"] == {
            "message": "internal error: RuntimeError",
            "type": "server_error",
            "param": None,
            "code": None,
        }
        assert live.metric("headstart_requests_total", endpoint="/v1/completions", status="500") == 1
        assert httpx.get(live.url + "/health").status_code == 200
    finally:
        live.close()


def test_head_on_get_routes_and_allow_on_405(slow):
    for path in ("/health", "/v1/models", "/metrics"):
        assert httpx.head(slow.url + path).status_code == 200, path
    r = httpx.post(slow.url + "/health")
    assert r.status_code == 405 and "GET" in r.headers["allow"] and r.json()["error"]["code"] == "405"


def test_echoed_values_are_cut_short(slow):
    r = httpx.post(slow.url + "/v1/completions", json={"model": "m" * 500_000, "prompt": "the"})  # under the limit
    assert r.status_code == 400 and len(r.text) < 1000 and r.json()["error"]["code"] == "model_not_found"
    r = httpx.post(slow.url + "/v1/completions", json={"model": NAME, "prompt": "the", "k" * 5000: 1})
    assert r.status_code == 400 and len(r.text) < 1000


def test_a_dead_worker_makes_health_503_and_requests_fail_fast(tiny_model_dir):
    live = LiveServer(tiny_engine(tiny_model_dir, "none"))
    try:
        worker = live.app.state.worker
        worker.jobs.put(None)  # the worker thread ends, as it would on a crash
        worker.thread.join(timeout=10)
        assert httpx.get(live.url + "/health").status_code == 503
        t0 = time.perf_counter()
        r = httpx.post(live.url + "/v1/completions", json={"model": NAME, "prompt": "the", "max_tokens": 2}, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "worker_dead" and time.perf_counter() - t0 < 1
    finally:
        live.close()


def test_cli_bad_files_and_numbers_are_one_line(capsys, tiny_model_dir, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in tiny_model_dir.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # truncated
    base = ["generate", "--prompt", "the cat", "--max-new-tokens", "2"]
    for argv, message in [
        ([*base, "--model", str(broken)], "cannot load model"),
        (
            [*base, "--model", str(tiny_model_dir), "--drafter", "medusa", "--heads", str(tiny_model_dir)],
            "is not a heads checkpoint",
        ),
        ([*base, "--model", str(tiny_model_dir), "--seed", str(2**70)], "--seed"),
        ([*base, "--model", str(tiny_model_dir), "--temperature", "1e-40"], None),  # greedy, not a traceback
    ]:
        code = main(argv)
        err = capsys.readouterr().err
        assert "Traceback" not in err
        if message is None:
            assert code == 0, err
        else:
            assert code == 2 and message in err and len(err.strip().splitlines()[-1]) < 400, err


def test_served_model_name_is_never_a_path():
    from headstart.commands.serving import served_name

    assert served_name("/home/me/models/Qwen2-0.5B/", None) == "Qwen2-0.5B"
    assert served_name("weights/model-q4.gguf", None) == "model-q4"
    assert served_name("smollm2-135m-instruct", None) == "smollm2-135m-instruct"
    assert served_name("/x/y", "mine") == "mine"


def test_the_server_still_answers_after_the_hostile_clients(slow):
    """The module's server still answers after everything above (nothing crashed it)."""
    assert httpx.get(slow.url + "/health").json()["status"] == "ok"
    with socket.create_connection(("127.0.0.1", int(slow.url.rsplit(":", 1)[1])), timeout=5):
        pass


def test_soak_mix_runs_and_counts_every_kind(tiny_model_dir, tmp_path, capsys):
    """`headstart loadtest --soak` for a few seconds against the tiny model: no 5xx, every kind counted."""
    live = LiveServer(tiny_engine(tiny_model_dir, "lookup"))
    prompts = tmp_path / "p.jsonl"
    texts = ["the cat sat on the mat", "a dog ran to the cat", "the mat"]
    prompts.write_text("".join(json.dumps({"id": str(i), "turns": [t]}) + "\n" for i, t in enumerate(texts)))
    args = ["--soak", "8", "--clients", "4", "--prompts", str(prompts), "--check-answers", str(tiny_model_dir)]
    try:
        assert main(["loadtest", "--url", live.url, *args]) == 0
    finally:
        live.close()
    result = json.loads(capsys.readouterr().out)
    assert result["status_5xx"] == 0 and result["served_200"] > 0 and result["rss_end_mb"] > 0
    assert not [k for k in result["by_kind_and_status"] if "client error" in k]
    assert result["answers"]["checked"] > 0 and result["answers"]["wrong"] == []  # batched, each its own


def test_the_answer_check_finds_an_answer_given_to_the_wrong_prompt(tiny_model_dir):
    from headstart.runtime.apps.server.answers import check_answers
    from headstart.runtime.models import load_model
    from headstart.runtime.tokens import chat_ids

    model, tokenizer = load_model(str(tiny_model_dir))
    answers = {}
    for text in ("the cat sat on the mat", "a dog ran to the cat"):
        ids = chat_ids(tokenizer, [{"role": "user", "content": text}])
        ids_t = torch.tensor([ids])  # (token 0 is in the template: an explicit mask, or generate masks it as padding)
        out = model.generate(ids_t, attention_mask=torch.ones_like(ids_t), max_new_tokens=12, do_sample=False)
        answers[text] = out[0, len(ids) :].tolist()
    (a, ids_a), (b, ids_b) = answers.items()
    assert ids_a != ids_b
    right = check_answers(model, tokenizer, [{"prompt": a, "token_ids": ids_a}, {"prompt": b, "token_ids": ids_b}])
    assert right == {"checked": 2, "tokens": len(ids_a) + len(ids_b), "wrong": []}
    swapped = check_answers(model, tokenizer, [{"prompt": a, "token_ids": ids_b}])
    assert len(swapped["wrong"]) == 1 and swapped["wrong"][0]["gap"] > 1e-4
