"""`headstart drift`: how far a LoRA adapter moves its target from the original model.

On held-out prompts, the original model (the adapter disabled) and the adapted one each answer
greedily; reported: the share of answers that are identical token for token, the mean length of
their common prefix, and the mean KL(p || p') per token, p the original's next-token distribution
and p' the adapted one's, both read along the original's answer (teacher-forced). For Medusa-2
heads (`train/medusa2.py`) this says what the speedup costs in the model's own answers.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from headstart.heads.checkpoint import CheckpointConfig
from headstart.runtime.engine import Engine
from headstart.train.medusa2 import self_distillation_kl


@dataclass
class PromptDrift:
    prompt_tokens: int
    identical: bool  # the two greedy answers are the same token ids
    common_prefix: int  # tokens before they part
    kl_per_token: float  # mean KL(p || p') along the original's answer
    answer_tokens: int


def held_out_prompts(heads_dir: str | Path, limit: int, data_path: str | None = None) -> list[list[int]]:
    """The prompts (token ids) of the rows the heads' training run held out, as it chose them."""
    from headstart.train.data import load_rows, split_rows

    config = CheckpointConfig.find(heads_dir)
    if config is None:
        raise ValueError(f"{heads_dir} has no config.json of a training run: give `prompts` (a prompt file)")
    data = (config.training or {}).get("data", {})
    if not data:
        raise ValueError(f"{Path(heads_dir) / 'config.json'} records no training data: give `prompts` (a prompt file)")
    folders = [data_path] if data_path else [data["path"], *data.get("sources", [])]
    _, held = split_rows(load_rows(folders, data["max_len"]), data["eval_rows"])
    return [row.input_ids[: row.n_prompt] for row in held[:limit]]


@torch.no_grad()
def measure_drift(engine: Engine, prompts: list[list[int]], max_new_tokens: int = 128) -> list[PromptDrift]:
    """Original vs adapted on each prompt; `engine` holds a live (unmerged) peft model."""
    model = engine.target.model
    if not hasattr(model, "disable_adapter"):
        raise ValueError("measure_drift needs the adapter live (a peft model), not merged")
    results = []
    for ids in tqdm(prompts, desc="drift", unit="prompt", dynamic_ncols=True):
        adapted = engine.generate(ids, max_new_tokens=max_new_tokens).token_ids
        with model.disable_adapter():
            original = engine.generate(ids, max_new_tokens=max_new_tokens).token_ids
            logits_p = _answer_logits(model, ids, original)
        logits_q = _answer_logits(model, ids, original)
        prefix = next(
            (i for i, (a, b) in enumerate(zip(adapted, original, strict=False)) if a != b),
            min(len(adapted), len(original)),
        )
        kl = self_distillation_kl(logits_q, logits_p).item() if len(original) else 0.0
        results.append(PromptDrift(len(ids), adapted == original, prefix, kl, len(original)))
    return results


def _answer_logits(model, prompt: list[int], answer: list[int]) -> torch.Tensor:
    """(len(answer), V) float32 logits that predict each answer token, teacher-forced."""
    ids = torch.tensor([prompt + answer], device=model.device)
    logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1]
    return logits.float()


def summarize_drift(results: list[PromptDrift]) -> dict[str, float]:
    tokens = sum(r.answer_tokens for r in results)
    return {
        "prompts": len(results),
        "identical_share": sum(r.identical for r in results) / max(len(results), 1),
        "mean_common_prefix": sum(r.common_prefix for r in results) / max(len(results), 1),
        "kl_per_token": sum(r.kl_per_token * r.answer_tokens for r in results) / max(tokens, 1),
    }


def save_drift(results: list[PromptDrift], summary: dict, out_dir: Path, meta: dict) -> Path:
    import time

    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"drift-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps({"meta": meta, "summary": summary, "prompts": [asdict(r) for r in results]}))
    return path
