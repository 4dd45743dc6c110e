"""`make test-speculators`: headstart's EAGLE-3 heads through speculators' own code (0.9.0, in its own venv).

1. The shipped head, exported with `--format speculators`, read by speculators' `Eagle3DraftModel.from_pretrained`
   and written back by its `save_pretrained`, loads in headstart with every tensor as shipped.
2. For each variant speculators writes (plain, EAGLE 3.1's fc_norm + norm_output, gpt-oss's norm_before_fc, five
   fused layers, two draft layers), speculators' own classes write a head for a tiny target and draft with their
   own forward (three steps of its training-time test, each on its previous step's output and the next token);
   headstart loads the head and drafts the same logits from the same roots (its KV cache, as in decoding).
3. headstart converts and exports that head again (`--format speculators`); speculators reads the export and
   drafts the same logits as before.

    python tests/engines/speculators_check.py --peer-python .venv-speculators/bin/python
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import torch

PEER = Path(__file__).with_name("speculators_peer.py")
VARIANTS = {
    "plain": {"layers": [2, 4, 5]},
    "eagle_3.1": {"layers": [2, 4, 5], "fc_norm": True, "norm_output": True},
    "gpt_oss": {"layers": [2, 4, 5], "norm_before_fc": True},
    "five_fused": {"layers": [1, 2, 4, 6, 7]},
    "two_draft_layers": {"layers": [2, 4, 5], "num_layers": 2, "norm_output": True},
}
ROOTS = range(0, 120, 11)  # roots whose next STEPS tokens lie in the 128 positions
TOLERANCE = 1e-4


def peer(python: str, *args: str) -> None:
    subprocess.run([python, str(PEER), *args], check=True)


def tiny_target(folder: Path):
    """A random 8-layer Llama (hidden 64, vocabulary 512) saved where speculators can read its config."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    model = LlamaForCausalLM(config).eval().requires_grad_(False)
    model.save_pretrained(folder)
    return model


@torch.no_grad()
def our_drafts(head, embed, hidden: torch.Tensor, input_ids: torch.Tensor, steps: int) -> dict:
    """headstart's draft logits at (step k, root t), drafted as decoding drafts: the prefix 0..t committed to the
    head's KV cache, then each step on the previous step's output and the next token at the next position (the
    true token t + k: speculators 0.9's forward teacher-forces the tokens of its training-time test)."""
    from transformers import DynamicCache

    readout = head.readout()
    out = {}
    for t in ROOTS:
        cache = DynamicCache()
        y = head(hidden[:, : t + 1], embed(input_ids[:, : t + 1]), torch.arange(t + 1)[None], cache=cache)[:, -1:]
        for k in range(steps):
            out[k, t] = readout(y[0, -1])
            if k + 1 < steps:
                token = input_ids[:, t + k + 1 : t + k + 2]
                y = head(y, embed(token), torch.tensor([[t + k + 1]]), cache=cache)
    return out


def compare(ours: dict, theirs: list[torch.Tensor]) -> float:
    worst = 0.0
    for (k, t), logits in ours.items():
        worst = max(worst, float((logits - theirs[k][t]).abs().max()))
    return worst


def main() -> int:
    from headstart.heads.checkpoint import shipped_heads
    from headstart.heads.export import export_heads
    from headstart.heads.load import load_heads
    from headstart.heads.published import convert_heads
    from headstart.runtime.models import DEFAULT_MODEL, load_model, resolve_model_dir

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--peer-python", required=True, help="the speculators venv's python")
    p.add_argument("--out", default="bench-results/speculators-check")
    args = p.parse_args()
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    failures = []

    # 1. the shipped head through speculators and back
    shipped = shipped_heads(DEFAULT_MODEL, "eagle3")
    # speculators' loader reads the verifier's embedding and lm_head: name the local copy (`--target DIR`), as a user
    # without the hub would
    model, tokenizer = load_model(DEFAULT_MODEL)
    verifier = str(resolve_model_dir(DEFAULT_MODEL))
    export_heads(
        shipped, out / "shipped-export", "speculators", verifier, embedding=model.get_input_embeddings().weight
    )
    peer(args.peer_python, "resave", str(out / "shipped-export"), str(out / "shipped-resaved"))
    with warnings.catch_warnings():
        warnings.simplefilter(
            "ignore"
        )  # speculators' loader keeps an embedding of its own: headstart uses the target's
        native, _ = load_heads(shipped, model, tokenizer)
        again, _ = load_heads(out / "shipped-resaved", model, tokenizer)
    a, b = native.state_dict(), again.state_dict()
    same = a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a) and again.variant() == native.variant()
    print(f"shipped head -> speculators -> headstart: {'every tensor as shipped' if same else 'DIFFERENT'}")
    failures += [] if same else ["shipped head"]

    # 2. and 3. speculators' variants, drafted by both
    target = tiny_target(out / "target")
    embed = target.get_input_embeddings()
    for name, variant in VARIANTS.items():
        folder = out / name
        peer(
            args.peer_python,
            "write",
            "--target",
            str(out / "target"),
            "--out",
            str(folder),
            "--variant",
            json.dumps({**variant, "draft_vocab": 64}),
        )
        saved = torch.load(folder / "drafts.pt")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the verifier's name is a folder of this run
            head, _ = load_heads(folder / "head", target)
            converted = convert_heads(folder / "head", folder / "converted", target)
        ours = our_drafts(head, embed, saved["hidden"], saved["input_ids"], len(saved["logits"]))
        diff = compare(ours, saved["logits"])
        export_heads(converted, folder / "export", "speculators", str(out / "target"), embedding=embed.weight)
        peer(
            args.peer_python,
            "drafts",
            "--head",
            str(folder / "export"),
            "--inputs",
            str(folder / "drafts.pt"),
            "--out",
            str(folder / "drafts-of-export.pt"),
        )
        back = torch.load(folder / "drafts-of-export.pt")["logits"]
        diff_back = max(float((x - y).abs().max()) for x, y in zip(back, saved["logits"], strict=True))
        ok = diff < TOLERANCE and diff_back < TOLERANCE and head.variant()["fc_norm"] == variant.get("fc_norm", False)
        print(
            f"{name:>16}: {json.dumps(head.variant())} fused {list(head.feature_layers)}; headstart vs speculators "
            f"drafts max |diff| {diff:.2e}; speculators on headstart's export {diff_back:.2e} "
            f"{'ok' if ok else 'FAILED'}"
        )
        failures += [] if ok else [name]
    print("speculators round trip:", "passed" if not failures else f"FAILED ({', '.join(failures)})")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
