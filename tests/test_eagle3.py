"""EAGLE-3: the head against the engines' forward written out by hand, training and exact decoding with trained
heads, and the export to the layout vLLM and SGLang load (its training-time test: tests/test_train.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from headstart.cli import main as cli
from headstart.heads.checkpoint import build_heads, save_heads, target_fingerprint
from headstart.heads.eagle3 import PLAIN_VARIANT, engine_feature_layers, feature_layers
from headstart.heads.export import ExportError, export_heads
from helpers.eagle3_reference import ReferenceEagle3
from helpers.exactness import assert_identity_with_trained_heads, random_heads
from helpers.models import tiny_llama


def test_the_head_computes_the_engines_forward():
    """../shared/ENGINES.md's forward, written out in tests/helpers/eagle3_reference.py (causal, positions
    0..T-1): the layout both engines run."""
    model = tiny_llama(vocab_size=64, layers=8)
    head = random_heads("eagle3", model, 0.2, draft_vocab=16)
    assert head.feature_layers == engine_feature_layers(8) == (2, 4, 5)
    T, H = 6, model.config.hidden_size
    fused, embeds = torch.randn(T, 3 * H), torch.randn(T, H)
    with torch.no_grad():
        y = head(fused[None], embeds[None], torch.arange(T)[None])[0]
        logits = head.logits(y)
    ref_y, ref_logits = ReferenceEagle3(head).commit(fused, embeds)
    torch.testing.assert_close(y, ref_y.float(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(logits, ref_logits.float(), rtol=1e-4, atol=1e-5)


VARIANTS = {
    "fc_norm": {"fc_norm": True},
    "norm_before_fc": {"norm_before_fc": True},
    "norm_output": {"norm_output": True},
    "five_layers_fused": {"layers": [1, 2, 4, 6, 7]},
    "two_draft_layers": {"num_layers": 2},
    "eagle_3.1": {"fc_norm": True, "norm_output": True, "norm_before_residual": True, "num_layers": 3},
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_each_variant_drafts_what_its_definition_computes(variant):
    """Prefix commit, then two drafting steps on the head's own outputs through its KV cache, as the drafter runs
    it: the head's draft logits equal the variant's definition computed from its weights in float64."""
    from transformers import DynamicCache

    model = tiny_llama(vocab_size=64, layers=8)
    head = random_heads("eagle3", model, 0.2, draft_vocab=16, **VARIANTS[variant]).double()
    k, T, H = len(head.feature_layers), 5, model.config.hidden_size
    fused, embeds = torch.randn(T, k * H, dtype=torch.float64), torch.randn(T + 2, H, dtype=torch.float64)
    ref = ReferenceEagle3(head)
    cache = DynamicCache()
    with torch.no_grad():
        out = head(fused[None], embeds[None, :T], torch.arange(T)[None], cache=cache)[0]
        ref_out, ref_logits = ref.commit(fused, embeds[:T])
        torch.testing.assert_close(head.logits(out), ref_logits)
        torch.testing.assert_close(head.readout()(out), ref_logits)  # what drafting reads out
        previous, ref_previous = out[-1], ref_out[-1]
        for step in range(2):  # the head's own output, the drafted token's embedding, the next position
            mine = head(previous[None, None], embeds[None, T + step, None], torch.tensor([[T + step]]), cache=cache)
            theirs, ref_logits = ref.step(ref_previous, embeds[T + step], T + step)
            torch.testing.assert_close(head.logits(mine[0]), ref_logits)
            previous, ref_previous = mine[0, -1], theirs[-1]
    assert head.variant() == {**PLAIN_VARIANT, **{k: v for k, v in VARIANTS[variant].items() if k != "layers"}}


def test_variants_that_contradict_each_other_are_refused():
    with pytest.raises(ValueError, match="fc_norm and norm_before_fc are exclusive"):
        build_heads("eagle3", tiny_llama(), fc_norm=True, norm_before_fc=True)
    with pytest.raises(ValueError, match="at least one draft layer"):
        build_heads("eagle3", tiny_llama(), num_layers=0)


def test_feature_layers_of_shallow_targets_stay_inside_the_model():
    assert feature_layers(30) == (2, 15, 27)  # SmolLM2-135M
    assert feature_layers(2) == (1, 1, 2)  # test models: clamped into 1..N
    with pytest.raises(ValueError, match=r"two or more target layers in 1\.\.2"):
        build_heads("eagle3", tiny_llama(), layers=[1, 2, 3])
    with pytest.raises(ValueError, match=r"two or more target layers"):
        build_heads("eagle3", tiny_llama(), layers=[2])
    with pytest.raises(ValueError, match="larger than the target's 64"):
        build_heads("eagle3", tiny_llama(vocab_size=64), draft_vocab=65)


def test_greedy_identity_with_trained_variant_heads(tmp_path, tiny_model_dir):
    """An EAGLE 3.1 head with two draft layers (their own KV cache entries: commit, draft, crop) decodes exactly."""
    variant = {"heads.fc_norm": True, "heads.norm_output": True, "heads.draft_layers": 2, "heads.draft_vocab": 24}
    assert_identity_with_trained_heads(tmp_path, tiny_model_dir, "eagle3", [{}, {"depth": 3, "top_k": 2}], **variant)


def test_greedy_identity_with_trained_heads(tmp_path, tiny_model_dir):
    trees = [{}, {"depth": 3, "top_k": 1, "budget": 3}, {"draft_vocab": 12}]
    assert_identity_with_trained_heads(
        tmp_path, tiny_model_dir, "eagle3", trees, **{"heads.draft_vocab": 24, "heads.unroll": 2}
    )


def test_greedy_identity_with_lookup_grafted_on(tmp_path, tiny_model_dir):
    assert_identity_with_trained_heads(tmp_path, tiny_model_dir, "eagle3", [{}], drafter="eagle3+lookup")


# ---- export ------------------------------------------------------------------------------------------


def saved_head(root, model=None, kind="eagle3", **options):
    model = model or tiny_llama(vocab_size=64, layers=8)
    head = random_heads(kind, model, 0.1, **options)
    if getattr(head, "draft_vocab", None) is not None:
        head.draft_vocab.copy_(torch.randperm(64)[: len(head.draft_vocab)])
    fp = target_fingerprint(model, name="tiny-8")
    saved = {**options, **({"layers": list(head.feature_layers)} if kind == "eagle3" else {})}
    return save_heads(root / "heads", head, kind, saved, fp, {"dtype": "float32"}), head


def test_export_writes_the_engines_layout(tmp_path):
    heads_dir, head = saved_head(tmp_path, draft_vocab=16)
    out = export_heads(heads_dir, tmp_path / "vllm")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["model_type"] == "llama"
    assert (config["num_hidden_layers"], config["vocab_size"], config["draft_vocab_size"]) == (1, 64, 16)
    # the fused layers always named (here the engines' own default, 2, N//2, N-3), in each engine's numbering
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    weights = load_file(out / "model.safetensors")
    assert weights["fc.weight"].shape == (64, 3 * 64)
    assert weights["midlayer.self_attn.q_proj.weight"].shape == (64, 128)  # q/k/v read 2H
    assert weights["lm_head.weight"].shape == (16, 64) and "draft_vocab" not in weights
    ids = head.draft_vocab
    assert weights["d2t"].dtype == torch.int64 and torch.equal(torch.arange(16) + weights["d2t"], ids)
    assert weights["t2d"].dtype == torch.bool and weights["t2d"].sum() == 16 and weights["t2d"][ids].all()
    for name, tensor in head.state_dict().items():
        if name != "draft_vocab":
            torch.testing.assert_close(weights[name], tensor)
    assert "vllm serve tiny-8 --speculative-config" in (out / "README.md").read_text()


def test_export_speculators_format(tmp_path):
    model = tiny_llama(vocab_size=64, layers=8)
    heads_dir, _ = saved_head(tmp_path, model)  # the full vocabulary: no d2t / t2d
    embedding = model.get_input_embeddings().weight
    with pytest.raises(ExportError, match=r"stores the target's input embedding \(64, 64\): got none"):
        export_heads(heads_dir, tmp_path / "spec", "speculators", verifier="/models/tiny")
    with pytest.raises(ExportError, match=r"got one of \(64, 8\)"):
        export_heads(heads_dir, tmp_path / "spec", "speculators", embedding=embedding[:, :8])
    out = export_heads(heads_dir, tmp_path / "spec", "speculators", verifier="/models/tiny", embedding=embedding)
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and config["norm_before_residual"] is False
    assert config["speculators_config"]["verifier"]["name_or_path"] == "/models/tiny"
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert config["transformer_layer_config"]["hidden_size"] == 64
    weights = load_file(out / "model.safetensors")
    assert "layers.0.hidden_norm.weight" in weights and not any(k.startswith("midlayer.") for k in weights)
    assert "d2t" not in weights and "t2d" not in weights
    # the target's embedding stored, as speculators' save_pretrained stores it (its loader leaves a missing one as
    # uninitialised memory)
    assert torch.equal(weights["embed_tokens.weight"], embedding)


@pytest.mark.parametrize("fmt", ["specforge", "speculators"])
def test_the_export_names_the_target_by_what_it_is_and_no_path_of_this_machine(tmp_path, monkeypatch, capsys, fmt):
    """The shipped head exported on the command line: the embedded model by its hub id, the fused layers written,
    and no file naming the machine's folders (its model cache, the output folder, the home folder)."""
    from headstart.heads.checkpoint import shipped_heads
    from headstart.runtime.paths import cache_dir

    monkeypatch.chdir(tmp_path)
    assert cli(["export", str(shipped_heads("smollm2-135m-instruct", "eagle3")), "out", "--format", fmt]) == 0
    capsys.readouterr()
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    names = {"specforge": None, "speculators": config.get("speculators_config", {}).get("verifier", {})}
    if fmt == "speculators":
        assert names["speculators"]["name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]
    readme = (tmp_path / "out" / "README.md").read_text()
    assert "vllm serve HuggingFaceTB/SmolLM2-135M-Instruct" in readme and '"model": "out"' in readme
    for path in (tmp_path / "out").iterdir():
        if path.suffix in (".json", ".md"):
            text = path.read_text()
            for local in (str(tmp_path), str(cache_dir()), str(Path.home())):
                assert local not in text, f"{path.name} names {local}"


def test_export_refuses_in_one_line_and_leaves_nothing(tmp_path, capsys):
    def refuse(args, message):
        before = sorted(p.name for p in tmp_path.iterdir())
        assert cli(["export", *map(str, args)]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
        assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing half-written

    eagle, _ = saved_head(tmp_path / "e", kind="eagle")
    refuse([eagle, tmp_path / "o"], "EAGLE-1 heads cannot be exported faithfully")
    medusa, _ = saved_head(tmp_path / "m", kind="medusa", num_heads=2)
    refuse([medusa, tmp_path / "o"], "medusa heads cannot be exported")
    good, _ = saved_head(tmp_path / "g", draft_vocab=16)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    refuse([good, tmp_path / "full"], "exists and is not empty")
    refuse([tmp_path / "nothing", tmp_path / "o"], "is not a heads checkpoint")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((good / "config.json").read_text())
    (bad / "model.safetensors").write_bytes((good / "model.safetensors").read_bytes()[:100])
    refuse([bad, tmp_path / "o"], "cannot read the heads")
    big = json.loads((good / "config.json").read_text())
    big["target"]["vocab_size"] = 8  # the target's vocabulary smaller than the draft's
    (good / "config.json").write_text(json.dumps(big))
    refuse([good, tmp_path / "o"], "the draft vocabulary (16 tokens) is larger than the target's (8)")


def test_fused_layers_are_named_in_each_engines_numbering(tmp_path):
    shallow, _ = saved_head(tmp_path / "s", model=tiny_llama(vocab_size=64))  # 2 layers: fuses (1, 1, 2)
    config = json.loads((export_heads(shallow, tmp_path / "sf") / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 1, 2]  # vLLM: the input of layer k
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 0, 1]  # SGLang: the output of layer k
    embedding = torch.zeros(64, 64)
    config = json.loads(
        (export_heads(shallow, tmp_path / "sp", "speculators", embedding=embedding) / "config.json").read_text()
    )
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 1, 2]
    eight, _ = saved_head(tmp_path / "e")  # 8 layers: the engines' own (2, 4, 5), named all the same
    config = json.loads((export_heads(eight, tmp_path / "ef") / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]


@pytest.mark.parametrize(
    "options, refused",
    [
        ({}, None),
        ({"norm_before_fc": True}, None),  # llama.cpp reads it (an RMSNorm over the fused states before fc)
        ({"num_layers": 2}, "2 draft layers (it runs exactly 1)"),
        ({"layers": [1, 2, 3, 4, 5]}, "5 fused layers (it fuses exactly 3)"),
        ({"fc_norm": True}, "fc_norm (it has no per-state norms before fc)"),
        ({"norm_output": True}, "norm_output (its next step reads the output before the final norm)"),
    ],
)
def test_export_for_llamacpp_refuses_what_it_would_draft_otherwise(tmp_path, capsys, options, refused):
    """`headstart export --for llamacpp`: the variants llama.cpp (0.3.36's) runs are written, the others refused in one
    line naming what it would not run, before any file is written (`make test-llamacpp` serves both kinds)."""
    heads_dir, _ = saved_head(tmp_path, **options)
    code = cli(["export", str(heads_dir), str(tmp_path / "out"), "--for", "llamacpp"])
    err = capsys.readouterr().err
    if refused is None:
        assert code == 0 and (tmp_path / "out" / "model.safetensors").exists()
    else:
        assert code == 2 and f"llama.cpp would not run this head's {refused}" in err and err.count("\n") == 1, err
        assert not (tmp_path / "out").exists()
    assert cli(["export", str(heads_dir), str(tmp_path / "vllm"), "--for", "vllm"]) == 0  # vLLM runs every variant
