"""How well heads guess: per-rank hits at each drafting depth, and the metrics and rank accuracies made from them.

One measure serves training's held-out evaluation and `headstart calibrate` (heads measured on a user's
prompts): depth k at position t guesses the token k + 1 places ahead (Medusa: head k from the target's state
at t; EAGLE and EAGLE-3: the k-th drafting step from a root at t along the true tokens, every earlier guess
right, as `eagle_unroll` runs it): each kind's `depth_logits` (heads/kinds.py). `rank_accuracy[k-1][r]` is the
share of positions where depth k's r-th ranked guess is right: what `runtime.tree.choose_tree_shape` shapes
static trees from.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from headstart.heads.kinds import Tools, get_kind
from headstart.heads.losses import head_metrics, medusa_labels
from headstart.train.data import Row, collate
from headstart.train.features import target_features

EVAL_TOPK = 5
RANKS = 10  # per-rank accuracies measured for choosing tree shapes


def rank_hits(
    kind: str,
    heads: nn.Module,
    hidden: torch.Tensor,  # (B, T, F) the target's features of `ids` (the kind's `feature_layers`)
    ids: torch.Tensor,  # (B, T)
    loss_mask: torch.Tensor,  # (B, T) True on answer tokens
    depths: int,
    tools: Tools,
    to_target: Callable[[torch.Tensor], torch.Tensor],
) -> list[torch.Tensor]:
    """[depth k]: (n, R) bools, whether depth k's r-th guess is right, over the n positions where every depth
    has an answer token to guess (the same positions for all depths); [] when the batch is too short."""
    n = ids.shape[1] - depths - 1  # positions t that have labels t+2 .. t+depths+1
    if n <= 0:
        return []
    valid = torch.stack([medusa_labels(ids, loss_mask, k)[1][:, :n] for k in range(1, depths + 1)]).all(0)
    hits = []
    for k, logits in enumerate(get_kind(kind).depth_logits(heads, hidden, ids, depths, tools), 1):
        labels = medusa_labels(ids, loss_mask, k)[0][:, :n]
        top = logits[:, :n].topk(min(RANKS, logits.shape[-1]), dim=-1).indices  # a draft vocabulary < RANKS
        hits.append((to_target(top) == labels[..., None])[valid])
    return hits


def summarize(hits: list[list[torch.Tensor]]) -> tuple[dict[str, float], list[list[float]]]:
    """(metrics as DESIGN.md names them, rank_accuracy) from `rank_hits` gathered per depth over batches."""
    per_depth = [torch.cat(h) for h in hits]
    metrics = head_metrics([h[:, 0] for h in per_depth], [h[:, :EVAL_TOPK].any(-1) for h in per_depth])
    return metrics, [h.float().mean(0).tolist() for h in per_depth]


@torch.no_grad()
def measure(
    kind: str, heads: nn.Module, model: nn.Module, rows: list[Row], depths: int, pad: int, batch_rows: int = 8
) -> tuple[dict[str, float], list[list[float]]]:
    """`summarize` of the heads on `rows` (prompt + the target's answer) with the frozen `model`'s features."""
    readout = heads.readout(model.get_output_embeddings())
    embed = model.get_input_embeddings()
    tools = Tools(lambda x: readout(x).float(), lambda t: embed(t).float())
    layers = get_kind(kind).feature_layers(heads)
    hits: list[list[torch.Tensor]] = [[] for _ in range(depths)]
    for start in range(0, len(rows), batch_rows):
        batch = {k: v.to(model.device) for k, v in collate(rows[start : start + batch_rows], pad).items()}
        hidden = target_features(model, batch["input_ids"], batch["attention_mask"], layers).float()
        found = rank_hits(kind, heads, hidden, batch["input_ids"], batch["loss_mask"], depths, tools, readout.to_target)
        for k, h in enumerate(found):
            hits[k].append(h)
    if not hits[0] or not sum(len(h) for h in hits[0]):
        raise ValueError(f"no answer is long enough to score {depths} drafting depths: raise max_new_tokens")
    return summarize(hits)
