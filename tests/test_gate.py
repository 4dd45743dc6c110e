"""The overfit gate: on a tiny target and a few rows, a head of each kind is trained until it nearly always agrees
with the target, then written in every layout it leaves headstart in and read back, with the same acceptance.

A loss mask that trains on the prompt, a vocabulary map that scrambles the draft rows or a fused layer read one
off all still train and load; they show here as a head that cannot reach the bar, or one that loses it on the way
through a layout.
"""

from __future__ import annotations

import warnings

import pytest

from headstart.heads.export import export_heads
from headstart.heads.load import load_heads
from headstart.runtime.models import load_model
from headstart.runtime.tokens import pad_id
from headstart.train.data import Row
from headstart.train.evaluate import measure
from helpers.exactness import fit_heads
from helpers.published import write_published
from helpers.training import greedy_rows

PROMPTS = [[5, 9, 14, 3], [22, 7, 7, 30, 11], [31, 2, 18], [12, 34, 6, 6, 9, 20]]  # the tiny vocabulary: 38 tokens
DEPTHS = 3
BAR = 0.9 * (DEPTHS + 1)  # acceptance length of a chain of DEPTHS drafts, at least 90 % of its best
# where each kind leaves headstart: its own checkpoint, the engines' EAGLE-3 layouts (exports), the authors' layouts
LAYOUTS = {"medusa": ["medusa"], "eagle": ["eagle"], "eagle3": ["specforge", "speculators", "eagle3-authors"]}


@pytest.mark.parametrize("kind", list(LAYOUTS))
def test_a_head_fitted_to_its_rows_keeps_its_acceptance_through_every_layout(tmp_path, tiny_model_dir, kind):
    model, tokenizer = load_model(str(tiny_model_dir))
    pairs = greedy_rows(model, PROMPTS, 24)
    rows = [Row(p + a, len(p), i, str(i)) for i, (p, a) in enumerate(pairs)]
    heads_dir = fit_heads(
        tmp_path / "fit", tiny_model_dir, kind, pairs, **{"optim.max_steps": 120, "heads.draft_vocab": 32}
    )

    def acceptance(directory) -> float:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # published layouts name another base model
            heads, _ = load_heads(directory, model, tokenizer)
        return measure(kind, heads.float(), model, rows, DEPTHS, pad_id(tokenizer))[0]["acceptance_length"]

    fitted = acceptance(heads_dir)
    assert fitted >= BAR, f"{kind} heads reach {fitted:.2f} on their own training rows (bar {BAR:.2f})"
    native, _ = load_heads(heads_dir, model, tokenizer)
    for layout in LAYOUTS[kind]:
        if layout in ("specforge", "speculators"):
            embedding = model.get_input_embeddings().weight if layout == "speculators" else None
            out = export_heads(heads_dir, tmp_path / layout, layout, verifier=str(tiny_model_dir), embedding=embedding)
        else:
            ids = {"aux_ids": list(native.feature_layers)} if kind == "eagle3" else {}  # the tiny target's clamped ones
            out = write_published(native, model, layout, tmp_path / layout, **ids)
        assert acceptance(out) == pytest.approx(fitted, abs=1e-9), layout
