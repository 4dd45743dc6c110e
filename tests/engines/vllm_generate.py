"""Greedy answers and speculative-decoding counters from a real vLLM: run with the vLLM venv's python.

    .venv-vllm/bin/python tests/engines/vllm_generate.py --model DIR --prompts ids.json --out out.json \
        [--draft EAGLE3_DIR --steps 3]

Imports only vLLM and the standard library (the vLLM venv has no headstart). Prompts are token ids
(headstart renders the chat template), so both sides decode the very same prompt.
"""

from __future__ import annotations

import argparse
import json
import os
import time


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--prompts", required=True, help="JSON list of token-id lists")
    p.add_argument("--out", required=True)
    p.add_argument("--draft", default=None, help="an EAGLE-3 draft directory (SpecForge layout)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--one-at-a-time", action="store_true", help="batch 1: one request after the other, timed")
    args = p.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    spec = {"method": "eagle3", "model": args.draft, "num_speculative_tokens": args.steps} if args.draft else None
    llm = LLM(
        model=args.model,
        dtype="float32",
        max_model_len=2048,
        enforce_eager=True,
        disable_log_stats=False,
        speculative_config=spec,
        seed=0,
    )
    with open(args.prompts) as f:
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in json.load(f)]
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    seconds = None
    if args.one_at_a_time:  # batch 1, as headstart serves: a warm-up, then each prompt alone
        llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)
        outputs, t0 = [], time.perf_counter()
        for prompt in prompts:
            outputs += llm.generate([prompt], greedy, use_tqdm=False)
        seconds = time.perf_counter() - t0
    else:
        outputs = llm.generate(prompts, greedy)
    counters = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:spec_decode"):
            counters[metric.name] = getattr(metric, "values", None) or getattr(metric, "value", None)
    result = {
        "token_ids": [list(o.outputs[0].token_ids) for o in outputs],
        "text": [o.outputs[0].text for o in outputs],
        "spec_decode": counters,
        "seconds": seconds,
    }
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":  # vLLM spawns its engine core: the module must import without side effects
    main()
