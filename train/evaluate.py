"""How well heads guess: per-rank hits at each drafting depth, and the metrics and rank accuracies made from them.

One measure serves training's held-out evaluation and `headstart calibrate` (heads measured on a user's
prompts): depth k at position t guesses the token k + 1 places ahead (Medusa: head k from the target's state
at t; EAGLE and EAGLE-3: the k-th drafting step from a root at t along the true tokens, every earlier guess
right, as `eagle_unroll` runs it). `rank_accuracy[k-1][r]` is the share of positions where depth k's r-th
ranked guess is right: what `runtime.tree.choose_tree_shape` shapes static trees from.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from headstart.train.data import Row, collate
from headstart.train.features import target_features
from headstart.train.losses import eagle_unroll, head_metrics, medusa_labels

MEDUSA_KINDS = ("medusa", "medusa2")
EVAL_TOPK = 5
RANKS = 10  # per-rank accuracies measured for choosing tree shapes

Readout = Callable[[torch.Tensor], torch.Tensor]  # (..., H) -> (..., N) float32 logits over the draft vocabulary


def feature_layers(kind: str, heads: nn.Module) -> tuple[int, ...]:
    """The target hidden states the kind reads: EAGLE-3 its three fused layers and the final feature (for p)."""
    return (*heads.feature_layers, -1) if kind == "eagle3" else (-1,)


def depth_logits(
    kind: str, heads: nn.Module, hidden: torch.Tensor, ids: torch.Tensor, depths: int, readout: Readout, embed
) -> list[torch.Tensor]:
    """[depth k = 1..depths]: logits (B, T', N) at each position t for the token k + 1 places ahead."""
    if kind in MEDUSA_KINDS:
        feats = heads.features(hidden)
        return [heads.head_logits(k, feats[k - 1], readout) for k in range(1, depths + 1)]
    if kind == "eagle3":  # the fused layers in, the head's own readout out
        H = hidden.shape[-1] // 4
        outs = eagle_unroll(heads, hidden[:, :-1, : 3 * H], embed(ids[:, 1:]), depths)
        return [heads.logits(out[:, k - 1 :]).float() for k, out in enumerate(outs, 1)]
    outs = eagle_unroll(heads, hidden[:, :-1], embed(ids[:, 1:]), depths)  # out_k[s]: root s - k + 1
    return [readout(out[:, k - 1 :]) for k, out in enumerate(outs, 1)]  # re-indexed by root


def rank_hits(
    kind: str,
    heads: nn.Module,
    hidden: torch.Tensor,  # (B, T, F) the target's features `feature_layers` of `ids`
    ids: torch.Tensor,  # (B, T)
    loss_mask: torch.Tensor,  # (B, T) True on answer tokens
    depths: int,
    readout: Readout,
    embed,
    to_target: Callable[[torch.Tensor], torch.Tensor],
) -> list[torch.Tensor]:
    """[depth k]: (n, R) bools, whether depth k's r-th guess is right, over the n positions where every depth
    has an answer token to guess (the same positions for all depths); [] when the batch is too short."""
    n = ids.shape[1] - depths - 1  # positions t that have labels t+2 .. t+depths+1
    if n <= 0:
        return []
    valid = torch.stack([medusa_labels(ids, loss_mask, k)[1][:, :n] for k in range(1, depths + 1)]).all(0)
    hits = []
    for k, logits in enumerate(depth_logits(kind, heads, hidden, ids, depths, readout, embed), 1):
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
    readout_module = heads.readout(model.get_output_embeddings())
    embed = model.get_input_embeddings()
    layers = feature_layers(kind, heads)
    hits: list[list[torch.Tensor]] = [[] for _ in range(depths)]
    for start in range(0, len(rows), batch_rows):
        batch = {k: v.to(model.device) for k, v in collate(rows[start : start + batch_rows], pad).items()}
        hidden = target_features(model, batch["input_ids"], batch["attention_mask"], layers).float()
        found = rank_hits(kind, heads, hidden, batch["input_ids"], batch["loss_mask"], depths,
                          lambda x: readout_module(x).float(), lambda t: embed(t).float(),
                          readout_module.to_target)  # fmt: skip
        for k, h in enumerate(found):
            hits[k].append(h)
    if not hits[0] or not sum(len(h) for h in hits[0]):
        raise ValueError(f"no answer is long enough to score {depths} drafting depths: raise max_new_tokens")
    return summarize(hits)
