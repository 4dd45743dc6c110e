"""Published heads (heads/published.py): each layout, written as its authors publish it, loads onto a tiny target,
drafts what the equivalent native head drafts, decodes exactly, converts and round-trips; bad folders and
heads for another target are refused in one line."""

from __future__ import annotations

import json
import re
import warnings

import pytest
import torch
from safetensors.torch import load_file

from headstart.cli import main as cli
from headstart.heads.checkpoint import cut_draft_vocab, read_checkpoint
from headstart.heads.eagle3 import engine_feature_layers
from headstart.heads.export import export_heads
from headstart.heads.load import load_heads
from headstart.heads.published import PublishedHeadsError, convert_heads, detect_layout
from headstart.runtime.drafters.registry import make_drafter
from headstart.runtime.models import load_model
from helpers.exactness import assert_greedy_identity, random_heads, train_tiny_heads
from helpers.models import tiny_llama, tiny_tokenizer
from helpers.published import write_published

VOCAB = 64
LAYERS = 8  # the engines' fused layers (2, 4, 5) exist


@pytest.fixture(scope="module")
def target():
    return tiny_llama(vocab_size=VOCAB, layers=LAYERS).eval()


def same_logits(native, loaded, kind: str, model) -> None:
    """The loaded head's outputs equal the native head's on random inputs (float32, 1e-5)."""
    H, T = model.config.hidden_size, 5
    torch.manual_seed(1)
    lm_head = model.get_output_embeddings()
    with torch.no_grad():
        if kind == "medusa":
            hidden = torch.randn(T, H)
            torch.testing.assert_close(loaded(hidden, lm_head), native(hidden, lm_head), rtol=1e-5, atol=1e-5)
            return
        width = native.fc.in_features if kind == "eagle3" else H
        feats, embeds, pos = torch.randn(1, T, width), torch.randn(1, T, H), torch.arange(T)[None]
        a, b = native(feats, embeds, pos), loaded(feats, embeds, pos)
        ra, rb = native.readout(lm_head), loaded.readout(lm_head)  # (T, N) over each one's draft rows
        full = [
            torch.full((T, VOCAB), -1e9).index_copy_(1, r.to_target(torch.arange(r(x[0]).shape[-1])), r(x[0]))
            for r, x in ((ra, a), (rb, b))
        ]
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(full[1], full[0], rtol=1e-5, atol=1e-5)


CASES = [
    ("medusa", {"num_heads": 3, "own_lm_head": True}, {}),
    ("medusa", {"num_heads": 2, "own_lm_head": True, "num_layers": 2}, {"pickle": True}),
    ("eagle", {}, {}),
    ("eagle", {"fc_bias": False}, {"pickle": True}),
    ("eagle3-authors", {"draft_vocab": 16}, {}),
    ("eagle3-authors", {}, {"d2t": False}),
    ("eagle3-specforge", {"draft_vocab": 16}, {"aux_ids": [2, 4, 5]}),
    ("eagle3-speculators", {"draft_vocab": 16, "norm_before_residual": True}, {}),
    ("eagle3-speculators", {"draft_vocab": 16, "layers": [1, 3, 7]}, {"aux_ids": [1, 3, 7]}),
    ("eagle3-authors", {"draft_vocab": 16, "layers": [1, 6, 7]}, {"aux_ids": [1, 6, 7]}),
    ("eagle3-specforge", {"draft_vocab": 16, "layers": [3, 5, 8]}, {"aux_ids": [3, 5, 8]}),
    # the variants speculators 0.9 writes (EAGLE 3.1, gpt-oss style, DeepSpec's five fused layers, deeper drafts)
    (
        "eagle3-speculators",
        {
            "draft_vocab": 16,
            "fc_norm": True,
            "norm_output": True,
            "norm_before_residual": True,
            "layers": [1, 2, 4, 6, 7],
            "num_layers": 2,
        },
        {"aux_ids": [1, 2, 4, 6, 7]},
    ),
    ("eagle3-speculators", {"draft_vocab": 16, "norm_before_fc": True}, {}),
    ("eagle3-specforge", {"draft_vocab": 16, "fc_norm": True, "norm_output": True, "num_layers": 3}, {}),
]


@pytest.mark.parametrize(("layout", "options", "how"), CASES)
def test_each_layout_loads_and_drafts_what_the_native_head_drafts(tmp_path, target, layout, options, how):
    kind = layout.split("-")[0]
    native = random_heads(kind, target, 0.2, **options)
    if "draft_vocab" in options:
        native.draft_vocab.copy_(torch.randperm(VOCAB)[: options["draft_vocab"]])
    src = write_published(native, target, layout, tmp_path / "src", **how)
    assert detect_layout(src) == layout
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded, config = load_heads(src, target)
    assert config.kind == kind and config.vocab_order == "token_id"
    if "layers" in options:  # the fused layers as each dialect numbers them, read back as Hugging Face's indices
        assert loaded.feature_layers == tuple(options["layers"]) != engine_feature_layers(LAYERS)
    if kind == "eagle3":
        assert loaded.variant() == native.variant()
    same_logits(native, loaded, kind, target)
    said = " ".join(str(w.message) for w in caught)
    if layout == "medusa":  # the published config names the base model on the hub, and says 2 heads; the file is read
        assert "lmsys/vicuna-7b-v1.3 as their base model" in said
        assert (f"its file holds {options['num_heads']}" in said) == (options["num_heads"] != 2)
    out = convert_heads(src, tmp_path / "converted", target)
    again, _ = load_heads(out, target)
    same_logits(native, again, kind, target)


@pytest.mark.parametrize(
    ("edit", "refusal"),
    [
        ({"some_new_flag": True}, "unknown EAGLE-3 key 'some_new_flag'"),
        (
            {"transformer_layer_config": {"attention_chunk": 8}},
            "unknown EAGLE-3 key 'transformer_layer_config.attention_chunk'",
        ),
        ({"transformer_layer_config": {"hidden_act": "gelu"}}, "transformer_layer_config.hidden_act = 'gelu' changes"),
        ({"transformer_layer_config": {"attention_bias": True}}, "attention_bias = True changes"),
        ({"fc_norm": True}, "says fc_norm, its weights lack fc_norm.0.weight"),
        ({"transformers_version": "5.19.0", "torch_dtype": "bfloat16", "output_hidden_states": False}, None),
    ],
)
def test_every_config_key_is_used_or_known_to_be_inert(tmp_path, target, edit, refusal):
    """A key of a published EAGLE-3 config that headstart does not use and does not know to be inert is refused in
    one line naming it, never silently ignored; generic Hugging Face keys are read as inert."""
    native = random_heads("eagle3", target, 0.2, draft_vocab=16, norm_before_residual=True)
    native.draft_vocab.copy_(torch.randperm(VOCAB)[:16])
    src = write_published(native, target, "eagle3-speculators", tmp_path / "src")
    config = json.loads((src / "config.json").read_text())
    for key, value in edit.items():
        if isinstance(value, dict):
            config[key].update(value)
        else:
            config[key] = value
    (src / "config.json").write_text(json.dumps(config))
    if refusal is None:
        same_logits(native, load_heads(src, target)[0], "eagle3", target)
        return
    with pytest.raises(PublishedHeadsError, match=re.escape(refusal)) as e:
        load_heads(src, target)
    assert "\n" not in str(e.value)


def test_speculators_heads_without_the_key_put_the_norm_before_the_residual(tmp_path, target):
    native = random_heads("eagle3", target, 0.2, norm_before_residual=True)
    src = write_published(native, target, "eagle3-speculators", tmp_path / "src", d2t=False)
    config = json.loads((src / "config.json").read_text())
    del config["norm_before_residual"]  # vLLM and speculators read a missing key as true
    (src / "config.json").write_text(json.dumps(config))
    loaded, _ = load_heads(src, target)
    assert loaded.midlayer.norm_before_residual
    same_logits(native, loaded, "eagle3", target)


def test_a_published_layer_of_other_sizes_is_built_as_published(tmp_path, target):
    native = random_heads("eagle3", target, 0.2, layer={"intermediate_size": 48, "rms_norm_eps": 1e-5})
    src = write_published(native, target, "eagle3-specforge", tmp_path / "src", d2t=False)
    config = json.loads((src / "config.json").read_text())
    config.update(intermediate_size=48, rms_norm_eps=1e-5)
    (src / "config.json").write_text(json.dumps(config))
    loaded, heads_config = load_heads(src, target)
    assert heads_config.options["layer"] == {"intermediate_size": 48, "rms_norm_eps": 1e-5}
    same_logits(native, loaded, "eagle3", target)


# (the EAGLE authors' EAGLE-3 layout names no fused layers: (2, N//2, N-3) do not exist in this 2-layer target)
@pytest.mark.parametrize("layout", ["medusa", "eagle", "eagle3-specforge", "eagle3-speculators"])
def test_greedy_identity_with_trained_heads_in_a_published_layout(tmp_path, tiny_model_dir, layout):
    kind = layout.split("-")[0]
    heads_dir = train_tiny_heads(
        tmp_path, tiny_model_dir, kind, **({"heads.draft_vocab": 24} if kind == "eagle3" else {})
    )
    model, tokenizer = load_model(str(tiny_model_dir))
    model.generation_config.eos_token_id = None
    trained, _ = load_heads(heads_dir, model, tokenizer)
    how = {"aux_ids": list(trained.feature_layers)} if kind == "eagle3" else {}  # a 2-layer target: clamped layers
    src = write_published(trained, model, layout, tmp_path / "published", **how)
    prompts = [[3, 4, 5, 6, 3, 4], [10, 11, 12, 13, 14, 15, 16], [20, 21]]
    for spec in (kind, kind + "+lookup"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Medusa's prior tree, the published config's head count
            drafter = make_drafter(spec, model, tokenizer, heads=str(src))
        assert assert_greedy_identity(model, drafter, prompts).accepted > 0, f"no draft accepted with {spec}"


TRAINED_VARIANTS = {
    "plain": {},
    "eagle_3.1": {"heads.fc_norm": True, "heads.norm_output": True, "heads.draft_layers": 2},
    "gpt_oss": {"heads.norm_before_fc": True, "heads.fused_layers": [1, 2, 1, 2, 2]},
}


@pytest.mark.parametrize("fmt", ["specforge", "speculators"])
@pytest.mark.parametrize("variant", list(TRAINED_VARIANTS))
def test_export_import_export_keeps_every_tensor(tmp_path, tiny_model_dir, fmt, variant):
    """Heads trained with each variant's options, exported in each layout, read back as published heads: the same
    tensors and the same variant."""
    heads_dir = train_tiny_heads(
        tmp_path, tiny_model_dir, "eagle3", steps=2, **{"heads.draft_vocab": 24, **TRAINED_VARIANTS[variant]}
    )
    model, tokenizer = load_model(str(tiny_model_dir))
    embedding = model.get_input_embeddings().weight if fmt == "speculators" else None
    first = export_heads(heads_dir, tmp_path / "first", fmt, embedding=embedding)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        converted = convert_heads(first, tmp_path / "converted", model, tokenizer)
    # the export refuses other fused layers than the engines': give the clamped test target's its own
    second = export_heads(converted, tmp_path / "second", fmt, embedding=embedding)
    a, b = load_file(first / "model.safetensors"), load_file(second / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
    native, _ = load_heads(heads_dir, model, tokenizer)
    again, _ = load_heads(converted, model, tokenizer)
    assert again.variant() == native.variant() and again.feature_layers == native.feature_layers
    flags = {k[len("heads.") :]: v for k, v in TRAINED_VARIANTS[variant].items() if k != "heads.fused_layers"}
    assert {
        ("num_layers" if k == "draft_layers" else k): v for k, v in flags.items()
    }.items() <= native.variant().items()


def test_a_pickle_holding_more_than_tensors_is_refused(tmp_path, target):
    src = write_published(random_heads("eagle", target, 0.2), target, "eagle", tmp_path / "src", pickle=True)
    state = torch.load(src / "pytorch_model.bin", weights_only=True)
    torch.save({**state, "note": PublishedHeadsError("not a tensor")}, src / "pytorch_model.bin")
    with pytest.raises(PublishedHeadsError, match=r"pytorch_model\.bin is refused: its pickle holds more than tensors"):
        load_heads(src, target)


def test_bad_folders_are_refused_in_one_line(tmp_path, target):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(PublishedHeadsError, match="is empty"):
        detect_layout(empty)
    two = write_published(random_heads("eagle", target, 0.2), target, "eagle", tmp_path / "two")
    write_published(random_heads("medusa", target, 0.2, num_heads=2), target, "medusa", tmp_path / "m")
    (tmp_path / "m" / "medusa_lm_head.safetensors").rename(two / "medusa_lm_head.safetensors")
    with pytest.raises(PublishedHeadsError, match="two layouts"):
        detect_layout(two)
    cut = write_published(random_heads("eagle3", target, 0.2), target, "eagle3-specforge", tmp_path / "cut", d2t=False)
    data = (cut / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(PublishedHeadsError, match=r"cannot read .*model.safetensors"):
        load_heads(cut, target)
    keyless = write_published(random_heads("eagle3", target, 0.2), target, "eagle3-authors", tmp_path / "k", d2t=False)
    config = json.loads((keyless / "config.json").read_text())
    del config["draft_vocab_size"]
    (keyless / "config.json").write_text(json.dumps(config))
    with pytest.raises(PublishedHeadsError, match=r"config.json lacks 'draft_vocab_size'"):
        load_heads(keyless, target)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("hi")
    with pytest.raises(PublishedHeadsError, match="holds no heads headstart can read"):
        detect_layout(tmp_path / "other")


def test_heads_for_another_target_are_refused_naming_both_sides(tmp_path, target):
    other = tiny_llama(vocab_size=VOCAB, layers=4)  # same sizes, fewer layers
    wide = tiny_llama(vocab_size=VOCAB + 8, layers=8)
    cases = [
        (
            random_heads("eagle3", target, 0.2),
            "eagle3-specforge",
            {"aux_ids": [2, 4, 7]},
            other,
            r"fused layers \[2, 4, 7\] in the heads, 4 layers in LlamaForCausalLM",
        ),
        (
            random_heads("eagle3", target, 0.2),
            "eagle3-authors",
            {"d2t": False},
            wide,
            rf"vocabulary {VOCAB} in the heads, {VOCAB + 8} in LlamaForCausalLM",
        ),
        (
            random_heads("medusa", target, 0.2, num_heads=2, own_lm_head=True),
            "medusa",
            {},
            wide,
            rf"vocabulary {VOCAB} in the heads, {VOCAB + 8}",
        ),
        (
            random_heads("eagle", target, 0.2),
            "eagle",
            {"embed": torch.zeros(VOCAB + 8, 16)},
            target,
            r"vocabulary 72 in the heads, 64",
        ),
    ]
    for i, (heads, layout, how, model, message) in enumerate(cases):
        src = write_published(heads, target, layout, tmp_path / f"src{i}", **how)
        with pytest.raises(PublishedHeadsError, match=message):
            load_heads(src, model)
    narrow = tiny_llama(vocab_size=VOCAB, layers=8, hidden_size=32)
    src = write_published(random_heads("eagle", target, 0.2), target, "eagle", tmp_path / "h")
    with pytest.raises(PublishedHeadsError, match="hidden size"):
        load_heads(src, narrow)


def test_a_stored_embedding_that_differs_is_reported_and_the_targets_used(tmp_path, target):
    native = random_heads("eagle", target, 0.2)
    noisy = target.get_input_embeddings().weight.detach().float() + 0.01
    src = write_published(native, target, "eagle", tmp_path / "src", embed=noisy)
    with pytest.warns(UserWarning, match=r"stored embedding differs from the target's \(largest difference 0.01"):
        loaded, _ = load_heads(src, target)
    same_logits(native, loaded, "eagle", target)


def test_convert_on_the_command_line(tmp_path, tiny_model_dir, capsys):
    model, _ = load_model(str(tiny_model_dir))
    src = write_published(random_heads("eagle", model, 0.2), model, "eagle", tmp_path / "src")
    assert cli(["convert", str(src), str(tmp_path / "out"), "--model", str(tiny_model_dir)]) == 0
    config, weights = read_checkpoint(tmp_path / "out")
    assert config.kind == "eagle" and config.extra["imported_from"] == "eagle" and "fc.bias" in weights
    assert cli(["convert", str(src), str(tmp_path / "out"), "--model", str(tiny_model_dir)]) == 2
    assert "exists and is not empty" in capsys.readouterr().err
    wide = tmp_path / "wide"
    tiny_llama(vocab_size=VOCAB + 8).save_pretrained(wide)
    tiny_tokenizer().save_pretrained(wide)
    capsys.readouterr()
    assert cli(["convert", str(src), str(tmp_path / "out2"), "--model", str(wide)]) == 2
    err = capsys.readouterr().err
    assert err.count("headstart: error") == 1 and "do not fit the target" in err.splitlines()[-1]


def test_bench_compares_heads_side_by_side(tmp_path, tiny_model_dir, capsys):
    heads_dir = train_tiny_heads(tmp_path, tiny_model_dir, "eagle")
    model, tokenizer = load_model(str(tiny_model_dir))
    trained, _ = load_heads(heads_dir, model, tokenizer)
    published = write_published(trained, model, "eagle", tmp_path / "published")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "1", "category": "a", "turns": ["one two three one two three"]}) + "\n")
    out = tmp_path / "bench"
    args = [
        "bench",
        "--model",
        str(tiny_model_dir),
        "--dtype",
        "float32",
        "--prompts",
        str(prompts),
        "--methods",
        "plain,eagle,lookup",
        "--max-new-tokens",
        "16",
        "--speculation",
        "fixed",  # each drafter's own tree (the load budget may find no tree worth a tiny model's rows)
        "--out",
        str(out),
    ]
    assert cli([*args, "--heads", f"mine={heads_dir}", "--heads", f"pub={published}"]) == 0
    table = capsys.readouterr().out
    rows = {line.split("|")[2].strip(): line for line in table.splitlines() if line.startswith("| overall")}
    assert list(rows) == ["plain", "eagle@mine", "eagle@pub", "lookup"]
    records = json.loads(next(out.glob("*.json")).read_text())["records"]
    by = {r["method"]: r for r in records}
    # the same weights in two layouts: the same tokens as plain, drafts accepted (the trees differ: the published
    # copy carries no measured accuracies, so its tree is not sized from them)
    assert by["eagle@mine"]["same_as_plain"] and by["eagle@pub"]["same_as_plain"]
    assert max(by["eagle@mine"]["target_passes"], by["eagle@pub"]["target_passes"]) < by["plain"]["target_passes"]
    assert cli([*args, "--heads", f"m={heads_dir}", "--methods", "plain,lookup"]) == 2
    assert "no method in --methods runs heads of its kind" in capsys.readouterr().err
    assert cli([*args, "--heads", f"{heads_dir}"]) == 2
    assert "--heads takes LABEL=DIR" in capsys.readouterr().err
    # KIND=DIR: those heads instead of the shipped ones (none ship for the tiny model), the method keeps its name
    assert cli([*args, "--heads", f"eagle={published}"]) == 0
    rows = [line.split("|")[2].strip() for line in capsys.readouterr().out.splitlines() if line.startswith("| overall")]
    assert rows == ["plain", "eagle", "lookup"]
    assert cli([*args, "--heads", f"medusa={heads_dir}"]) == 2  # a folder of another kind
    assert f"--heads medusa={heads_dir}: that folder holds eagle heads, not medusa" in capsys.readouterr().err
    assert cli([*args, "--eagle-heads", str(heads_dir)]) == 2  # the old per-kind flags, in one line
    assert capsys.readouterr().err.strip().endswith("--eagle-heads is gone: use --heads eagle=DIR")


def test_shipped_heads_run_beside_the_labelled_ones():
    from headstart.heads.checkpoint import shipped_heads
    from headstart.runtime.apps.bench import label_methods

    mine = shipped_heads("smollm2-135m-instruct", "eagle3")
    methods = label_methods(["plain", "eagle3+lookup", "eagle"], {"mine": str(mine)}, "smollm2-135m-instruct")
    assert methods == ["plain", "eagle3+lookup@shipped", "eagle3+lookup@mine", "eagle"]
    assert label_methods(["eagle3"], {"mine": str(mine)}, "tiny") == ["eagle3@mine"]  # nothing shipped for it


def test_calibrate_measures_accuracies_on_your_prompts(tmp_path, tiny_model_dir, capsys):
    from headstart.heads.checkpoint import CheckpointConfig
    from headstart.train.data import Row
    from headstart.train.evaluate import measure

    heads_dir = train_tiny_heads(tmp_path, tiny_model_dir, "medusa")
    model, tokenizer = load_model(str(tiny_model_dir))
    trained, _ = load_heads(heads_dir, model, tokenizer)
    # the measure (training's evaluation), against a position-by-position count: head k at t guesses token t+k+1
    ids, n_prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16], 4
    _, measured = measure("medusa", trained, model, [Row(ids, n_prompt, 0, "a")], trained.num_heads, 0)
    with torch.no_grad():
        hidden = model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]
    readout = trained.readout(model.get_output_embeddings())
    K, T = trained.num_heads, len(ids)
    positions = range(n_prompt - 2, T - K - 1)  # every head's token (t + 2 .. t + K + 1) is an answer token
    for k in range(1, K + 1):
        counts = [0.0] * len(measured[k - 1])
        for t in positions:
            logits = trained.head_logits(k, trained.features(hidden[t])[k - 1], readout)
            guesses = readout.to_target(logits.topk(len(counts)).indices).tolist()
            if ids[t + k + 1] in guesses:
                counts[guesses.index(ids[t + k + 1])] += 1
        assert measured[k - 1] == pytest.approx([c / len(positions) for c in counts])
    # on the command line: published heads are converted first, then calibrated in place
    published = write_published(trained, model, "medusa", tmp_path / "published")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [t]}) + "\n" for t in ["one two three one two", "red blue green"]))
    args = ["--prompts", str(prompts), "--model", str(tiny_model_dir), "--max-new-tokens", "24"]
    assert cli(["calibrate", str(published), *args]) == 2
    assert "convert" in capsys.readouterr().err
    converted = tmp_path / "converted"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        convert_heads(published, converted, model, tokenizer)
    assert CheckpointConfig.read(converted).rank_accuracy is None
    assert cli(["calibrate", str(converted), *args]) == 0
    config = CheckpointConfig.read(converted)
    assert len(config.rank_accuracy) == K and config.extra["calibrated_on"]["answers"] == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # measured accuracies: no prior tree, no warning
        make_drafter("medusa", model, tokenizer, heads=str(converted))
    eagle = train_tiny_heads(tmp_path / "e", tiny_model_dir, "eagle")  # EAGLE: its drafting depths, unrolled
    assert cli(["calibrate", str(eagle), *args]) == 0
    assert len(CheckpointConfig.read(eagle).rank_accuracy) == 5


def test_a_cut_draft_vocabulary_reads_out_what_the_full_head_reads_out_limited(tmp_path, tiny_model_dir):
    full_dir = train_tiny_heads(tmp_path, tiny_model_dir, "eagle3", steps=2, **{"heads.draft_vocab": 24})
    cut_dir = cut_draft_vocab(full_dir, tmp_path / "cut", 10)
    target, tokenizer = load_model(str(tiny_model_dir))
    (full, _), (cut, config) = load_heads(full_dir, target, tokenizer), load_heads(cut_dir, target, tokenizer)
    assert config.options["draft_vocab"] == 10 and config.draft_layer["draft_vocab_size"] == 10
    assert (cut_dir / "model.safetensors").stat().st_size < (full_dir / "model.safetensors").stat().st_size
    y = torch.randn(5, target.config.hidden_size)
    limited, small = full.readout(limit=10), cut.readout()
    assert torch.equal(limited(y), small(y)) and torch.equal(limited.ids, small.ids)
    with pytest.raises(ValueError, match="cannot keep 24 draft tokens"):
        cut_draft_vocab(full_dir, tmp_path / "none", 24)
