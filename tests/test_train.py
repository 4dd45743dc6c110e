"""Training on a tiny random Llama: label shift, config errors, pinned losses, kill-and-resume, distillation restart."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from headstart.heads.kinds import KINDS
from headstart.heads.load import load_heads
from headstart.heads.losses import eagle_unroll, head_metrics, medusa_labels
from headstart.heads.masks import unroll_mask
from headstart.runtime.prompts import load_prompts
from headstart.train import heads as train_heads
from headstart.train import recipe
from headstart.train.config import ConfigError, load_config
from headstart.train.data import Row, collate, make_batches
from headstart.train.distill import derived_prompts
from headstart.train.features import target_features
from headstart.train.trainer import lr_lambda
from helpers.models import ACCELERATE_LAUNCH, WORDS
from helpers.pinned import fixed_batch_losses, load_pinned
from helpers.training import make_cfg, write_shards

ROOT = Path(__file__).resolve().parents[1]


def test_medusa_label_shift_by_hand():
    ids = torch.tensor([[10, 11, 12, 13, 14, 15]])
    mask = torch.tensor([[False, False, True, True, True, True]])  # response starts at position 2
    labels, valid = medusa_labels(ids, mask, k=1)
    # head 1 at position t is scored against token t+2: t=0 -> 12, t=1 -> 13, ... t=3 -> 15
    assert labels.tolist() == [[12, 13, 14, 15]] and valid.tolist() == [[True, True, True, True]]
    labels, valid = medusa_labels(ids, mask, k=3)
    assert labels.tolist() == [[14, 15]]  # head 3: token t+4
    mask2 = torch.tensor([[False, False, False, False, True, True]])
    assert medusa_labels(ids, mask2, k=1)[1].tolist() == [[False, False, True, True]]


def test_head_metrics_conditional_acceptance():
    top1 = [torch.tensor([1, 1, 1, 0]).bool(), torch.tensor([1, 0, 1, 1]).bool()]
    m = head_metrics(top1, top1)
    assert m["head_1/acceptance"] == 0.75 and m["head_2/acceptance"] == pytest.approx(2 / 3)
    assert m["acceptance_length"] == pytest.approx(1 + 0.75 + 0.75 * 2 / 3)


def test_unroll_mask_drawn_out():
    """Step 3 of the unrolled EAGLE head, T = 5: row s has its root at s - 2; x = attends."""
    drawn = """
        step 1 step 2 step 3
        .....  .....  x....
        .....  x....  .x...
        x....  .x...  ..x..
        xx...  ..x..  ...x.
        xxx..  ...x.  ....x
    """
    rows = [line.split() for line in drawn.strip().splitlines()[1:]]
    expected = torch.tensor([[c == "x" for c in "".join(row)] for row in rows])
    assert torch.equal(unroll_mask(5, 3), expected)
    assert torch.equal(unroll_mask(5, 1), torch.ones(5, 5, dtype=torch.bool).tril())


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_unroll_matches_drafting_step_by_step(kind):
    """out_k[s] of eagle_unroll = the head run as the drafter runs it: true pairs up to the root
    r = s - k + 1 in its cache, then one call per step on its own previous output (EAGLE-3: step 1 reads
    the three fused target layers, 3H, through fc; later steps its own y)."""
    from transformers import DynamicCache

    from headstart.heads.checkpoint import build_heads
    from helpers.models import tiny_llama

    model = tiny_llama(vocab_size=64, layers=8)
    torch.manual_seed(0)
    head = build_heads(kind, model).eval()
    for p in head.parameters():
        p.data.normal_(0, 0.1)
    T, H = 7, model.config.hidden_size
    features, embeds = torch.randn(1, T, H * len(head.feature_layers)), torch.randn(1, T, H)  # embeds[s]: token s + 1
    with torch.no_grad():
        outs = eagle_unroll(head, features, embeds, 3)
        for k in (1, 2, 3):
            for r in range(T - k + 1):
                cache = DynamicCache()
                out = head(features[:, : r + 1], embeds[:, : r + 1], torch.arange(r + 1)[None], cache=cache)[:, -1:]
                for s in range(r + 1, r + k):  # the k - 1 drafting calls after the root
                    out = head(out, embeds[:, s : s + 1], torch.tensor([[s]]), cache=cache)
                torch.testing.assert_close(outs[k - 1][:, r + k - 1], out[:, 0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_later_unroll_steps_run_only_where_a_scored_chain_passes(kind, monkeypatch):
    """With `scored`, steps 2..3 run packed on the rows a scored row's chain passes through and give the dense
    unroll's values there; the losses and every gradient equal the dense unroll's. Drawn (one row, T = 10, three
    steps; x: scored, o: run only for a later step's chain):

        position   0 1 2 3 4 5 6 7 8 9
        scored     . . . . . x x . . x
        step 2     . . . . o x x . o x
        step 3     . . . . . x x . . x
    """
    from headstart.heads import losses
    from headstart.heads.checkpoint import build_heads
    from helpers.models import tiny_llama

    scored = torch.tensor([[c == "x" for c in ". . . . . x x . . x".split()]])
    assert losses.unrolled_rows(scored, 2, 3).tolist() == [[4, 5, 6, 8, 9]]
    assert losses.unrolled_rows(scored, 3, 3).tolist() == [[5, 6, 9]]

    model = tiny_llama(vocab_size=64, layers=8)
    torch.manual_seed(0)
    head = build_heads(kind, model)
    for p in head.parameters():
        p.data.normal_(0, 0.1)
    B, T, H = 3, 12, model.config.hidden_size
    width = H * len(head.feature_layers) if kind == "eagle3" else H
    features, embeds = torch.randn(B, T, width), torch.randn(B, T, H)
    scored = torch.rand(B, T) < 0.3
    scored[2] = False  # a row with nothing scored: only padding at the later steps
    rows = []
    forward = type(head).forward

    def counted(self, h, *args, **kwargs):
        rows.append(h.shape[1])
        return forward(self, h, *args, **kwargs)

    monkeypatch.setattr(type(head), "forward", counted)
    with torch.no_grad():
        dense = losses.eagle_unroll(head, features, embeds, 3)
        rows.clear()
        packed = losses.eagle_unroll(head, features, embeds, 3, scored)
    assert rows[0] == T and max(rows[1:]) < T  # later steps run on fewer rows than the batch has
    for k, (d, p) in enumerate(zip(dense, packed, strict=True)):
        at = scored.clone()
        at[:, :k] = False  # step k + 1 is read where it has a root
        torch.testing.assert_close(p[at], d[at], rtol=1e-5, atol=1e-6)

    monkeypatch.setattr(type(head), "forward", forward)
    ids = torch.randint(0, 64, (B, T + 1))
    mask = torch.zeros(B, T + 1, dtype=torch.bool)
    mask[:, 4:] = True
    mask[1, 9:] = False  # padding
    embed, readout = model.get_input_embeddings(), model.get_output_embeddings()
    hidden = torch.randn(B, T + 1, width + H) if kind == "eagle3" else torch.randn(B, T + 1, H)

    def loss_and_grads():
        head.zero_grad()
        if kind == "eagle3":
            loss = losses.eagle3_loss(head, hidden, embed, head.logits, readout, ids, mask, 3, fused_width=width)
        else:
            loss, _ = losses.eagle_loss(head, hidden, embed, readout, ids, mask, unroll=3)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in head.parameters() if p.grad is not None]

    loss, grads = loss_and_grads()
    unroll = losses.eagle_unroll
    monkeypatch.setattr(losses, "eagle_unroll", lambda h, f, e, steps, scored=None: unroll(h, f, e, steps))
    dense_loss, dense_grads = loss_and_grads()
    torch.testing.assert_close(loss, dense_loss, rtol=1e-5, atol=1e-6)
    assert len(grads) == len(dense_grads)
    for g, d in zip(grads, dense_grads, strict=True):
        torch.testing.assert_close(g, d, rtol=1e-4, atol=1e-6)


def test_batches_and_loss_mask():
    rows = [Row([1, 2, 3, 4, 5], 2), Row([6, 7, 8], 1), Row(list(range(10, 30)), 5)]
    batches = make_batches(rows, batch_tokens=10, seed=0)
    assert sorted(i for b in batches for i in b) == [0, 1, 2]
    assert all(max(len(rows[i].input_ids) for i in b) * len(b) <= 10 or len(b) == 1 for b in batches)
    b = collate(rows[:2], pad_id=0)
    assert b["input_ids"].tolist() == [[1, 2, 3, 4, 5], [6, 7, 8, 0, 0]]
    assert b["loss_mask"].int().tolist() == [[0, 0, 1, 1, 1], [0, 1, 1, 0, 0]]


def test_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "none.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("optim:\n  lrr: 0.1\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'optim\.lrr'"):
        load_config(bad)
    with pytest.raises(ConfigError, match=r"'optim\.max_steps' must be int"):
        load_config(None, ["optim.max_steps=abc"])
    with pytest.raises(ConfigError, match=r"override 'optim\.betas=\[0\.8': not valid YAML"):
        load_config(None, ["optim.betas=[0.8"])
    cfg = load_config(None, ["optim.lr=3e-4", "heads.kind=eagle", "optim.betas=[0.8, 0.9]"])
    assert cfg.optim.lr == 3e-4 and cfg.heads.kind == "eagle" and cfg.optim.betas == (0.8, 0.9)
    # YAML 1.1 would read `no` as False: Accelerate's "no" (mixed precision off), in a file and as an override
    (tmp_path / "mp.yaml").write_text("mixed_precision: no\n")
    assert load_config(tmp_path / "mp.yaml").mixed_precision == "no"
    assert load_config(None, ["mixed_precision=no"]).mixed_precision == "no"
    assert load_config(None, ["mixed_precision=bf16", "report_to=none"]).mixed_precision == "bf16"
    # `key=` empties a string (it was refused: "'heads.init_from' must be str, got None")
    cfg = load_config(ROOT / "configs" / "smollm2-135m-eagle3-continue.yaml", ["heads.init_from=", "data.features="])
    assert cfg.heads.init_from == "" and cfg.data.features == ""


def test_cli_errors(tmp_path, capsys, tiny_model_dir):
    assert train_heads.main(["--config", str(tmp_path / "missing.yaml")]) == 2
    assert "config file not found" in capsys.readouterr().err
    blocker = tmp_path / "file"
    blocker.write_text("")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"output_dir: {blocker}/sub\n")
    assert train_heads.main(["--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "data.path is required" in err and err.count("\n") == 1  # no cwd-relative default
    cfg.write_text(f"output_dir: {blocker}/sub\ndata:\n  path: {tmp_path}\n")
    assert train_heads.main(["--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "is not writable" in err and err.count("\n") == 1
    smoke = str(ROOT / "configs" / "smoke.yaml")
    assert train_heads.main(["--config", smoke, "heads.kind=eagle", "heads.unroll=0"]) == 2
    assert "heads.unroll must be >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["medusa", "eagle"])
def test_training_reduces_loss_and_saves_heads(tmp_path, tiny_model_dir, kind):
    unroll = {"heads.unroll": 3, "heads.unroll_from_step": 4} if kind == "eagle" else {}  # eagle: 1 step, then 3
    cfg = make_cfg(tmp_path, tiny_model_dir, kind, **{"optim.max_steps": 12}, **unroll)
    metrics = recipe.run(cfg)[kind]
    lines = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    losses = [x["train/loss"] for x in lines]
    assert losses[-1] < losses[0]
    assert {"head_1/top1", "head_1/top5", "head_1/acceptance", "acceptance_length"} <= set(metrics)
    from headstart.runtime.models import load_model

    model, tok = load_model(str(tiny_model_dir))
    _, config = load_heads(tmp_path / "out" / "heads", model, tok)
    assert config.kind == kind and config.extra["steps"] == 12 and config.extra["metrics"] == metrics


def test_a_heldout_folder_is_scored_never_trained_and_the_best_heads_are_kept(tmp_path, tiny_model_dir):
    """data.heldout: its rows are the evaluation rows and their ids leave training even where a training source
    holds them too; out/best keeps the heads of the best held-out acceptance; save_dtype sets the saved weights."""
    data, heldout = tmp_path / "data", tmp_path / "heldout"
    write_shards(data, n_rows=40)
    rows = [json.loads(x) for x in (data / "shard-00000.jsonl").read_text().splitlines()]
    heldout.mkdir()
    (heldout / "shard-00000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:6]))  # ids 0..5
    cfg = make_cfg(
        tmp_path, tiny_model_dir, "medusa", **{"data.heldout": heldout, "save_dtype": "float32", "heads.kind": "medusa"}
    )
    seen = {}
    original = recipe.Trainer.__init__

    def spy(self, *args, **kwargs):
        original(self, *args, **kwargs)
        seen["train"], seen["eval"] = {r.id for r in self.train_rows}, [r.id for r in self.eval_rows]
        seen["index"] = sorted(r.index for r in self.train_rows + self.eval_rows)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(recipe.Trainer, "__init__", spy)
        recipe.run(cfg)
    assert seen["eval"] == [str(i) for i in range(6)]
    assert seen["train"] == {str(i) for i in range(6, 40)}
    assert seen["index"] == list(range(40))  # every row's index is its place: the feature cache's key
    lines = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    scored = [x["acceptance_length"] for x in lines if "acceptance_length" in x]
    best = json.loads((tmp_path / "out" / "best" / "config.json").read_text())
    assert best["metrics"]["acceptance_length"] == max(scored)
    assert best["eval_rows"] == 6 and best["dtype"] == "float32"
    assert load_file(tmp_path / "out" / "heads" / "model.safetensors")["blocks.0.linear.weight"].dtype == torch.float32


@pytest.mark.parametrize(
    ("config", "launcher", "expected"), [("", "bf16", "bf16"), ("no", "bf16", "no"), ("", None, "no")]
)
def test_the_launch_configs_mixed_precision_is_honoured(tmp_path, monkeypatch, config, launcher, expected):
    """configs/accelerate/*.yaml say bf16 (`accelerate launch` passes it in the environment): a run config that
    does not set mixed_precision takes it; one that does overrides it."""
    from accelerate.state import AcceleratorState

    if launcher is None:
        monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    else:
        monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", launcher)
    AcceleratorState._reset_state(reset_partial_state=True)
    cfg = load_config(None, [f"mixed_precision={config}" if config else "seed=0"])
    try:
        assert recipe.make_accelerator(cfg, None, tmp_path).mixed_precision == expected
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


def test_saved_heads_name_no_home_folder(monkeypatch, tmp_path):
    """Paths under the home folder in the training section of a heads config are written ~/...: shipped heads name
    no folder of the machine that trained them."""
    from headstart.train.config import config_to_dict, portable

    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = load_config(None, [f"output_dir={tmp_path}/runs/x", f"data.sources=[{tmp_path}/a, ../shared/b]"])
    saved = portable(config_to_dict(cfg))
    assert saved["output_dir"] == "~/runs/x" and saved["data"]["sources"] == ["~/a", "../shared/b"]


def test_a_constant_schedule_holds_the_peak_after_warmup():
    cfg = load_config(None, ["optim.warmup_steps=4", "optim.max_steps=100", "optim.schedule=constant"])
    factor = lr_lambda(cfg)
    assert [factor(s) for s in (0, 3, 4, 50, 99)] == [0.25, 1.0, 1.0, 1.0, 1.0]
    cfg = load_config(None, ["optim.warmup_steps=4", "optim.max_steps=100"])
    assert lr_lambda(cfg)(99) < 0.11  # the default decays to 10 %
    with pytest.raises(ConfigError, match=r"optim\.schedule"):
        recipe.run(load_config(None, ["optim.schedule=linear", "output_dir=x", "data.path=y"]))


@pytest.mark.parametrize("kind", ["eagle", "medusa2"])  # eagle: feature noise draws from the RNG; medusa2: its LoRA
def test_kill_and_resume_gives_the_same_weights(tmp_path, tiny_model_dir, monkeypatch, kind):
    lora = {"heads.lora.r": 4, "heads.lora.lr": 0.01} if kind == "medusa2" else {}
    whole = make_cfg(tmp_path / "a", tiny_model_dir, kind, **lora)
    recipe.run(whole)
    files = ("model.safetensors", "adapter_model.safetensors")[: 2 if kind == "medusa2" else 1]
    expected = {f: load_file(tmp_path / "a" / "out" / "heads" / f) for f in files}

    cfg = make_cfg(tmp_path / "b", tiny_model_dir, kind, **lora)
    original = recipe.Trainer.loss

    def die_in_step_5(self, batch, step=0):
        if step == 4:
            raise KeyboardInterrupt  # killed in step 5: step 4 is logged, the last checkpoint is step 3's
        return original(self, batch, step)

    monkeypatch.setattr(recipe.Trainer, "loss", die_in_step_5)
    with pytest.raises(KeyboardInterrupt):
        recipe.run(cfg)
    monkeypatch.setattr(recipe.Trainer, "loss", original)
    assert not (tmp_path / "b" / "out" / "heads").exists()
    recipe.run(cfg)  # the same command again: resumes at step 3, step 4's log line replaced
    steps = [json.loads(x)["step"] for x in (tmp_path / "b" / "out" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]  # steps 1-3 ran once: the second run resumed, it did not start over
    for f in files:
        resumed = load_file(tmp_path / "b" / "out" / "heads" / f)
        for name in expected[f]:
            assert torch.equal(expected[f][name], resumed[name]), name


def test_training_by_cpu_seconds_scores_on_the_way_and_stops_at_its_budget(tmp_path, tiny_model_dir, monkeypatch):
    """`cpu_s` counts training's CPU-seconds, evaluation excluded: every record carries it, the first held-out rows
    are scored at each eval_every_cpu_s mark, and a run stops (checkpoint, full evaluation, heads) at max_cpu_s."""
    from headstart.train import trainer as trainer_module

    clock = [0.0]  # a fake process CPU clock: a step spends 100 s, an evaluation 1,000
    monkeypatch.setattr(trainer_module.time, "process_time", lambda: clock[0])
    loss, evaluate = recipe.Trainer.loss, recipe.Trainer.evaluate

    def step_loss(self, batch, step=0):
        clock[0] += 100.0
        return loss(self, batch, step)

    def scored(self, rows=None):
        clock[0] += 1000.0
        return {**evaluate(self, rows), "rows": len(self.eval_rows if rows is None else rows)}

    monkeypatch.setattr(recipe.Trainer, "loss", step_loss)
    monkeypatch.setattr(recipe.Trainer, "evaluate", scored)
    options = {"eval_every_cpu_s": 250, "eval_quick_rows": 3, "max_cpu_s": 450, "optim.max_steps": 100}
    recipe.run(make_cfg(tmp_path, tiny_model_dir, "eagle", **options))
    out = tmp_path / "out"
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["cpu_s"]) for r in records] == [(1, 100), (2, 200), (3, 300), (4, 400), (5, 500)]
    assert [r["step"] for r in records if "quick/acceptance_length" in r] == [3]  # the 250 mark; 500 is the end
    assert records[2]["quick/rows"] == 3 and records[2]["rows"] == records[4]["rows"] == 8  # eval_every 3, the end
    assert json.loads((out / "checkpoints" / "step-0000005" / "trainer.json").read_text()) == {"step": 5, "cpu_s": 500}
    assert json.loads((out / "heads" / "config.json").read_text())["steps"] == 5


def test_step_time_times_each_part_of_a_step_and_fills_a_cache(tmp_path, tiny_model_dir, capsys):
    """`python -m headstart.train.step_time`: each step's parts and their medians; with a feature cache, a second run
    reads back the batches the first computed (its features part then does not run the target)."""
    from headstart.train import step_time

    write_shards(tmp_path / "data")
    base = ["--config", str(tmp_path / "c.yaml"), "--steps", "3"]
    (tmp_path / "c.yaml").write_text(
        f"target: {{model: {tiny_model_dir}}}\nheads: {{kind: eagle3, unroll: 2}}\n"
        f"data: {{path: {tmp_path / 'data'}, eval_rows: 8, batch_tokens: 128, features: {tmp_path / 'f'}}}\n"
    )
    assert step_time.main(base) == 0
    first = capsys.readouterr().out
    assert sum(line.startswith("step ") for line in first.splitlines()) == 3
    assert "medians: features" in first and "% of the tokens scored" in first
    assert list((tmp_path / "f").glob("features-*.safetensors"))  # what the first run computed, kept
    assert step_time.main(base) == 0 and step_time.main([*base[:2], "--steps", "2"]) == 2


def test_the_recipe_ab_trains_both_for_the_same_cpu_seconds_and_draws_them(tmp_path, tiny_model_dir):
    """`python -m headstart.train.ab`: two recipes of one config, each to the CPU budget, scored on the way and at
    the end, each with its own overrides, and one figure of both against CPU-seconds."""
    import sys

    from headstart.train import ab

    write_shards(tmp_path / "data")
    config = tmp_path / "ab.yaml"
    config.write_text(
        f"target: {{model: {tiny_model_dir}}}\nheads: {{kind: eagle, num_heads: 2}}\n"
        f"data: {{path: {tmp_path / 'data'}, eval_rows: 8, batch_tokens: 128}}\n"
        "optim: {max_steps: 100000, warmup_steps: 2}\nlog_every: 1\neval_every: 100000\nsave_every: 100000\n"
        "eval_quick_rows: 4\nreport_to: none\n"
    )
    out = tmp_path / "ab"
    argv = ["--config", str(config), "--cpu-s", "2", "--every", "0.5", "--b", "optim.lr=0.03 heads.unroll=2"]
    assert ab.main([*argv, "--out", str(out), "--launch", sys.executable, "seed=3"]) == 0
    for name in ab.RECIPES:
        records = [json.loads(x) for x in (out / name / "metrics.jsonl").read_text().splitlines()]
        assert records[-1]["cpu_s"] >= 2 > records[-2]["cpu_s"] and "acceptance_length" in records[-1]
        assert any("quick/acceptance_length" in r for r in records[:-1])
        used = json.loads((out / name / "config.json").read_text())
        assert used["seed"] == 3 and used["optim"]["lr"] == (0.03 if name == "b" else 1e-3)
    assert (out / "ab.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert ab.main([*argv, "--out", str(out), "--cpu-s", "0"]) == 2
    assert ab.main([*argv, "--out", str(out), "--launch", "no-such-launcher"]) == 2  # a clear line, no traceback


@pytest.mark.parametrize("kind", ["eagle", "medusa2"])
def test_a_checkpoint_written_before_the_recipe_split_resumes_after_it(tmp_path, tiny_model_dir, kind):
    """tests/data/presplit/KIND: step 3 of the kill-and-resume run above, written by train/heads.py as it was
    before the Trainer, the warm starts and the recipe left it (Accelerate's state files as they were saved).
    The recipe now resumes it at step 3 and ends with the weights of a run that was never stopped: bit for bit on
    the CPU kind that wrote it (an AMD EPYC), within one bfloat16 step elsewhere, where the unstopped run's first 3
    steps round differently (on an Intel Xeon: 6 of 16 tensors one step apart, e.g. 4.9e-4 at 0.12)."""
    lora = {"heads.lora.r": 4, "heads.lora.lr": 0.01} if kind == "medusa2" else {}
    recipe.run(make_cfg(tmp_path / "a", tiny_model_dir, kind, **lora))
    cfg = make_cfg(tmp_path / "b", tiny_model_dir, kind, **lora)
    shutil.copytree(Path(__file__).parent / "data" / "presplit" / kind, tmp_path / "b" / "out")
    recipe.run(cfg)
    steps = [json.loads(x)["step"] for x in (tmp_path / "b" / "out" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]  # 1-3 from before the split (its step 4 line dropped), 4-6 resumed
    files = ("model.safetensors", "adapter_model.safetensors")[: 2 if kind == "medusa2" else 1]
    for f in files:
        expected, resumed = (load_file(tmp_path / run / "out" / "heads" / f) for run in "ab")
        assert expected.keys() == resumed.keys()
        for name in expected:  # one bfloat16 step: 2**-7 of the value at most (a floor for values near 0)
            torch.testing.assert_close(resumed[name], expected[name], rtol=2**-7, atol=1e-6, msg=name)


def test_init_from_trained_heads_keeps_weights_not_vocabulary(tmp_path, tiny_model_dir):
    from accelerate import Accelerator

    from headstart.train.data import load_rows

    recipe.run(make_cfg(tmp_path / "a", tiny_model_dir, "eagle", **{"heads.draft_vocab": 8}))
    trained = tmp_path / "a" / "out" / "heads"
    cfg = make_cfg(tmp_path / "b", tiny_model_dir, "eagle", **{"heads.draft_vocab": 12, "heads.init_from": trained})
    model, tokenizer = recipe.load_target(cfg)
    rows = load_rows(cfg.data.path, cfg.data.max_len)
    warm = recipe.Trainer(cfg, Accelerator(cpu=True), model, tokenizer, rows).heads.state_dict()
    saved = load_file(trained / "model.safetensors")
    assert set(warm) == set(saved) and warm["draft_vocab"].shape == (12,)  # recomputed for this run
    for name in set(saved) - {"draft_vocab"}:
        assert torch.equal(warm[name], saved[name].float()), name  # bf16 on disk: exact in float32
    recipe.run(cfg)
    lines = [json.loads(x) for x in (tmp_path / "b" / "out" / "metrics.jsonl").read_text().splitlines()]
    assert lines[0]["step"] == 0 and "acceptance_length" in lines[0]  # the trained heads on this run's held-out rows
    assert [x["step"] for x in lines] == list(range(7))
    _, config = load_heads(tmp_path / "b" / "out" / "heads", model, tokenizer)
    assert config.extra["init_from"] == {"path": str(trained), "steps": 6, "data_rows": config.extra["data_rows"]}
    recipe.run(make_cfg(tmp_path / "medusa", tiny_model_dir, "medusa"))
    medusa = tmp_path / "medusa" / "out" / "heads"
    for bad, message in [(tmp_path, "is not a heads checkpoint"), (medusa, "other heads")]:
        wrong = make_cfg(tmp_path / "b", tiny_model_dir, "eagle", **{"heads.init_from": bad})
        with pytest.raises(ConfigError, match=message):
            recipe.Trainer(wrong, Accelerator(cpu=True), model, tokenizer, rows)


def test_init_from_an_eagle3_head_moves_its_lm_head_rows_with_their_tokens(tmp_path, tiny_model_dir):
    from accelerate import Accelerator

    from headstart.train.data import load_rows

    recipe.run(make_cfg(tmp_path / "a", tiny_model_dir, "eagle3", **{"heads.draft_vocab": 8}))
    trained = tmp_path / "a" / "out" / "heads"
    saved = load_file(trained / "model.safetensors")
    cfg = make_cfg(tmp_path / "b", tiny_model_dir, "eagle3", **{"heads.draft_vocab": 12, "heads.init_from": trained})
    model, tokenizer = recipe.load_target(cfg)
    rows = load_rows(cfg.data.path, cfg.data.max_len)
    warm = recipe.Trainer(cfg, Accelerator(cpu=True), model, tokenizer, rows).heads.state_dict()
    assert warm["draft_vocab"].shape == (12,) and warm["lm_head.weight"].shape[0] == 12  # recomputed, grown
    old_row = {int(t): i for i, t in enumerate(saved["draft_vocab"])}
    target_rows = model.get_output_embeddings().weight.float()
    carried = 0
    for i, token in enumerate(warm["draft_vocab"].tolist()):
        if token in old_row:  # a token both vocabularies hold: its trained row, whatever its new place
            assert torch.equal(warm["lm_head.weight"][i], saved["lm_head.weight"][old_row[token]].float()), token
            carried += 1
        else:  # a new token: the target's row, as a fresh head starts
            assert torch.equal(warm["lm_head.weight"][i], target_rows[token]), token
    assert 0 < carried < 12
    for name in set(saved) - {"draft_vocab", "lm_head.weight"}:
        assert torch.equal(warm[name], saved[name].float()), name
    # heads.keep_vocab: the trained vocabulary as it is, in its order, every row carried
    keep = {"heads.draft_vocab": 8, "heads.init_from": trained, "heads.keep_vocab": True}
    kept = make_cfg(tmp_path / "c", tiny_model_dir, "eagle3", **keep)
    warm = recipe.Trainer(kept, Accelerator(cpu=True), model, tokenizer, rows).heads.state_dict()
    assert torch.equal(warm["draft_vocab"], saved["draft_vocab"])
    assert torch.equal(warm["lm_head.weight"], saved["lm_head.weight"].float())
    wrong = make_cfg(tmp_path / "c", tiny_model_dir, "eagle3", **{**keep, "heads.draft_vocab": 12})
    with pytest.raises(ConfigError, match="drafts 8 tokens"):
        recipe.Trainer(wrong, Accelerator(cpu=True), model, tokenizer, rows)
    kept.heads.init_from = ""
    with pytest.raises(ConfigError, match="which is not set"):
        recipe.run(kept)


def test_training_prompts_skip_malformed_lines_and_keep_permissive_rows(tmp_path, capsys):
    # distillation's kill-and-resume is tests/test_sources.py's, for both backends
    prompts_file = tmp_path / "prompts.jsonl"
    rows = [{"id": f"p{i}", "turns": [f"the cat {i % 3}"], "permissive": i % 4 != 0} for i in range(12)]
    lines = [json.dumps(r) for r in rows]
    lines.insert(5, "{broken")
    prompts_file.write_text("\n".join(lines) + "\n")
    prompts = load_prompts(prompts_file, permissive_only=True, skip_malformed=True)
    assert "skipped 1 malformed line" in capsys.readouterr().err
    assert [p.id for p in prompts] == [f"p{i}" for i in range(12) if i % 4 != 0]


def _rows_in_two_shards(path: Path, rows: list[dict], split: int) -> None:
    (path / "shard-00000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:split]))
    (path / "shard-00001.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[split:]))


def test_summary_prompts_over_earlier_answers(tmp_path):
    from helpers.models import tiny_tokenizer

    tok = tiny_tokenizer()
    long = [WORDS.index("cat"), WORDS.index("sat")] * 40  # 80 tokens: long enough to summarise
    rows = [
        {"id": "a", "category": "qa", "response_ids": [*long, 1]},
        {"id": "b", "category": "code", "response_ids": long},  # code: skipped
        {"id": "c", "category": "chat", "response_ids": long[:79]},  # too short
        {"id": "summary:a", "category": "summarization", "response_ids": long},  # a derived row: skipped
        {"id": "d", "category": "math", "response_ids": long},
        {"id": "e", "category": "chat", "response_ids": long},
    ]
    _rows_in_two_shards(tmp_path, rows, 3)
    prompts = derived_prompts("summary", tmp_path, tok, limit=2)
    assert [p.id for p in prompts] == ["summary:a", "summary:d"]
    assert {p.category for p in prompts} == {"summarization"}
    assert prompts[0].text == "Summarize the following text in two or three sentences.\n\n" + " ".join(["cat sat"] * 40)
    assert len(derived_prompts("summary", tmp_path, tok, limit=10)) == 3
    _rows_in_two_shards(tmp_path, rows[1:4], 1)
    with pytest.raises(ValueError, match=r"no answer .* usable for the summary task"):
        derived_prompts("summary", tmp_path, tok, limit=10)
    with pytest.raises(ValueError, match="no distilled shards"):
        derived_prompts("summary", tmp_path / "none", tok, limit=10)


class _Words:
    """decode(): the row's ids index this vocabulary of whole words."""

    vocab = ("<eos>", ".", "\n", "The", "cat", "sat", "on", "the", "mat", "and", "slept")
    vocab += ("Die", "Katze", "sitzt", "auf", "der", "und", "ist")

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return " ".join(self.vocab[i] for i in ids if i > 0).replace(" .", ".").replace(" \n ", "\n")


def test_translation_prompts_over_earlier_answers(tmp_path):
    w = {word: i for i, word in enumerate(_Words.vocab)}
    english = [w[x] for x in ["The", "cat", "sat", "on", "the", "mat", ".", "The", "cat", "slept"]]
    german = [w[x] for x in ["Die", "Katze", "sitzt", "auf", "der", "mat", "und", "ist"]]
    rows = [
        {"id": "a", "category": "chat", "response_ids": [*english, w["\n"], *english, 0]},
        {"id": "b", "category": "chat", "response_ids": english[:5]},  # fewer than 6 words: skipped
        {"id": "to-german:a", "category": "translation", "response_ids": [*german, w["\n"], *english]},
        {"id": "to-german:x", "category": "translation", "response_ids": english},  # not German: skipped
    ]
    _rows_in_two_shards(tmp_path, rows, 2)
    (to_german,) = derived_prompts("to-german", tmp_path, _Words(), limit=10)  # derived rows are never sources
    assert to_german.id == "to-german:a" and to_german.category == "translation"
    assert "German" in to_german.text and to_german.text.endswith("The cat sat on the mat. The cat slept")  # line 1
    (from_german,) = derived_prompts("from-german", tmp_path, _Words(), limit=10)
    assert from_german.id == "from-german:to-german:a" and "English" in from_german.text
    assert from_german.text.endswith("Die Katze sitzt auf der mat und ist")  # its first line only


PINNED = load_pinned()


@pytest.mark.parametrize("kind", list(PINNED))
def test_fixed_batch_losses_are_pinned(kind):
    """Five AdamW steps on one fixed batch; regenerate tests/pinned_losses.json only for a deliberate change of
    the loss (`make pinned`)."""
    losses = fixed_batch_losses(kind)
    assert losses[-1] < losses[0]
    assert losses == pytest.approx(PINNED[kind], rel=1e-4)


FSDP = ["--config_file", str(ROOT / "configs" / "accelerate" / "fsdp.yaml"), "--mixed_precision", "no"]
DEEPSPEED = ["--config_file", str(ROOT / "configs" / "accelerate" / "deepspeed_zero2.yaml"), "--mixed_precision", "no"]


def launch_training(tmp_path, launch: list[str], processes: int, options: list[str]):
    """`accelerate launch` (with the options `launch`) of train/heads.py over `processes` CPU processes of one
    thread each, every key from the command line (`options`); returns the finished process."""
    import socket
    import subprocess

    empty = tmp_path / "empty.yaml"
    empty.write_text("# every key comes from the command line\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        *ACCELERATE_LAUNCH,
        *launch,
        "--num_processes",
        str(processes),
        "--main_process_port",
        str(port),
        str(ROOT / "train" / "heads.py"),
        "--config",
        str(empty),
        *options,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})


def two_processes_against_one(tmp_path, model_dir, heads: list[str], two: list[str]) -> str:
    """`accelerate launch` of 2 CPU processes (gloo) with the options `two`, against 1 process with the same global
    batch (2 accumulated micro-batches): the same loss curve and the same final weights. Returns the 2 processes'
    stderr."""
    write_shards(tmp_path / "data", n_rows=48)
    common = [
        *heads,
        f"target.model={model_dir}",
        "heads.num_heads=2",
        f"data.path={tmp_path / 'data'}",
        "data.eval_rows=8",
        "data.batch_tokens=96",
        "optim.max_steps=4",
        "log_every=1",
        "eval_every=4",
        "save_every=4",
        "report_to=none",
    ]
    runs = {"two": (two, 2, []), "one": ([], 1, ["optim.grad_accum=2"])}
    stderr = {}
    for name, (launch, processes, extra) in runs.items():
        options = [option.replace("{run}", name) for option in common]  # "{run}": a path of each run's own
        proc = launch_training(tmp_path, launch, processes, [*options, *extra, f"output_dir={tmp_path / name}"])
        assert proc.returncode == 0, proc.stderr[-3000:]
        stderr[name] = proc.stderr
    losses = {
        name: [json.loads(x).get("train/loss") for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        for name in runs
    }
    assert len(losses["one"]) == 4 and losses["two"] == pytest.approx(losses["one"], rel=1e-4)
    for weights in ("model.safetensors", "adapter_model.safetensors"):  # the heads; Medusa-2's LoRA
        if not (tmp_path / "one" / "heads" / weights).is_file():
            continue
        a = load_file(tmp_path / "one" / "heads" / weights)
        b = load_file(tmp_path / "two" / "heads" / weights)
        assert a.keys() == b.keys()  # the whole heads, not a shard of them
        for name in a:
            assert a[name].shape == b[name].shape
            torch.testing.assert_close(a[name].float(), b[name].float(), atol=1e-2, rtol=1e-2)
    return stderr["two"]


@pytest.mark.parametrize(
    "heads",
    [
        ["heads.kind=medusa"],
        ["heads.kind=eagle", "heads.unroll=2", "heads.feature_noise=0"],  # noise: per-rank RNG
        ["heads.kind=eagle3", "heads.unroll=2"],
        ["heads.kind=medusa2", "heads.lora.r=4", "heads.lora.lr=0.01"],  # the LoRA trains too: DDP over both
    ],
    ids=["medusa", "eagle-unroll2", "eagle3-unroll2", "medusa2"],  # several head forwards before one backward
)
def test_two_process_ddp_matches_one_process(tmp_path, tiny_model_dir, heads):
    two_processes_against_one(tmp_path, tiny_model_dir, heads, ["--multi_gpu"])
    if "medusa2" in heads[0]:
        lora = load_file(tmp_path / "one" / "heads" / "adapter_model.safetensors")
        assert any("lora_B" in k and v.abs().max() > 0 for k, v in lora.items())  # it did train


@pytest.mark.parametrize(
    "heads",
    [
        ["heads.kind=medusa"],
        ["heads.kind=eagle", "heads.unroll=2", "heads.feature_noise=0"],
        ["heads.kind=eagle3", "heads.unroll=2", "data.features=FEATURES-{run}"],  # the cache pass, sharded
    ],
    ids=["medusa", "eagle-unroll2", "eagle3-unroll2-feature-cache"],
)
def test_fsdp_launch_shards_the_target_and_matches_one_process(tmp_path, tiny_model_dir, heads):
    """configs/accelerate/fsdp.yaml with 2 CPU processes: each holds half of every decoder layer of the frozen
    target (FSDP2 `fully_shard`; on CPUs Accelerate trains the heads as under DDP), and the run equals 1 process."""
    heads = [h.replace("FEATURES", str(tmp_path / "features")) for h in heads]
    stderr = two_processes_against_one(tmp_path, tiny_model_dir, heads, FSDP)
    # "headstart: process R of 2 holds H of the target's T decoder-layer weights", once per process (the two
    # processes write at once: their lines may run together on one)
    shares = re.findall(r"process \d of 2 holds (\d+) of the target's (\d+) decoder-layer weights", stderr)
    assert len(shares) == 2, stderr[-2000:]
    for held, total in shares:
        assert int(held) == int(total) // 2, shares


def test_fsdp_launch_refuses_medusa2_in_one_line(tmp_path, tiny_model_dir):
    """Medusa-2 trains a LoRA inside the target, which an FSDP launch would shard: refused before any training."""
    write_shards(tmp_path / "data", n_rows=16)
    options = [
        "heads.kind=medusa2",
        f"target.model={tiny_model_dir}",
        f"data.path={tmp_path / 'data'}",
        f"output_dir={tmp_path / 'out'}",
        "report_to=none",
    ]
    proc = launch_training(tmp_path, FSDP, 2, options)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("headstart: error")]
    assert proc.returncode != 0 and errors, proc.stderr[-2000:]
    assert "medusa2 trains a LoRA inside the target, which an FSDP launch would shard" in errors[0]
    assert not (tmp_path / "out" / "checkpoints").exists()


@pytest.mark.parametrize(
    "heads",
    [
        ["heads.kind=medusa"],
        ["heads.kind=medusa2", "heads.lora.r=4", "heads.lora.lr=0.01"],
    ],
    ids=["medusa", "medusa2"],  # ZeRO-2 splits optimizer state, whatever the kind: heads alone, heads + a LoRA
)
def test_deepspeed_zero2_launch_matches_one_process(tmp_path, tiny_model_dir, heads):
    """configs/accelerate/deepspeed_zero2.yaml with 2 CPU processes (DeepSpeed's CPU accelerator over gloo): ZeRO-2
    splits the optimizer state between them, and the run equals 1 process with the same global batch."""
    two_processes_against_one(tmp_path, tiny_model_dir, heads, DEEPSPEED)
    states = tmp_path / "two" / "checkpoints" / "step-0000004" / "pytorch_model"
    if heads[0] == "heads.kind=medusa":  # accumulation is refused in one line (DeepSpeed steps at every backward)
        options = [
            f"target.model={tiny_model_dir}",
            f"data.path={tmp_path / 'data'}",
            f"output_dir={tmp_path / 'accum'}",
            "optim.grad_accum=2",
        ]
        proc = launch_training(tmp_path, DEEPSPEED, 1, options)
        assert proc.returncode != 0 and "optim.grad_accum: a DeepSpeed launch takes 1, not 2" in proc.stderr
    assert sorted(p.name for p in states.glob("zero_pp_rank_*_optim_states.pt")) == [
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt",
    ]


def test_report_png(tmp_path, capsys):
    from headstart.cli import main

    for name, slope in (("a", 0.1), ("b", 0.2)):
        run = tmp_path / name
        run.mkdir()
        head = {"head_1/acceptance": 0.5, "head_2/top1": 0.1, "head_2/acceptance": 0.3, "acceptance_length": 1.5}
        rows = [{"step": s, "train/loss": 5 - slope * s, "head_1/top1": slope * s / 10, **head} for s in (1, 2, 3)]
        rows += [{"step": 4, "cpu_s": 40.0, "quick/acceptance_length": 1.6}]  # scored on the way, by CPU-seconds
        (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = tmp_path / "report.png"
    for x in ("step", "cpu_s"):
        assert main(["report", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(out), "--x", x]) == 0
        assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    assert main(["report", str(tmp_path / "nothing")]) == 2
    assert "holds no metrics.jsonl" in capsys.readouterr().err


def test_every_checked_in_config_loads_and_shows_its_launch_command():
    configs = sorted((ROOT / "configs").glob("*.yaml"))
    assert configs
    for path in configs:
        cfg = load_config(path)
        assert "accelerate launch train/heads.py --config configs/" + path.name in path.read_text(), path
        assert all(k in KINDS for k in cfg.heads.kind.split(","))


@pytest.mark.parametrize("kind", ["medusa", "eagle"])
def test_cached_features_give_the_live_losses(tmp_path, tiny_model_dir, kind):
    """data.features: the cached target features train exactly like running the target every step."""
    from headstart.train.data import load_rows
    from headstart.train.features import FeatureCache

    live = make_cfg(tmp_path, tiny_model_dir, kind)
    cached = make_cfg(tmp_path, tiny_model_dir, kind, **{"data.features": str(tmp_path / "features")})
    model, tokenizer = recipe.load_target(live)
    rows = load_rows(live.data.path, live.data.max_len)

    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    a = recipe.Trainer(live, acc, model, tokenizer, rows)
    b = recipe.Trainer(cached, acc, model, tokenizer, rows)
    b.heads.load_state_dict(a.heads.state_dict())  # the same initial heads
    # the cache fills as training goes: nothing is computed before the first step, each batch keeps its rows, a
    # checkpoint writes them (a later run reads them), and a batch read back trains as the live one did
    assert b.features.missing() == list(range(len(rows)))
    seen: list[int] = []
    for epoch in range(2):
        for index in range(3):
            batch = a.micro_batch(index)
            assert torch.equal(batch["input_ids"], b.micro_batch(index)["input_ids"])
            assert b.features.holds(batch["row_index"].tolist()) == (epoch == 1)
            torch.manual_seed(index)  # EAGLE's feature noise
            live_loss = a.loss(batch)
            torch.manual_seed(index)
            cached_loss = b.loss(batch)
            torch.testing.assert_close(cached_loss, live_loss, rtol=1e-5, atol=1e-6)
            seen += batch["row_index"].tolist()
        if epoch == 0:
            key = json.loads(b.features.key)
            assert FeatureCache(tmp_path / "features", rows, key).missing() == list(range(len(rows)))  # not written
            b.save_checkpoint(1)
            b.features = FeatureCache(tmp_path / "features", rows, key, b.layers)  # a later run: read from its file
    assert b.features.missing() == sorted(set(range(len(rows))) - set(seen)) != []
    b.features.build(model, 0, 128)

    # a second run reuses every entry; a row whose tokens changed is computed again, the others are kept; new rows
    # (another source) are the only ones computed; a truncated file is ignored
    cache = FeatureCache(tmp_path / "features", rows, {"target": "tiny"})
    assert cache.missing() == list(range(len(rows)))  # another target key: nothing matches
    assert FeatureCache(tmp_path / "features", rows, key).missing() == []
    changed = [r if r.index else Row(r.input_ids[:-1], r.n_prompt, 0, r.id) for r in rows]
    assert FeatureCache(tmp_path / "features", changed, key).missing() == [0]
    more = [*rows, Row([3, 4, 5, 6], 2, len(rows), "new")]
    grown = FeatureCache(tmp_path / "features", more, key, b.layers)
    assert grown.missing() == [len(rows)] and grown.build(model, 0, 128) == 1
    grown.scan()
    assert grown.missing() == [] and len(list((tmp_path / "features").glob("*.safetensors"))) == 3
    torch.testing.assert_close(
        grown.batch([len(rows)], 4)[0].float(),
        target_features(model, torch.tensor([[3, 4, 5, 6]]), torch.ones(1, 4), b.layers)[0].float(),
    )
    first = sorted((tmp_path / "features").glob("*.safetensors"), key=lambda p: p.stat().st_mtime)[0]
    first.write_bytes(b"truncated")  # the file the first epoch's checkpoint wrote
    assert FeatureCache(tmp_path / "features", more, key).missing() == sorted(set(seen))
    blocked = make_cfg(tmp_path, tiny_model_dir, kind, **{"data.features": str(tmp_path / "features" / "x" / "y")})
    (tmp_path / "features" / "x").write_text("")  # a file where the cache folder should be
    with pytest.raises(ConfigError, match="is not writable"):
        recipe.Trainer(blocked, acc, model, tokenizer, rows)
