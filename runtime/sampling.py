"""Sampling settings, the logits processing shared by plain and speculative decoding, and the random source.

Plain sampling and `accept_path` both call `target_probs`, so the distribution speculative decoding
reproduces is by construction the one plain sampling draws from.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Temperatures below this decode greedily: dividing logits by a subnormal temperature overflows to inf
# (and the softmax to NaN), and the limit T -> 0 of sampling is the greedy choice anyway.
MIN_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 (or below MIN_TEMPERATURE) = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off

    def __post_init__(self) -> None:
        if not self.temperature >= 0 or self.temperature == float("inf"):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.temperature < MIN_TEMPERATURE:
            object.__setattr__(self, "temperature", 0.0)
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """(..., V) logits -> (..., V) probabilities p: temperature, then top-k, then top-p (as HF orders them).

    Computed in float32 at least (float64 stays float64, for the exact tests).
    """
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=False)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        # Drop the low tail whose total mass is <= 1 - top_p; the most likely token always stays.
        drop_sorted = cumulative <= 1 - params.top_p
        drop_sorted[..., -1] = False
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


class Rng:
    """The only source of randomness of a decode: a seeded `torch.Generator` behind two calls.

    Tests substitute an object with the same two methods to enumerate every random outcome.
    """

    def __init__(self, seed: int | None = None, device: torch.device | str = "cpu") -> None:
        self.generator = torch.Generator(device=device)
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)

    def bernoulli(self, prob: float) -> bool:
        """True with probability `prob`."""
        if prob >= 1:
            return True
        u = torch.rand((), generator=self.generator, device=self.generator.device)
        return bool(u < prob)

    def categorical(self, probs: torch.Tensor) -> int:
        """One index drawn from the (V,) distribution `probs` (need not be normalised)."""
        return int(draw(probs[None], self.generator)[0])


def draw(weights: torch.Tensor, generator: torch.Generator, cdf: torch.Tensor | None = None) -> torch.Tensor:
    """(m,) one index per row of `weights` (m, N) (need not be normalised), index i with probability
    weights_i / total: the first index whose cumulative weight exceeds u * total (`cdf`: weights.cumsum(-1), if
    already computed). One cumulative sum per row and no host sync; `torch.multinomial` costs ~1.5 ms for one
    draw over 49,152 tokens on a CPU, this ~0.05 ms. u * total is kept below total, so an index always exists; a
    CPU cumulative sum adds sequentially, so a zero weight never raises it and is never drawn. A parallel sum (a
    GPU's) may round a step up by an ulp at a zero weight: such a pick becomes the row's heaviest index instead
    (an ulp-wide event). Rows of total 0 get some index."""
    cdf = weights.cumsum(-1) if cdf is None else cdf  # (m, N)
    total = cdf[:, -1:]  # (m, 1)
    u = torch.rand(total.shape, generator=generator, device=cdf.device, dtype=cdf.dtype)
    below = torch.minimum(u * total, total.nextafter(torch.zeros_like(total)))  # (m, 1) in [0, total)
    pick = torch.searchsorted(cdf, below, right=True).clamp_max(cdf.shape[1] - 1)  # (m, 1)
    pick = torch.where(weights.gather(-1, pick) > 0, pick, weights.argmax(-1, keepdim=True))
    return pick[:, 0]
