"""speculators' side of `make test-speculators`: run inside the speculators venv (speculators 0.9.0), never imports
headstart. Its own classes write heads of each EAGLE-3 variant, draft with its own forward, and read and write
back heads headstart exported.

    python speculators_peer.py write --target DIR --variant JSON --out DIR     # a head of that variant + its drafts
    python speculators_peer.py drafts --head DIR --inputs FILE --out FILE      # its forward on saved inputs
    python speculators_peer.py resave SRC DST                                  # from_pretrained, then save_pretrained
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import load_file
from speculators.config import SpeculatorsConfig, VerifierConfig
from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
from speculators.proposals.greedy import GreedyTokenProposalConfig
from transformers import AutoConfig, LlamaConfig

T = 128  # speculators' block masks come in blocks of 128 positions
STEPS = 3  # its training-time test: step k drafts from step k - 1's output and the true token k ahead


def drafts(model: Eagle3DraftModel, hidden: torch.Tensor, input_ids: torch.Tensor) -> list[torch.Tensor]:
    """The draft logits (T, N) of each of STEPS steps of the model's own forward (0.9 teacher-forces the tokens)."""
    caught: list[torch.Tensor] = []
    hook = model.lm_head.register_forward_hook(lambda module, args, out: caught.append(out.detach()[0]))
    with torch.no_grad():
        model(hidden, input_ids, document_ids=torch.zeros_like(input_ids), ttt_steps=STEPS)
    hook.remove()
    return caught


def write(target: Path, variant: dict, out: Path) -> None:
    tc = AutoConfig.from_pretrained(target)
    layer = LlamaConfig(
        vocab_size=tc.vocab_size,
        hidden_size=tc.hidden_size,
        intermediate_size=tc.intermediate_size,
        num_hidden_layers=variant.get("num_layers", 1),
        num_attention_heads=tc.num_attention_heads,
        num_key_value_heads=tc.num_key_value_heads,
        head_dim=tc.hidden_size // tc.num_attention_heads,
        rms_norm_eps=tc.rms_norm_eps,
        max_position_embeddings=tc.max_position_embeddings,
    )
    ids = variant["layers"]
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer,
        draft_vocab_size=variant["draft_vocab"],
        norm_before_residual=variant.get("norm_before_residual", True),
        eagle_aux_hidden_state_layer_ids=ids,
        fc_norm=variant.get("fc_norm", False),
        norm_before_fc=variant.get("norm_before_fc", False),
        norm_output=variant.get("norm_output", False),
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=STEPS)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=str(target), architectures=["LlamaForCausalLM"]),
        ),
    )
    model = Eagle3DraftModel(config)
    gen = torch.Generator().manual_seed(0)
    for p in model.parameters():
        p.data.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    n, vocab = variant["draft_vocab"], tc.vocab_size
    chosen = torch.randperm(vocab, generator=gen)[:n].sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[chosen] = True
    model.load_vocab_mappings(t2d, chosen - torch.arange(n))
    weights = load_file(target / "model.safetensors")
    model.embed_tokens.weight.data.copy_(weights["model.embed_tokens.weight"])  # the target's, as the engines use
    model.save_pretrained(out / "head")
    hidden = torch.randn(1, T, len(ids) * tc.hidden_size, generator=gen)
    input_ids = torch.randint(0, vocab, (1, T), generator=gen)
    torch.save(
        {"hidden": hidden, "input_ids": input_ids, "logits": drafts(model, hidden, input_ids)}, out / "drafts.pt"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write")
    w.add_argument("--target", type=Path, required=True)
    w.add_argument("--variant", required=True)
    w.add_argument("--out", type=Path, required=True)
    d = sub.add_parser("drafts")
    d.add_argument("--head", required=True)
    d.add_argument("--inputs", type=Path, required=True)
    d.add_argument("--out", type=Path, required=True)
    r = sub.add_parser("resave")
    r.add_argument("src")
    r.add_argument("dst")
    args = p.parse_args()
    if args.cmd == "write":
        write(args.target, json.loads(args.variant), args.out)
    elif args.cmd == "drafts":
        inputs = torch.load(args.inputs)
        model = Eagle3DraftModel.from_pretrained(args.head).float().eval()
        torch.save({"logits": drafts(model, inputs["hidden"], inputs["input_ids"])}, args.out)
    else:
        Eagle3DraftModel.from_pretrained(args.src).save_pretrained(args.dst)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
