"""Distilled data that survives: manifests, several sources read as one, held-out prompts, resumption, and the
batched distillation's rows equal to transformers' `generate` rows (train/sources.py, train/distill.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from headstart.runtime.models import load_model
from headstart.runtime.prompts import load_prompts
from headstart.train import heads as train_heads
from headstart.train.data import load_rows
from headstart.train.distill import compare_backends, distill
from headstart.train.sources import SourceError, answered_ids, check_sources, held_out, read_manifest
from helpers.training import make_cfg, write_shards


def _prompts(tmp_path: Path, n: int = 9) -> list:
    path = tmp_path / "prompts.jsonl"
    rows = [
        {"source": "s", "id": f"p{i}", "turns": [f"the cat {' '.join(['sat'] * (i % 4))} {i % 3}"]} for i in range(n)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return load_prompts(path)


def _shard_ids(folder: Path) -> list[str]:
    return [json.loads(x)["id"] for p in sorted(folder.glob("shard-*.jsonl")) for x in p.read_text().splitlines()]


def test_batched_rows_equal_the_generate_rows_in_float32(tmp_path, tiny_model_dir):
    model, tok = load_model(str(tiny_model_dir))
    result = compare_backends(model, tok, _prompts(tmp_path), tmp_path / "cmp", max_new_tokens=8, batch_size=3)
    assert result["rows"] == 9 and result["same_rows"] == 9
    assert read_manifest(tmp_path / "cmp" / "batched")["runs"][0]["backend"] == "batched"


@pytest.mark.parametrize("backend", ["batched", "hf"])
def test_killed_and_resumed_distillation_repeats_and_loses_nothing(tmp_path, tiny_model_dir, backend):
    model, tok = load_model(str(tiny_model_dir))
    prompts, out = _prompts(tmp_path), tmp_path / "distilled"
    # the batched backend's forwards counted at the input embedding: every forward reads it once (the fused stack
    # runs no `model.forward`)
    module, name = (model, "generate") if backend == "hf" else (model.get_input_embeddings(), "forward")
    real, calls = getattr(module, name), {"n": 0}
    kill_at = 3 if backend == "hf" else 12  # the third batch; a dozen forwards in, some rows written, some in flight

    def dying(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == kill_at:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    setattr(module, name, dying)
    with pytest.raises(KeyboardInterrupt):
        distill(model, tok, prompts, out, max_new_tokens=6, batch_size=2, backend=backend, progress=False)
    first = _shard_ids(out)
    assert 0 < len(first) < len(prompts)
    with (out / "shard-00000.jsonl").open("a") as f:
        f.write('{"id": "half-writ')  # a kill in the middle of a write
    setattr(module, name, real)
    stats = distill(model, tok, prompts, out, max_new_tokens=6, batch_size=2, backend=backend, progress=False)
    assert stats["new_rows"] == len(prompts) - len(first)
    assert sorted(_shard_ids(out)) == sorted(p.id for p in prompts)


def test_the_manifest_refuses_rows_made_otherwise(tmp_path, tiny_model_dir):
    model, tok = load_model(str(tiny_model_dir))
    prompts, out = _prompts(tmp_path, 3), tmp_path / "distilled"
    distill(model, tok, prompts[:2], out, max_new_tokens=4, progress=False, source={"prompts": "a.jsonl"})
    manifest = read_manifest(out)
    assert manifest["made_by"]["max_new_tokens"] == 4 and manifest["made_by"]["dtype"] == "float32"
    assert manifest["runs"][0]["prompts"] == "a.jsonl" and manifest["runs"][0]["new_rows"] == 2
    with pytest.raises(SourceError, match="another max_new_tokens"):
        distill(model, tok, prompts, out, max_new_tokens=8, progress=False)
    distill(model, tok, prompts, out, max_new_tokens=4, progress=False)  # the same settings: resumes
    assert len(read_manifest(out)["runs"]) == 2 and len(_shard_ids(out)) == 3


def test_ids_in_other_sources_are_not_answered_again(tmp_path, tiny_model_dir):
    model, tok = load_model(str(tiny_model_dir))
    prompts = _prompts(tmp_path, 4)
    distill(model, tok, prompts[:3], tmp_path / "shared", max_new_tokens=4, progress=False)
    stats = distill(
        model,
        tok,
        prompts,
        tmp_path / "mine",
        max_new_tokens=4,
        progress=False,
        skip_ids=answered_ids([str(tmp_path / "shared")]),
    )
    assert stats["new_rows"] == 1 and _shard_ids(tmp_path / "mine") == ["p3"]


def test_held_out_prompts_by_id_by_source_and_id_and_by_text(tmp_path):
    train = tmp_path / "train.jsonl"
    rows = [
        {"source": "nq", "id": "1", "turns": ["who wrote hamlet"]},  # held out by source and id
        {"source": "other", "id": "1", "turns": ["what is rust"]},  # the same id from another source: kept
        {"source": "x", "id": "9", "turns": ["  Translate  into German: hello "]},  # held out by text
        {"source": "x", "id": "10", "turns": ["a prompt of its own"]},
        {"id": "summary:7", "turns": ["summarise this"]},  # held out by id (derived prompts have no source)
    ]
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tune = tmp_path / "tune.jsonl"
    tune.write_text(
        json.dumps({"source": "nq", "id": "1", "turns": ["who wrote Hamlet?"]})
        + "\n"
        + json.dumps({"id": "summary:7", "turns": ["another text"]})
        + "\n"
    )
    bench = tmp_path / "bench.jsonl"
    bench.write_text(json.dumps({"source": "spec_bench", "id": "1", "turns": ["translate into german: HELLO"]}) + "\n")
    kept, dropped = held_out(load_prompts(train), [tune, bench])
    assert [p.text for p in kept] == ["what is rust", "a prompt of its own"] and dropped == 3


def test_several_sources_are_read_as_one_and_checked(tmp_path, tiny_model_dir, capsys):
    model, tok = load_model(str(tiny_model_dir))
    a, b = tmp_path / "a", tmp_path / "b"
    write_shards(a, n_rows=10)
    write_shards(b, n_rows=14)  # ids 0..13: 0..9 are read from `a` already
    rows = load_rows([a, b], max_len=64)
    assert len(rows) == 14 and [r.index for r in rows] == list(range(14)) and rows[13].id == "13"
    check_sources([str(a), str(b)], model, tok)
    assert capsys.readouterr().err.count("no manifest.json") == 2
    with pytest.raises(SourceError, match="nowhere: no distilled shards"):
        check_sources([str(a), str(tmp_path / "nowhere")], model, tok)
    real = tmp_path / "real"
    distill(model, tok, _prompts(tmp_path, 2), real, max_new_tokens=4, progress=False)
    check_sources([str(real)], model, tok)
    manifest = json.loads((real / "manifest.json").read_text())
    for key, other in (("tokenizer_sha", "0" * 16), ("chat_template_sha", "1" * 16)):
        wrong = json.loads(json.dumps(manifest))
        (wrong["made_by"]["target"] if key == "tokenizer_sha" else wrong["made_by"])[key] = other
        (real / "manifest.json").write_text(json.dumps(wrong))
        with pytest.raises(SourceError, match=f"{real} was distilled by another target or chat template .*{key}"):
            check_sources([str(real)], model, tok)


def test_training_on_a_bad_source_exits_2_and_trains_nothing(tmp_path, tiny_model_dir, capsys):
    cfg = make_cfg(tmp_path, tiny_model_dir, "medusa", **{"data.sources": f"[{tmp_path / 'missing'}]"})
    assert cfg.data.sources == [str(tmp_path / "missing")]
    config = tmp_path / "run.yaml"
    config.write_text(
        f"data:\n  path: {cfg.data.path}\n  sources: [{tmp_path / 'missing'}]\n"
        f"target:\n  model: {tiny_model_dir}\noutput_dir: {tmp_path / 'out'}\n"
    )
    assert train_heads.main(["--config", str(config)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"headstart: error: data source {tmp_path / 'missing'}: no distilled shards (shard-*.jsonl) there"
    assert not (tmp_path / "out" / "heads").exists()
