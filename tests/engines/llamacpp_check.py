"""`make test-llamacpp`: the shipped EAGLE-3 head, exported, converted by llama.cpp's own converter and drafted by
llama.cpp's `draft-eagle3`; the proof that llama.cpp runs the same head.

    .venv/bin/python tests/engines/llamacpp_check.py [--llamacpp DIR] [--heads DIR] [--prompts N] [--max-tokens N]

1. the embedded model converted to an F32 GGUF by llama.cpp's `convert_hf_to_gguf.py` (cached beside the build);
2. `headstart export --for llamacpp` writes the head (the SpecForge layout, checked for what llama.cpp runs), and the
   same converter turns it into a draft GGUF (`--target-model-dir`: the target's config and tokenizer);
3. headstart decodes the prompts (the project's test prompts, never trained on, not the tune prompts) in float32 at
   T = 0 with a chain of 3 (`eagle3`, top-k 1, depth 3, 3 nodes: `--profile neutral --tree-top-k 1 --tree-depth 3
   --tree-budget 3`): its accepted / drafted;
4. `llama-server` answers the same prompt token ids without a draft, then with the head (`--spec-type draft-eagle3
   --spec-draft-n-max 3 --spec-draft-p-min 0`, llama.cpp's default p-min), one request at a time, and reports
   `draft_n` and `draft_n_accepted` per answer;
5. checks: llama.cpp's answers with and without the head are identical, and equal headstart's (or part at a tie
   shown on the target's float32 logits, as in tests/engines/vllm_check.py); llama.cpp's accepted / drafted within
   10 % of headstart's.
With `--variant NAME` the head is first rewritten as that EAGLE-3 variant (vllm_check.VARIANTS): a variant llama.cpp
runs (norm_before_fc) must pass the same checks; the others must be refused by the export in one line, before any
file is written (never a head that loads and drafts something else).
Prints both sides' figures and writes them to OUT/llamacpp-check.json; exit 1 if a check fails.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from vllm_check import STEPS, TieCheck, engine_args, export_for, headstart_side

ROOT = Path(__file__).resolve().parents[2]
LLAMACPP_HOME = Path.home() / ".cache/headstart/llamacpp/0.3.36"  # the Makefile's LLAMACPP_HOME
# the EAGLE-3 variants (vllm_check.VARIANTS) llama.cpp would draft otherwise: `headstart export --for llamacpp` refuses
# them (heads/export.py engine_refusal); the others must reach parity
REFUSED = ("five_fused", "two_layers", "fc_norm", "norm_output")


def convert(src: Path, python: str, model_dir: Path, out: Path, outtype: str, target_dir: Path | None = None) -> Path:
    """`model_dir` converted to `out` by llama.cpp's own converter (with the gguf-py it ships, not PyPI's)."""
    cmd = [python, str(src / "convert_hf_to_gguf.py"), str(model_dir), "--outtype", outtype, "--outfile", str(out)]
    if target_dir is not None:
        cmd += ["--target-model-dir", str(target_dir)]
    env = {**os.environ, "PYTHONPATH": str(src / "gguf-py"), "NO_LOCAL_GGUF": ""}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        sys.exit(f"llama.cpp's converter failed ({' '.join(cmd)}):\n{done.stderr[-3000:]}")
    return out


def target_gguf(home: Path, python: str, model_dir: Path, outtype: str = "f32") -> Path:
    """The embedded model as a GGUF of `outtype`, converted once per machine and model (cached beside the build)."""
    out = home / "models" / f"{model_dir.name}-{outtype}.gguf"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".tmp")
        convert(home / "llama.cpp", python, model_dir, tmp, outtype)
        tmp.rename(out)
    return out


def draft_eagle3_args(draft: Path) -> list[str]:
    """llama-server's arguments to draft with the converted EAGLE-3 head `draft`: chains of STEPS, its default p-min."""
    return [
        "--spec-type",
        "draft-eagle3",
        "-md",
        str(draft),
        "--spec-draft-n-max",
        str(STEPS),
        "--spec-draft-p-min",
        "0",
    ]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict, timeout: float = 600) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def server_command(bin_dir: Path, model: Path, port: int, threads: int, slots: int = 1) -> list[str]:
    """llama-server on `model` at 127.0.0.1:`port`: `slots` sequences batched, 4,096 tokens of context each."""
    cmd = [str(bin_dir / "llama-server"), "-m", str(model), "--port", str(port), "--host", "127.0.0.1"]
    return [*cmd, "-np", str(slots), "-c", str(4096 * slots), "-t", str(threads)]


@contextmanager
def llama_server(bin_dir: Path, model: Path, extra: list[str], threads: int, log: Path, slots: int = 1):
    """A llama-server on a free port (its base URL), stopped on exit; its output goes to `log`."""
    port = free_port()
    cmd = [*server_command(bin_dir, model, port, threads, slots), "--no-warmup", *extra]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                sys.exit(f"llama-server exited ({' '.join(cmd)}):\n{log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(url + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                sys.exit(f"llama-server did not start in 300 s: {log}")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


def complete(url: str, prompt_ids: list[list[int]], max_tokens: int) -> dict:
    """Greedy completions of each prompt (token ids in, token ids out), one request at a time."""
    answers, drafted, accepted, seconds = [], 0, 0, 0.0
    for ids in prompt_ids:
        body = {"prompt": ids, "n_predict": max_tokens, "temperature": 0, "return_tokens": True, "cache_prompt": False}
        t0 = time.perf_counter()
        out = post(url + "/completion", body)
        seconds += time.perf_counter() - t0
        answers.append(out["tokens"])
        drafted += out["timings"].get("draft_n", 0)
        accepted += out["timings"].get("draft_n_accepted", 0)
    return {"token_ids": answers, "drafted": drafted, "accepted": accepted, "seconds": seconds}


def main() -> int:
    from headstart.commands.common import TEST_PROMPTS
    from headstart.runtime.prompts import load_prompts

    p = engine_args(__doc__.split("\n")[0], 64, "llamacpp-check")
    p.add_argument("--llamacpp", default=str(LLAMACPP_HOME), help="the folder `make llamacpp` builds into")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    args = p.parse_args()
    home = Path(args.llamacpp)
    if not (home / ".built").exists():
        sys.exit(f"no llama.cpp build in {home}: run `make llamacpp`")
    from headstart.heads.export import ExportError

    try:
        heads, out, model_dir, draft_dir = export_for(args, engine="llamacpp")
    except ExportError as e:  # what a user of `headstart export --for llamacpp` reads
        print(f"llama.cpp check{f' ({args.variant})' if args.variant else ''}: refused by the export: {e}")
        return 0 if args.variant in REFUSED else 1
    if args.variant in REFUSED:
        print(f"llama.cpp check ({args.variant}): FAILED: the export should refuse it")
        return 1
    python = sys.executable
    target = target_gguf(home, python, Path(model_dir))
    draft = convert(home / "llama.cpp", python, draft_dir, out / "eagle3-f32.gguf", "f32", Path(model_dir))

    prompts = [pr.text for pr in load_prompts(ROOT / TEST_PROMPTS, limit=args.prompts)]
    ours = headstart_side(heads, prompts, args.max_tokens)
    ours_drafted = STEPS * ours["rounds"]
    ours_accepted = sum(ours["accepted_per_depth"])
    bin_dir = home / "build/bin"
    with llama_server(bin_dir, target, draft_eagle3_args(draft), args.threads, out / "server-eagle3.log") as url:
        theirs = complete(url, ours["prompt_ids"], args.max_tokens)
    plain = None
    if not args.variant:
        with llama_server(bin_dir, target, [], args.threads, out / "server-plain.log") as url:
            plain = complete(url, ours["prompt_ids"], args.max_tokens)

    ties = TieCheck(ours["prompt_ids"])
    n = len(prompts)
    same = n if plain is None else ties.count(plain["token_ids"], theirs["token_ids"])
    same_as_ours = ties.count(ours["token_ids"], theirs["token_ids"])
    rate = theirs["accepted"] / theirs["drafted"] if theirs["drafted"] else 0.0
    our_rate = ours_accepted / ours_drafted if ours_drafted else 0.0
    gap = abs(rate - our_rate) / our_rate if our_rate else 1.0
    report = {
        "prompts": n,
        "max_tokens": args.max_tokens,
        "draft_n_max": STEPS,
        "variant": args.variant,
        "llamacpp_identical_with_and_without_head": same,
        "llamacpp_identical_to_headstart": same_as_ours,
        "llamacpp_drafted": theirs["drafted"],
        "llamacpp_accepted": theirs["accepted"],
        "llamacpp_accepted_per_drafted": round(rate, 4),
        "headstart_drafted": ours_drafted,
        "headstart_accepted": ours_accepted,
        "headstart_accepted_per_drafted": round(our_rate, 4),
        "headstart_accepted_per_depth": ours["accepted_per_depth"],
        "relative_gap": round(gap, 4),
        "llamacpp_seconds": {"eagle3": round(theirs["seconds"], 2)}
        | ({} if plain is None else {"plain": round(plain["seconds"], 2)}),
        "answers_parting_at_a_shown_tie": ties.shown,
        "answers_parting_without_a_tie": ties.not_ties,
    }
    (out / "llamacpp-check.json").write_text(json.dumps(report, indent=2))
    without = "not rerun" if plain is None else f"{same}/{n}"
    print(f"identical answers, llama.cpp with vs without the head: {without} (vs headstart: {same_as_ours}/{n})")
    print(
        f"accepted / drafted: llama.cpp {theirs['accepted']} / {theirs['drafted']} = {rate:.3f}, "
        f"headstart {ours_accepted} / {ours_drafted} = {our_rate:.3f}; gap {100 * gap:.1f} %"
    )
    if plain is not None:
        print(f"llama.cpp seconds for the {n} answers: plain {plain['seconds']:.1f}, eagle3 {theirs['seconds']:.1f}")
    if ties.shown or ties.not_ties:
        print(f"answers parting at a shown tie: {ties.shown}; without one: {ties.not_ties}")
    ok = same == same_as_ours == n and gap <= 0.10
    print(f"llama.cpp check{f' ({args.variant})' if args.variant else ''}: " + ("OK" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
