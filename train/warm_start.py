"""Warm starts: a training run that begins from trained heads (`heads.init_from`), their draft vocabulary
recomputed from the new data (or kept, `heads.keep_vocab`)."""

from __future__ import annotations

import sys

import torch
from torch import nn

from headstart.heads.load import load_heads
from headstart.train.config import ConfigError


def init_from_trained(heads: nn.Module, directory: str, model, tokenizer, keep_vocab: bool = False) -> dict:
    """Copy the weights of the trained heads in `directory` into `heads`, all but the draft vocabulary.

    Medusa and EAGLE predict hidden states that the target's lm_head reads out, so their weights do not
    depend on which tokens the readout scores: a run on new data recomputes the vocabulary from that
    data and starts from these weights. An EAGLE-3 head's own lm_head has a row per draft token: the
    rows move with their tokens (`carry_rows`), so its vocabulary is recomputed too (and may grow).
    With `keep_vocab` the trained vocabulary is taken as it is (a smaller data set than the one that
    chose it would choose worse), so every lm_head row is kept.
    """
    try:
        trained, config = load_heads(directory, model, tokenizer)
        if keep_vocab:
            own = heads.draft_vocab
            if trained.draft_vocab is None or own is None or len(trained.draft_vocab) != len(own):
                size = "all tokens" if trained.draft_vocab is None else f"{len(trained.draft_vocab):,} tokens"
                raise ConfigError(f"heads.keep_vocab: {directory} drafts {size}; set heads.draft_vocab to that size")
            own.copy_(trained.draft_vocab.to(own))
        state = {k: v for k, v in trained.state_dict().items() if k != "draft_vocab"}
        if hasattr(trained, "lm_head"):  # EAGLE-3
            state["lm_head.weight"], carried = carry_rows(trained, heads)
            n = len(state["lm_head.weight"])
            print(
                f"headstart: heads.init_from: {carried:,} of {n:,} draft tokens keep their trained lm_head rows, "
                "the others start from the target's",
                file=sys.stderr,
                flush=True,
            )
        missing, unexpected = heads.load_state_dict(state, strict=False)
    except ConfigError:
        raise
    except (ValueError, RuntimeError) as e:  # not a checkpoint, another target, other shapes
        raise ConfigError(f"heads.init_from: cannot start from {directory}: {e}") from e
    if unexpected or set(missing) - {"draft_vocab"}:
        raise ConfigError(f"heads.init_from: {directory} holds other heads (missing {missing}, extra {unexpected})")
    history = {k: config.extra[k] for k in ("steps", "data_rows", "init_from") if k in config.extra}
    return {"path": str(directory), **history}  # recorded in the new heads' config.json


def carry_rows(trained: nn.Module, heads: nn.Module) -> tuple[torch.Tensor, int]:
    """`heads`' lm_head rows (N, H) with the row of every draft token `trained` also drafts taken from `trained`
    (the others as they are: the target's rows); and how many were taken. A None vocabulary is the whole one."""
    rows = heads.lm_head.weight.detach().clone()  # (N, H)
    old = trained.lm_head.weight.detach().to(rows)  # (N_old, H)
    if old.shape[1] != rows.shape[1]:
        raise ValueError(f"its lm_head reads {old.shape[1]} values, these heads' {rows.shape[1]}")
    new_vocab = heads.draft_vocab if heads.draft_vocab is not None else torch.arange(len(rows))
    old_vocab = trained.draft_vocab.cpu() if trained.draft_vocab is not None else torch.arange(len(old))
    slot = torch.full((max(int(new_vocab.max()), int(old_vocab.max())) + 1,), -1)  # token -> its row in `old`
    slot[old_vocab] = torch.arange(len(old_vocab))
    found = slot[new_vocab.cpu()]  # (N,)
    kept = found >= 0
    rows[kept.to(rows.device)] = old[found[kept].to(old.device)]
    return rows, int(kept.sum())
