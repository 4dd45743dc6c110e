"""Medusa-2: a LoRA on the target trained with the heads (self-distillation), saved beside them, and the
target those heads load as (base + that adapter), decoded exactly; the drift measure; config refusals."""

from __future__ import annotations

import json

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file

from headstart.cli import main as cli
from headstart.heads.checkpoint import HeadsMismatchError
from headstart.runtime.adapters import adapter_sha
from headstart.runtime.drafters.registry import heads_adapter, make_drafter
from headstart.runtime.engine import Engine
from headstart.runtime.models import load_model
from headstart.train import heads as train_heads
from headstart.train import recipe
from headstart.train.drift import measure_drift, summarize_drift
from headstart.train.medusa2 import self_distillation_kl
from helpers.exactness import assert_greedy_identity
from helpers.training import make_cfg

PROMPTS = [[3, 4, 5, 6, 3, 4, 5], [10, 11, 12, 13, 10, 11], [20, 21]]
LORA = {"heads.lora.r": 4, "heads.lora.target_modules": "[q_proj, v_proj, down_proj]", "heads.lora.lr": 0.01}


@pytest.fixture(scope="module")
def medusa2_run(tiny_model_dir, tmp_path_factory):
    """A 6-step Medusa-2 run on the tiny model: (output dir, held-out metrics)."""
    root = tmp_path_factory.mktemp("medusa2")
    metrics = recipe.run(make_cfg(root, tiny_model_dir, "medusa2", **LORA))["medusa2"]
    return root / "out", metrics


def test_self_distillation_kl_by_hand():
    original = torch.tensor([[2.0, 0.0, -1.0], [0.5, 0.5, 0.0]])
    adapted = torch.tensor([[1.0, 1.0, -1.0], [0.0, 1.0, 0.0]])
    p, q = original.softmax(-1), adapted.softmax(-1)
    by_hand = (p * (p.log() - q.log())).sum(-1).mean()
    assert self_distillation_kl(adapted, original).item() == pytest.approx(by_hand.item(), rel=1e-6)
    assert self_distillation_kl(original, original).item() == pytest.approx(0.0, abs=1e-7)


def test_medusa2_trains_the_lora_and_saves_it_beside_the_heads(medusa2_run, tiny_model_dir):
    out, metrics = medusa2_run
    heads = out / "heads"
    assert {"adapter_config.json", "adapter_model.safetensors", "config.json", "model.safetensors"} == {
        p.name for p in heads.iterdir()
    }
    config = json.loads((heads / "config.json").read_text())
    assert config["kind"] == "medusa2" and config["target"]["adapter"] == adapter_sha(heads)
    assert json.loads((heads / "adapter_config.json").read_text())["base_model_name_or_path"] == str(tiny_model_dir)
    lora = load_file(heads / "adapter_model.safetensors")
    assert any("lora_B" in k and v.abs().max() > 0 for k, v in lora.items())  # B starts at 0: the LoRA trained
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [x["train/loss"] for x in lines]
    assert losses[-1] < losses[0]
    assert metrics["drift/kl"] > 0 and {"head_1/acceptance", "acceptance_length"} <= set(metrics)


def test_medusa2_heads_load_base_plus_their_adapter_and_decode_exactly(medusa2_run, tiny_model_dir):
    heads = str(medusa2_run[0] / "heads")
    assert heads_adapter("medusa2", None, heads) == heads and heads_adapter("medusa", None, None) is None
    engine = Engine.load(str(tiny_model_dir), "float32", "medusa2", heads=heads)  # no --adapter: the heads' own
    assert engine.adapter == heads and engine.adapter_sha == adapter_sha(heads)
    base, tokenizer = load_model(str(tiny_model_dir))
    peft_merged = PeftModel.from_pretrained(base, heads).merge_and_unload()  # what peft alone makes of it
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        torch.testing.assert_close(engine.target.model(input_ids=ids).logits, peft_merged(input_ids=ids).logits)
    model = engine.target.model
    model.generation_config.eos_token_id = None
    seen = assert_greedy_identity(model, engine.drafter, PROMPTS, max_new_tokens=24)
    assert seen.accepted > 0, f"the medusa2 heads on base + their adapter drafted nothing accepted ({seen})"
    plain, _ = load_model(str(tiny_model_dir))
    with pytest.raises(HeadsMismatchError, match=r"adapter .* no adapter"):  # the base alone is not their target
        make_drafter("medusa2", plain, tokenizer, heads=heads)


def test_bench_runs_medusa2_on_base_plus_adapter_and_drift_measures_it(medusa2_run, tiny_model_dir, tmp_path):
    heads = str(medusa2_run[0] / "heads")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "1", "category": "a", "turns": ["the cat sat on the mat"]}\n')
    args = [
        "bench",
        "--model",
        str(tiny_model_dir),
        "--dtype",
        "float32",
        "--prompts",
        str(prompts),
        "--methods",
        "plain,medusa2",
        "--heads",
        f"medusa2={heads}",
        "--max-new-tokens",
        "12",
        "--out",
        str(tmp_path),
    ]
    assert cli(args) == 0
    records = json.loads(next(tmp_path.glob("bench-*.json")).read_text())["records"]
    m2 = [r for r in records if r["method"] == "medusa2"]
    assert m2 and all(r["adapter"] == heads and r["same_as_plain"] is None for r in m2)  # another model than plain's
    assert "medusa2 ran on the model + the LoRA adapter in" in next(tmp_path.glob("bench-*.md")).read_text()
    drift = [
        "drift",
        heads,
        "--model",
        str(tiny_model_dir),
        "--limit",
        "3",
        "--max-new-tokens",
        "8",
        "--out",
        str(tmp_path),
    ]
    assert cli(drift) == 0  # the held-out prompts of the heads' own training run
    result = json.loads(next(tmp_path.glob("drift-*.json")).read_text())
    assert result["summary"]["prompts"] == 3 and result["summary"]["kl_per_token"] > 0
    assert cli(["drift", str(tmp_path / "no-such-adapter")]) == 2  # one line, no traceback


def test_drift_of_an_adapter_that_changes_nothing_is_zero(tiny_model_dir, tmp_path):
    base, _ = load_model(str(tiny_model_dir))
    get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj"])).save_pretrained(tmp_path / "zero")  # B = 0
    engine = Engine.load(str(tiny_model_dir), "float32", adapter=str(tmp_path / "zero"), merge_adapter=False)
    summary = summarize_drift(measure_drift(engine, PROMPTS, max_new_tokens=10))
    assert summary["identical_share"] == 1.0 and summary["kl_per_token"] == pytest.approx(0.0, abs=1e-7)
    assert summary["mean_common_prefix"] == 10.0


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["data.features=somewhere"], "a medusa2 run cannot use a feature cache"),
        (["target.adapter=some/dir"], "a medusa2 run trains its own LoRA on the base model"),
        (["heads.lora.layers=[0, 7]"], "heads.lora.layers [7] out of range: the target has layers 0..1"),
        (["heads.lora.target_modules=[no_such_proj]"], "heads.lora: "),
        (["heads.lora.r=0"], "heads.lora needs r >= 1"),
    ],
)
def test_medusa2_config_errors_in_one_line(tmp_path, tiny_model_dir, capsys, overrides, message):
    cfg = make_cfg(tmp_path, tiny_model_dir, "medusa2")
    args = [
        f"{k}={v}"
        for k, v in (
            ("target.model", tiny_model_dir),
            ("data.path", cfg.data.path),
            ("output_dir", tmp_path / "out"),
            ("heads.kind", "medusa2"),
        )
    ]
    empty = tmp_path / "empty.yaml"
    empty.write_text("{}\n")
    assert train_heads.main(["--config", str(empty), *args, "data.eval_rows=8", *overrides]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("headstart: error")]
    assert len(errors) == 1 and message in errors[0], errors
    assert not (tmp_path / "out" / "heads").exists()
