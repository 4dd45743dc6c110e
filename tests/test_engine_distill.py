"""Distillation on a serving engine, against `headstart serve` on a tiny model: the rows equal local distillation
at T = 0, a server killed mid-run loses and repeats nothing once the run is started again, and a server
serving another model is refused in one line."""

from __future__ import annotations

import json
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from headstart.cli import main
from headstart.runtime.models import load_model
from headstart.runtime.prompts import load_prompts
from headstart.train.distill import distill
from helpers.models import WORDS, tiny_llama, tiny_tokenizer
from helpers.server import LiveServer, tiny_engine


def prompt_file(path: Path, n: int, seed: int = 0) -> Path:
    rng = random.Random(seed)
    rows = [
        {"id": f"p{i}", "category": "x", "turns": [" ".join(rng.choice(WORDS[3:]) for _ in range(6))]} for i in range(n)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def rows(folder: Path) -> list[dict]:
    return [
        json.loads(line) for shard in sorted(folder.glob("shard-*.jsonl")) for line in shard.read_text().splitlines()
    ]


def test_engine_rows_equal_local_distillation(tiny_model_dir, tmp_path, capsys):
    prompts = prompt_file(tmp_path / "p.jsonl", 12)
    live = LiveServer(tiny_engine(tiny_model_dir, "lookup"))
    try:
        argv = [
            "distill",
            "--model",
            str(tiny_model_dir),
            "--dtype",
            "float32",
            "--prompts",
            str(prompts),
            "--max-new-tokens",
            "24",
            "--concurrency",
            "4",
        ]
        assert main([*argv, "--engine", live.url, "--out", str(tmp_path / "engine")]) == 0, capsys.readouterr().err
    finally:
        live.close()
    model, tokenizer = load_model(str(tiny_model_dir))
    distill(model, tokenizer, load_prompts(prompts), tmp_path / "local", max_new_tokens=24, batch_size=1)
    engine = {r["id"]: r for r in rows(tmp_path / "engine")}
    local = {r["id"]: r for r in rows(tmp_path / "local")}
    assert engine == local and len(engine) == 12


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(model_dir: Path, port: int) -> subprocess.Popen:
    """`headstart serve` as its own process (killed for real below)."""
    cmd = [
        sys.executable,
        "-m",
        "headstart.cli",
        "serve",
        "--model",
        str(model_dir),
        "--dtype",
        "float32",
        "--port",
        str(port),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        assert time.time() < deadline and proc.poll() is None, "server did not start"
        time.sleep(0.2)


def test_a_killed_server_loses_and_repeats_nothing(tiny_model_dir, tmp_path):
    prompts = prompt_file(tmp_path / "p.jsonl", 60)
    out = tmp_path / "out"
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "headstart.cli",
        "distill",
        "--model",
        str(tiny_model_dir),
        "--dtype",
        "float32",
        "--prompts",
        str(prompts),
        "--out",
        str(out),
        "--engine",
        f"http://127.0.0.1:{port}",
        "--max-new-tokens",
        "64",
        "--concurrency",
        "2",
        "--retries",
        "1",
    ]
    server = serve(tiny_model_dir, port)
    run = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while len(rows(out)) < 10 if out.exists() else True:
            assert time.time() < deadline and run.poll() is None, "distillation did not start"
            time.sleep(0.05)
        server.kill()  # mid-run
        server.wait()
        _, err = run.communicate(timeout=120)
        assert run.returncode == 2, err[-2000:]
        last = err.strip().splitlines()[-1]
        assert "failed 2 times" in last and "run the same command again to resume" in last, last
        assert 10 <= len(rows(out)) < 60
        server = serve(tiny_model_dir, port)
        done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
    finally:
        server.kill()
        run.kill()
    ids = [r["id"] for r in rows(out)]
    assert len(ids) == len(set(ids)) == 60 and set(ids) == {f"p{i}" for i in range(60)}


def test_a_server_serving_another_model_is_refused(tiny_model_dir, tmp_path, capsys):
    other = tmp_path / "other"
    model = tiny_llama(vocab_size=len(WORDS), init_std=0.3, seed=7)  # same tokenizer, other weights
    model.generation_config.eos_token_id = 1
    model.save_pretrained(other)
    tiny_tokenizer().save_pretrained(other)
    live = LiveServer(tiny_engine(other, "none"))
    try:
        argv = [
            "distill",
            "--model",
            str(tiny_model_dir),
            "--dtype",
            "float32",
            "--out",
            str(tmp_path / "o"),
            "--prompts",
            str(prompt_file(tmp_path / "p.jsonl", 4)),
            "--engine",
            live.url,
        ]
        assert main(argv) == 2
    finally:
        live.close()
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "not this target" in err and not list((tmp_path / "o").glob("shard-*.jsonl"))


def test_engine_flag_errors_are_one_line(capsys):
    assert main(["distill", "--out", "x", "--engine", "http://127.0.0.1:9", "--retries", "-1"]) == 2
    assert "--retries" in capsys.readouterr().err
