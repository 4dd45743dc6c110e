"""Losses and per-head metrics for Medusa, EAGLE and EAGLE-3 heads on a frozen target's outputs.

Shapes: B rows, T positions, H hidden, V vocabulary, K heads. `hidden` is the target's final
hidden state after its final norm, `loss_mask` is True on the assistant's (response) tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from headstart.heads.eagle import EagleHead
from headstart.heads.masks import additive_mask, unroll_mask


def medusa_labels(input_ids: torch.Tensor, loss_mask: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Head k at position t is scored against token t+k+1, where that token is a response token."""
    return input_ids[:, k + 1 :], loss_mask[:, k + 1 :]


def medusa_loss(heads: nn.Module, hidden, lm_head, input_ids, loss_mask, num_heads: int, to_draft=None) -> torch.Tensor:
    """Sum over heads k = 1..K of the mean cross-entropy of head k against token t+k+1.

    Logits are computed only at positions where some head has a label (the vocabulary projection
    dominates the cost), through the module's forward so that DDP sees every parameter used
    (`heads` may be DDP-wrapped, hence `num_heads` is passed). With a reduced draft vocabulary,
    `lm_head` scores only its N tokens and `to_draft` maps target ids to its indices (-1: not in
    it); labels outside it are left out of the loss.
    """
    B, T = input_ids.shape
    labels = torch.zeros(num_heads, B, T, dtype=torch.long, device=input_ids.device)
    valid = torch.zeros(num_heads, B, T, dtype=torch.bool, device=input_ids.device)
    for k in range(1, num_heads + 1):
        labels[k - 1, :, : T - k - 1], valid[k - 1, :, : T - k - 1] = medusa_labels(input_ids, loss_mask, k)
    if to_draft is not None:
        labels = to_draft(labels)
        valid &= labels >= 0
    used = valid.any(0)  # (B, T)
    logits = heads(hidden[used], lm_head)  # (K, N, V)
    total = hidden.new_zeros((), dtype=torch.float32)
    for k in range(num_heads):
        sel = valid[k][used]
        if sel.any():
            total = total + F.cross_entropy(logits[k][sel].float(), labels[k][used][sel])
    return total


def eagle_unroll(
    head: nn.Module,
    features: torch.Tensor,
    next_embeds: torch.Tensor,
    steps: int,
    scored: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """The head run `steps` times on its own outputs, as drafting does (EAGLE-3's "training-time test").

    Step 1 is causal over true features: out_1[s] ~ feature(s+1) from feature(s) and token s+1.
    Step k's input at s is out_{k-1}[s-1], the previous step's prediction of feature(s), beside the
    true token s+1; it attends as `unroll_mask` says, so out_k[s] ~ feature(s+1) predicted k steps
    after the root s - k + 1 with the true tokens in between (the chain where every earlier draft
    was right). An EAGLE-3 head's step 1 reads the target's three layers (B, T, 3H) through its fc; its
    later steps read its own outputs y, as drafting does.
    `scored` (B, T) bool: the positions a loss reads at every step. Step 1 runs everywhere (its entries are
    every later row's context); step k >= 2 runs only at the rows a scored row's chain passes through
    (`unrolled_rows`), packed, and is zero elsewhere: the same values where scored, a fraction of the work
    where most of a batch is prompt. None: every position.
    Returns [out_1, ..., out_steps], each (B, T, H).
    """
    from transformers import DynamicCache

    B, T, _ = features.shape
    positions = torch.arange(T, device=features.device)[None].expand(B, T)
    cache = DynamicCache()
    outs = [head(features, next_embeds, positions, None, cache=cache)]
    if scored is None:
        for step in range(2, steps + 1):
            mask = additive_mask(unroll_mask(T, step), features.dtype, features.device)
            outs.append(head(F.pad(outs[-1][:, :-1], (0, 0, 1, 0)), next_embeds, positions, mask, cache=cache))
        return outs
    keys = [positions]  # (B, n_m): the position of each entry step m wrote, 2T for padding
    rows, out = positions.contiguous(), outs[0]
    for step in range(2, steps + 1):
        below = rows
        rows = unrolled_rows(scored, step, steps)  # (B, n) ascending, padded with 2T
        at = torch.searchsorted(below, rows - 1).clamp(max=below.shape[1] - 1)  # out_{k-1}[s-1]'s entry
        found = (below.gather(1, at) == rows - 1)[..., None]
        inputs = torch.where(found, out.gather(1, at[..., None].expand(-1, -1, out.shape[-1])), 0)
        real = rows.clamp(max=T - 1)
        allowed = [positions[:, None, :] <= rows[..., None] - step + 1]  # step 1's entries up to the root
        allowed += [keys[m - 1][:, None, :] == rows[..., None] - step + m for m in range(2, step)]
        allowed.append(rows[..., None] == rows[:, None, :])  # its own entry (padding rows: each other's)
        mask = additive_mask(torch.cat(allowed, dim=-1), features.dtype, features.device)
        embeds = next_embeds.gather(1, real[..., None].expand(-1, -1, next_embeds.shape[-1]))
        out = head(inputs, embeds, real, mask, cache=cache)  # (B, n, H)
        keys.append(rows)
        dense = out.new_zeros(B, T + 1, out.shape[-1])  # column T takes the padding rows
        outs.append(dense.scatter(1, rows.clamp(max=T)[..., None].expand_as(out), out)[:, :T])
    return outs


def unrolled_rows(scored: torch.Tensor, step: int, steps: int) -> torch.Tensor:
    """(B, n) the positions step `step` of `steps` runs at, ascending, padded with 2T: s where some scored
    row of a step k >= step passes, s + d scored for d in 0..steps - step. Each such s has s - 1 among step
    `step - 1`'s rows, so a chain never leaves the packed rows."""
    T = scored.shape[1]
    hit = scored.clone()
    for d in range(1, steps - step + 1):
        hit[:, :-d] |= scored[:, d:]
    n = max(int(hit.sum(1).max()), 1)
    past = torch.full_like(scored, 2 * T, dtype=torch.long)
    at = torch.where(hit, torch.arange(T, device=scored.device)[None], past)
    return at.sort(1).values[:, :n]


def eagle_loss(
    head: EagleHead,
    hidden: torch.Tensor,  # (B, T, H) target features
    embed: nn.Module,
    lm_head: nn.Module,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    noise: float = 0.0,
    ce_weight: float = 0.1,
    unroll: int = 1,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Mean over unroll steps of SmoothL1 on the next feature + ce_weight * cross-entropy against the
    target's next-token distribution (p); step k is scored where it has a root (s >= k - 1)."""
    features = hidden[:, :-1]
    if noise:
        features = features + (torch.rand_like(features) - 0.5) * noise  # uniform U(-noise/2, noise/2)
    valid = loss_mask[:, 1:]
    preds = eagle_unroll(head, features, embed(input_ids[:, 1:]), unroll, valid)  # unroll x (B, T-1, H) ~ hidden[:, 1:]
    if not valid.any():
        zero = sum(pred.sum() for pred in preds) * 0
        return zero, {"feature_loss": zero, "ce_loss": zero}
    truth = hidden[:, 1:][valid]  # (N, H)
    with torch.no_grad():
        p = lm_head(truth).float().softmax(-1)  # the target's distribution of token t+2
    feature_loss = ce_loss = hidden.new_zeros((), dtype=torch.float32)
    for k, pred in enumerate(preds):
        rooted = valid.clone()
        rooted[:, :k] = False  # step k+1 at s needs a root at s - k >= 0
        keep = rooted[valid]  # (N,)
        if not keep.any():
            continue
        feature_loss = feature_loss + F.smooth_l1_loss(pred[rooted].float(), truth[keep].float()) / unroll
        log_q = lm_head(pred[rooted]).float().log_softmax(-1)
        ce_loss = ce_loss - (p[keep] * log_q).sum(-1).mean() / unroll
    return feature_loss + ce_weight * ce_loss, {"feature_loss": feature_loss, "ce_loss": ce_loss}


EAGLE3_STEP_DECAY = 0.8  # step k of the training-time test weighs 0.8^k, as in the EAGLE-3 reference


def eagle3_loss(
    head: nn.Module,
    hidden: torch.Tensor,  # (B, T, kH + H): the k fused layers (fused_width values), then the final feature
    embed: nn.Module,
    logits: nn.Module,  # the head's own readout: (..., H) -> (..., N) draft logits (Eagle3Head.logits)
    target_readout: nn.Module,  # the target's lm_head over the draft vocabulary: (..., H) -> (..., N)
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    unroll: int = 1,
    to_draft=None,
    *,
    fused_width: int,  # kH: the head's fc input (`hidden`'s first values)
) -> torch.Tensor:
    """EAGLE-3's loss: for each unrolled step k (0-based, weight 0.8^k, normalised), the soft cross-entropy
    of the head's draft distribution q against the target's next-token distribution p restricted to the
    draft vocabulary (renormalised over it), at response positions whose next token lies in the draft
    vocabulary (p of a token the head cannot propose teaches it nothing). Step k at s needs a root at s - k.
    """
    fused, final = hidden[:, :-1, :fused_width], hidden[:, 1:, fused_width:]  # out_k[s]: token s + 2, p from s + 1
    valid = loss_mask[:, 1:].clone()
    if to_draft is not None:
        valid &= to_draft(F.pad(input_ids[:, 2:], (0, 1))) >= 0  # the last position has no next token: padded
    outs = eagle_unroll(head, fused, embed(input_ids[:, 1:]), unroll, valid)
    if not valid.any():
        return sum(out.sum() for out in outs) * 0
    with torch.no_grad():
        p = target_readout(final[valid]).float().softmax(-1)  # (M, N)
    total = hidden.new_zeros((), dtype=torch.float32)
    weights = [EAGLE3_STEP_DECAY**k for k in range(unroll)]
    for k, out in enumerate(outs):
        rooted = valid.clone()
        rooted[:, :k] = False
        keep = rooted[valid]
        if keep.any():
            log_q = logits(out[rooted]).float().log_softmax(-1)
            total = total - weights[k] * (p[keep] * log_q).sum(-1).mean()
    return total / sum(weights)


def head_metrics(correct_top1: list[torch.Tensor], correct_top5: list[torch.Tensor]) -> dict[str, float]:
    """Metrics named as in DESIGN.md from per-head boolean hit tensors over the same positions (N,).

    head_{k}/acceptance is the share of positions where head k is right given heads < k were right;
    acceptance_length = 1 + sum_k prod_{j<=k} acceptance_j (a chain of top-1 guesses).
    """
    metrics: dict[str, float] = {}
    alive = torch.ones_like(correct_top1[0])
    expected, prod = 1.0, 1.0
    for k, (top1, top5) in enumerate(zip(correct_top1, correct_top5, strict=True), 1):
        metrics[f"head_{k}/top1"] = top1.float().mean().item()
        metrics[f"head_{k}/top5"] = top5.float().mean().item()
        acceptance = (top1 & alive).sum().item() / max(alive.sum().item(), 1)
        metrics[f"head_{k}/acceptance"] = acceptance
        prod *= acceptance
        expected += prod
        alive = alive & top1
    metrics["acceptance_length"] = expected
    return metrics
