"""Chi-square goodness of fit for the sampling tests (no scipy: the survival function is torch's gammaincc)."""

from __future__ import annotations

import torch


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """p-value of observed `counts` under cell probabilities `probs` (flattened).

    Cells expected to hold fewer than `min_expected` samples are pooled into one, as the chi-square
    approximation needs.
    """
    counts = counts.flatten().double()
    probs = probs.flatten().double()
    n = counts.sum()
    expected = probs * n
    small = expected < min_expected
    obs = torch.cat([counts[~small], counts[small].sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = ((obs - exp) ** 2 / exp).sum()
    dof = len(obs) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), stat / 2))
