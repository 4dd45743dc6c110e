"""Every registered drafter built for one tiny target: the set-up of the drafter contract and the sync count.

The target is a tiny random Llama over 8 tokens, peaked enough for drafts to be accepted; Medusa and EAGLE
use random heads (exactness must not depend on the heads' quality) with made-up per-rank accuracies; the
draft model is the target's first layer saved as a model of its own.
"""

from __future__ import annotations

from pathlib import Path

from headstart.heads.checkpoint import save_heads, target_fingerprint
from headstart.runtime.drafters.model import layerskip_model
from headstart.runtime.drafters.registry import make_drafter
from helpers.exactness import random_heads, sampling_model
from helpers.models import WORDS, tiny_tokenizer

ACCURACY = {"medusa": [[0.5, 0.2, 0.1], [0.4, 0.2], [0.3]], "eagle": [[0.5, 0.3], [0.4, 0.3], [0.5]]}
ACCURACY["eagle3"], ACCURACY["medusa2"] = ACCURACY["eagle"], ACCURACY["medusa"]
# medusa2: Medusa heads whose target is this model as it stands (as if it were base + their adapter, merged;
# tests/test_medusa2.py loads a real base + adapter)
HEAD_OPTIONS = {"medusa": {"num_heads": 3}, "medusa2": {"num_heads": 3}, "eagle": {}, "eagle3": {}}
PROMPTS = [[1, 2, 3, 4, 1, 2, 3, 4, 1, 2], [5, 6, 7, 5, 6], [3, 1, 4, 1, 5]]


def drafter_setup(root: Path):
    """(model, tokenizer, {option: value} per drafter base) for the 8-token target; files go under `root`."""
    model = sampling_model()
    tokenizer = tiny_tokenizer(WORDS[:8])
    options = {"layerskip": {"draft_layers": 1}, "model": {"draft_model": str(root / "draft")}}
    layerskip_model(model, [0]).save_pretrained(root / "draft")
    tokenizer.save_pretrained(root / "draft")
    for kind in HEAD_OPTIONS:
        heads = random_heads(kind, model, 0.3 if kind.startswith("medusa") else 0.1, **HEAD_OPTIONS[kind])
        fingerprint = target_fingerprint(model, tokenizer)
        extra = {"rank_accuracy": ACCURACY[kind], "dtype": "float32"}
        save_heads(root / kind, heads, kind, HEAD_OPTIONS[kind], fingerprint, extra)
        options[kind] = {"heads": str(root / kind)}
    options["eagle3"]["min_prob"] = 0.3  # the same drafter class as eagle: its trees pruned below min_prob
    # the heads in the target's float32 (eagle) and in bfloat16 under it at every temperature (eagle3; auto takes
    # bfloat16 for greedy decodes on a CPU with bf16 kernels), whatever the CPU running the tests
    options["eagle"]["head_dtype"], options["eagle3"]["head_dtype"] = "target", "bfloat16"
    # draws from a q sharper (eagle3) and flatter (medusa2) than the decode's temperature gives: exact all the same
    options["eagle3"]["draft_temperature"], options["medusa2"]["draft_temperature"] = 0.5, 1.7
    return model, tokenizer, options


def build(name: str, setup: tuple, **overrides):
    """Drafter `name` for the tiny target, with its set-up's options; `overrides` of those its options hold."""
    model, tokenizer, options = setup
    own = options.get(name.partition("+")[0], {})
    return make_drafter(name, model, tokenizer, **{**own, **{k: v for k, v in overrides.items() if k in own}})
