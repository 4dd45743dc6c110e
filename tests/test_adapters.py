"""LoRA-adapted targets: peft adapters merged or live, exact decoding on them, heads bound to their adapter,
and adapter directories that cannot be used refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peft import IA3Config, LoraConfig, get_peft_model
from transformers import LlamaConfig

from headstart.cli import main as cli
from headstart.heads.checkpoint import HeadsMismatchError, save_heads, target_fingerprint
from headstart.heads.load import load_heads
from headstart.runtime.adapters import adapter_sha
from headstart.runtime.drafters.registry import make_drafter
from headstart.runtime.models import load_model
from helpers.exactness import TREES, assert_greedy_identity, assert_trained_heads_speculate, fit_heads, random_heads
from helpers.models import WORDS, tiny_llama
from helpers.training import greedy_rows

PROMPTS = [[3, 4, 5, 6, 3, 4, 5], [10, 11, 12, 13, 10, 11], [20, 21]]


def save_lora(model_dir, out, seed: int, config=None) -> str:
    """A LoRA adapter with random, non-zero A and B (init_lora_weights=False) for the model in `model_dir`."""
    base, _ = load_model(str(model_dir))
    torch.manual_seed(seed)
    config = config or LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False
    )
    get_peft_model(base, config).save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {name: save_lora(tiny_model_dir, root / name, seed) for name, seed in (("a", 1), ("b", 2))}


def test_merged_and_live_adapters_give_the_same_logits(tiny_model_dir, adapters):
    base, _ = load_model(str(tiny_model_dir))
    merged, _ = load_model(str(tiny_model_dir), adapter=adapters["a"])
    live, _ = load_model(str(tiny_model_dir), adapter=adapters["a"], merge_adapter=False)
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        logits = [m(input_ids=ids).logits for m in (base, merged, live)]
    torch.testing.assert_close(logits[1], logits[2], atol=1e-4, rtol=1e-4)
    assert (logits[0] - logits[1]).abs().max() > 1e-2  # the adapter changes the model
    assert merged.config.headstart_adapter == live.config.headstart_adapter == adapter_sha(adapters["a"])


@pytest.fixture(scope="module")
def adapted_heads(tiny_model_dir, adapters, tmp_path_factory):
    """Heads of each kind trained (by the trainer, `target.adapter`) on the adapted model's own greedy answers."""
    root = tmp_path_factory.mktemp("adapted-heads")
    model, _ = load_model(str(tiny_model_dir), adapter=adapters["a"])
    rows = greedy_rows(model, [*PROMPTS, [7, 8, 9, 30, 31]], 24)
    return {
        kind: str(
            fit_heads(
                root / kind, tiny_model_dir, kind, rows, **{"target.adapter": adapters["a"], "heads.draft_vocab": 0}
            )
        )
        for kind in ("medusa", "eagle", "eagle3")
    }


@pytest.mark.parametrize("merge", [True, False], ids=["merged", "live"])
def test_greedy_identity_on_an_adapted_target(tiny_model_dir, adapters, adapted_heads, merge):
    """Every drafter gives the adapted model's own greedy tokens (transformers' generate of the peft model); heads
    trained for it are accepted, several branches a round."""
    model, tokenizer = load_model(str(tiny_model_dir), adapter=adapters["a"], merge_adapter=merge)
    model.generation_config.eos_token_id = None
    for name in ("none", "lookup", *(f"{kind}{graft}" for kind in adapted_heads for graft in ("", "+lookup"))):
        kind = name.removesuffix("+lookup")
        options = {"heads": adapted_heads[kind], **TREES[kind]} if kind in adapted_heads else {}
        drafter = make_drafter(name, model, tokenizer, **options)
        seen = assert_greedy_identity(model, drafter, PROMPTS, max_new_tokens=24)
        assert name != "none" or seen.accepted == 0
        if kind in adapted_heads:
            assert_trained_heads_speculate(seen, name, "merged" if merge else "live")


def test_heads_are_bound_to_their_adapter(tiny_model_dir, adapters, tmp_path):
    on_a, tokenizer = load_model(str(tiny_model_dir), adapter=adapters["a"])
    heads = random_heads("eagle", on_a, 0.05)
    save_heads(tmp_path / "h", heads, "eagle", {}, target_fingerprint(on_a, tokenizer), {"dtype": "float32"})
    assert load_heads(tmp_path / "h", on_a, tokenizer)  # the adapter they were trained for
    base, _ = load_model(str(tiny_model_dir))
    on_b, _ = load_model(str(tiny_model_dir), adapter=adapters["b"])
    sha_a, sha_b = adapter_sha(adapters["a"]), adapter_sha(adapters["b"])
    with pytest.raises(HeadsMismatchError, match=f"adapter {sha_a}.*no adapter.*`allow_adapter_mismatch`"):
        load_heads(tmp_path / "h", base, tokenizer)
    with pytest.raises(HeadsMismatchError, match=f"adapter {sha_a}.*adapter {sha_b}"):
        load_heads(tmp_path / "h", on_b, tokenizer)
    with pytest.warns(UserWarning, match="acceptance may drop"):  # the override: exact, maybe slower
        drafter = make_drafter("eagle", on_b, tokenizer, heads=str(tmp_path / "h"), allow_adapter_mismatch=True)
    on_b.generation_config.eos_token_id = None
    assert_greedy_identity(on_b, drafter, PROMPTS, max_new_tokens=16)


def test_unusable_adapters_are_refused_in_one_line(tiny_model_dir, tmp_path, capsys):
    def refuse(adapter, message):
        code = cli(
            [
                "generate",
                "--model",
                str(tiny_model_dir),
                "--prompt",
                "the cat",
                "--max-new-tokens",
                "4",
                "--raw",
                "--adapter",
                str(adapter),
            ]
        )
        errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("headstart: error")]
        assert code == 2 and len(errors) == 1 and message in errors[0], errors

    (tmp_path / "empty").mkdir()
    refuse(tmp_path / "empty", "is not a peft adapter directory (needs adapter_config.json")
    ia3 = save_lora(
        tiny_model_dir,
        tmp_path / "ia3",
        0,
        IA3Config(target_modules=["k_proj", "down_proj"], feedforward_modules=["down_proj"]),
    )
    refuse(ia3, "holds a IA3 adapter; headstart applies LoRA adapters only")
    other = tmp_path / "other-base"  # a LoRA made for a wider model: its weights do not fit
    wide = tiny_llama(vocab_size=len(WORDS))
    wider = type(wide)(LlamaConfig(**{**wide.config.to_dict(), "hidden_size": 96, "intermediate_size": 192}))
    get_peft_model(wider, LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False)).save_pretrained(other)
    refuse(other, "cannot apply the adapter in")
    bad = tmp_path / "bad-json"
    bad.mkdir()
    (bad / "adapter_config.json").write_text("{")
    (bad / "adapter_model.safetensors").write_bytes(b"")
    refuse(bad, "is not valid JSON")


def test_training_config_takes_an_adapter(tmp_path, capsys):
    from headstart.train import heads as train_heads

    smoke = str(Path(__file__).resolve().parents[1] / "configs" / "smoke.yaml")
    assert (
        train_heads.main(["--config", smoke, "heads.kind=eagle", "target.adapter=some/dir", f"output_dir={tmp_path}"])
        == 2
    )
    assert "the test model 'tiny' takes no adapter" in capsys.readouterr().err


def test_bench_methods_take_the_adapter(tiny_model_dir, adapters, tmp_path):
    """transformers' generate (`hf`) and our loop decode the same adapted model: the same greedy tokens."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "1", "category": "a", "turns": ["the cat sat on the mat"]}\n')
    out = tmp_path / "out"
    args = [
        "bench",
        "--model",
        str(tiny_model_dir),
        "--adapter",
        adapters["a"],
        "--dtype",
        "float32",
        "--prompts",
        str(prompts),
        "--methods",
        "plain,hf,lookup",
        "--max-new-tokens",
        "12",
        "--out",
        str(out),
    ]
    assert cli(args) == 0
    records = json.loads(next((tmp_path / "out").glob("bench-*.json")).read_text())["records"]
    assert all(r["same_as_plain"] for r in records if r["method"] != "plain")
