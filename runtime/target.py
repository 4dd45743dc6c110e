"""Target: a frozen Hugging Face causal LM with a KV cache that verifies draft trees.

Cache convention: the cache holds every token of the sequence except the last one, the *root*.
Each round feeds the root plus the draft tree in one forward (`verify`), then keeps the root and
the accepted nodes in the cache (`commit`); the correction/bonus token becomes the next root.
Plain decoding is the same round with an empty tree: one forward over the root.
No modeling file is copied: the model's own forward runs with a float 4D tree mask and explicit
position ids. The fast path (on by default) is in three small pieces: a preallocated cache that commits a branch
by moving only its rows (runtime/kvcache.py), prepacked linear kernels (runtime/kernels.py) and grouped-query
attention that does not copy the cache for a tree (runtime/attention.py); the forward, the masks and the loop are
the same with it off.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from headstart.runtime.attention import AttentionLayout, MaskBuffer, use_grouped_sdpa
from headstart.runtime.kernels import Prepacked, prepack_linears
from headstart.runtime.kvcache import TargetCache
from headstart.runtime.tree import DraftTree, tree_visibility


@dataclass
class Verified:
    logits: torch.Tensor  # (n+1, V) target logits at the root and at every node
    hidden: torch.Tensor | None  # (n+1, F) the drafter's features at the same positions (`features`); None: none asked
    mask_s: float = 0.0  # seconds spent building the tree mask (the round-cost breakdown reads it)
    lm_head_s: float = 0.0  # of the forward, seconds in the lm_head (measured only under `Target.timing_lm_head`)


def features(hidden_states: tuple[torch.Tensor, ...], layers: tuple[int, ...]) -> torch.Tensor:
    """The hidden states `layers` names (indices into `output_hidden_states`: k = after k decoder layers,
    -1 = the last, after the final norm), concatenated: (..., len(layers) * H)."""
    if layers == (-1,):
        return hidden_states[-1]
    return torch.cat([hidden_states[k] for k in layers], dim=-1)


class Target:
    prepack_default = True  # `fast` when not given (the test suite's --no-prepack turns it off)

    def __init__(self, model: PreTrainedModel, fast: bool | None = None) -> None:
        """`fast`: prepack the model's linear layers in place (CPU; `runtime/kernels.py`), once (`packed` says how
        and in how many seconds), trees then padded to the row counts the packed kernels are made for; and attend
        to a tree with grouped-query SDPA (`grouped` says whether; runtime/attention.py)."""
        fast = self.prepack_default if fast is None else fast
        self.model = model.eval().requires_grad_(False)
        self.device = model.device
        self.dtype = model.dtype
        self.max_len = getattr(model.config, "max_position_embeddings", None) or 1 << 30
        self.layout = AttentionLayout(model.config)
        self.packed = prepack_linears(model) if fast else Prepacked()
        self.grouped = use_grouped_sdpa(model) if fast else False
        self._fed = 0  # rows the last `verify` fed: the root, the tree, any padding
        self._lm_head_clock: list[float] | None = None  # [start, seconds] while `timing_lm_head` is on
        self.cache = TargetCache()  # full on every layer, sliding-window ones too (runtime/attention.py)
        self.mask_buffer = MaskBuffer(self.dtype, self.device)

    def use_kernels(self, kind: str) -> None:
        """Pack the linear layers again as `kind` (float32: one of `kernels.FP32_KINDS`) where they are packed."""
        if self.packed.kind != "none":
            self.packed = prepack_linears(self.model, kind)

    @property
    def past_len(self) -> int:
        """Tokens committed to the KV cache."""
        return self.cache.get_seq_length()

    @torch.inference_mode()
    def prefill(self, token_ids: list[int], layers: tuple[int, ...] = (-1,)) -> torch.Tensor | None:
        """Start a new sequence: cache `token_ids` (every prompt token but the last, the first root).

        Returns their features (len, F) from the hidden states `layers`, or None when there are none.
        """
        self.cache = TargetCache()
        if not token_ids:
            return None
        ids = torch.tensor([token_ids], device=self.device)
        out = self.model(input_ids=ids, cache=self.cache, use_cache=True, output_hidden_states=bool(layers),
                         logits_to_keep=1)  # fmt: skip
        return features(out.hidden_states, layers)[0] if layers else None

    def _padded(self, tree: DraftTree, past: int) -> DraftTree:
        """`tree` with extra children of the root (token 0) up to the next row bucket of the packed kernels, if
        any: the model scores them, nothing reads them, and `commit` drops them like any rejected node."""
        rows = len(tree) + 1
        bucket = next((b for b in self.packed.row_buckets if b >= rows), rows) if len(tree) else rows
        if bucket == rows or past + bucket > self.max_len:
            return tree
        return DraftTree([*tree.tokens, *[0] * (bucket - rows)], [*tree.parents, *[-1] * (bucket - rows)])

    @torch.inference_mode()
    def verify(self, root: int, tree: DraftTree, layers: tuple[int, ...] = (-1,)) -> Verified:
        """Score the root and every node of `tree` in one forward: (n+1) rows of logits and features. The cache
        grows by the rows fed (n + 1, or a padded count) until `commit`."""
        past, n = self.past_len, len(tree)
        tree = self._padded(tree, past)
        self._fed = len(tree) + 1
        ids = torch.tensor([[root, *tree.tokens]], device=self.device)  # (1, rows)
        t0 = time.perf_counter()
        if len(tree) and self.layout.window is None:  # only the tree's block of the mask is written
            mask = self.mask_buffer.mask(tree.ancestor_mask(), past)  # (1, 1, rows, past + rows)
            positions = torch.tensor([[past, *(past + d for d in tree.depths)]], device=self.device)
        elif len(tree):  # sliding windows: which prefix keys a row sees depends on the row
            allowed, positions = tree_visibility(tree, past)  # (n+1, past+n+1), (n+1,)
            mask = self.layout.masks(allowed, positions, past, self.dtype, self.device)
            positions = positions[None].to(self.device)
        else:  # plain decoding step: one query, the model masks it as its own forward would
            mask, positions = None, torch.tensor([[past]], device=self.device)
        mask_s = time.perf_counter() - t0
        clock = self._lm_head_clock
        if clock is not None:
            clock[1] = 0.0
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            cache=self.cache,
            use_cache=True,
            output_hidden_states=bool(layers),
        )
        hidden = features(out.hidden_states, layers)[0, : n + 1] if layers else None
        lm_head_s = clock[1] if clock is not None else 0.0
        return Verified(logits=out.logits[0, : n + 1], hidden=hidden, mask_s=mask_s, lm_head_s=lm_head_s)

    @contextmanager
    def timing_lm_head(self) -> Iterator[None]:
        """Within this block each `verify` also reports the seconds its forward spent in the lm_head (forward
        hooks; on CUDA they synchronise, so time what you compare under the same block)."""
        head = self.model.get_output_embeddings()
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        self._lm_head_clock = clock = [0.0, 0.0]

        def start(module, args):
            sync()
            clock[0] = time.perf_counter()

        def stop(module, args, output):
            sync()
            clock[1] += time.perf_counter() - clock[0]

        hooks = [head.register_forward_pre_hook(start), head.register_forward_hook(stop)]
        try:
            yield
        finally:
            for hook in hooks:
                hook.remove()
            self._lm_head_clock = None

    @torch.inference_mode()
    def commit(self, path: list[int]) -> None:
        """After a `verify`, keep the root and the accepted `path` (node indices) in the cache, drop the rest."""
        n_fed, self._fed = self._fed, 0
        drop = n_fed - 1 - len(path)
        if path == list(range(len(path))):  # accepted nodes lie right after the root: just crop the tail
            if drop:
                self.cache.crop(-drop)
            return
        root_pos = self.past_len - n_fed
        nodes = torch.tensor(path, device=self.device) + root_pos + 1  # (len(path),) rows of the accepted nodes
        self.cache.keep_rows(root_pos + 1, nodes)  # prefix and root stay where they are; only the path moves
