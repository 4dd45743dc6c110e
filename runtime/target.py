"""Target: a frozen Hugging Face causal LM with a KV cache that verifies draft trees, for one sequence or many.

Cache convention: a sequence's cache holds every token except the last one, the *root*.
Each round feeds the root plus the draft tree in one forward (`verify`), then keeps the root and
the accepted nodes in the cache (`commit`); the correction/bonus token becomes the next root.
Plain decoding is the same round with an empty tree: one forward over the root.
Several sequences share a forward (`verify_batch`): each owns a slot of the cache (runtime/kvcache.py), its rows
packed end to end with the others' (padded to the widest tree's without the fast path's attention), every row
masked to its own sequence's keys.
No modeling file is copied: the model's own forward runs with a float 4D tree mask and explicit
position ids. The fast path (on by default) is in four small pieces: a preallocated cache that commits a branch
by moving only its rows (runtime/kvcache.py), prepacked linear kernels (runtime/kernels.py), grouped-query
attention that does not copy the cache for a tree (runtime/attention.py), and for Llama-style targets the same
layers run with fused products and few dispatches (runtime/fused.py); the masks and the loop are the same with it
off.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from headstart.runtime.attention import AttentionLayout, MaskBuffer, Packing, use_grouped_sdpa
from headstart.runtime.fused import FusedStack
from headstart.runtime.kernels import Prepacked, packing_kind, prepack_linears
from headstart.runtime.kvcache import SlotCache
from headstart.runtime.tree import DraftTree, tree_visibility


@dataclass
class Prefill:
    """A joiner's prompt tokens fed in a round's forward (`Target.verify_batch`), cached after what `slot` holds;
    `last`: they end the prompt (its last token, the first root: its logits come back)."""

    slot: int
    tokens: list[int]
    last: bool


@dataclass
class Verified:
    logits: torch.Tensor  # (n+1, V) target logits at the root and at every node; a prefill's: (1 or 0, V)
    hidden: torch.Tensor | None  # (n+1, F) the drafter's features at the same positions (`features`); None: none asked
    mask_s: float = 0.0  # seconds spent building the tree mask (the round-cost breakdown reads it)
    lm_head_s: float = 0.0  # of the forward, seconds in the lm_head (measured only under `Target.timing_lm_head`)


try:  # a list of indices selects hidden states (the others come back None) in transformers 5.2x; before, all
    from transformers.utils.output_capturing import selected_hidden_states  # noqa: F401

    _SELECTS_HIDDEN_STATES = True
except ImportError:
    _SELECTS_HIDDEN_STATES = False


def features(hidden_states: tuple[torch.Tensor, ...], layers: tuple[int, ...]) -> torch.Tensor:
    """The hidden states `layers` names (indices into `output_hidden_states`: k = after k decoder layers,
    -1 = the last, after the final norm), concatenated: (..., len(layers) * H)."""
    if layers == (-1,):
        return hidden_states[-1]
    return torch.cat([hidden_states[k] for k in layers], dim=-1)


def _hidden_states_wanted(layers: tuple[int, ...] | None) -> bool | list[int]:
    """`output_hidden_states` for `layers` (None: all): only those where transformers can select (the others come
    back None; a 16-prompt prefill then holds 1 of SmolLM2's 31 states for an EAGLE drafter, not 31: ~400 MB)."""
    if layers is None or not layers:
        return layers is None
    return list(layers) if _SELECTS_HIDDEN_STATES else True


class Target:
    prepack_default = True  # `fast` when not given (the test suite's --no-prepack turns it off)

    def __init__(self, model: PreTrainedModel, fast: bool | None = None, slots: int = 1) -> None:
        """`fast`: prepack the model's linear layers in place (CPU; `runtime/kernels.py`), once (`packed` says how
        and in how many seconds), and attend to a tree with grouped-query SDPA (`grouped` says whether;
        runtime/attention.py). `slots`: the sequences the cache holds at once (`verify_batch`)."""
        fast = self.prepack_default if fast is None else fast
        self.model = model.eval().requires_grad_(False)
        self.device = model.device
        self.dtype = model.dtype
        self.max_len = getattr(model.config, "max_position_embeddings", None) or 1 << 30
        self.layout = AttentionLayout(model.config)
        self.grouped = use_grouped_sdpa(model) if fast else False
        # a Llama-style model runs the fused stack (runtime/fused.py), whose products are packed there
        fusable = self.grouped and FusedStack.refusal(model) is None
        self.fused = FusedStack(model, packing_kind(model)) if fusable else None
        self.packed = prepack_linears(model, skip=self._fused_modules) if fast else Prepacked()
        self._lm_head_clock: list[float] | None = None  # [start, seconds] while `timing_lm_head` is on
        self.cache = SlotCache(slots)  # full on every layer, sliding-window ones too (runtime/attention.py)
        self.lengths = [0] * slots  # tokens committed per slot
        self._fed = [0] * slots  # rows the last `verify` fed per slot: the root, the tree, any padding
        self.mask_buffer = MaskBuffer(self.dtype, self.device)

    def use_kernels(self, kind: str) -> None:
        """Pack the linear layers again as `kind` (float32: one of `kernels.FP32_KINDS`) where they are packed."""
        if self.packed.kind != "none":
            self.packed = prepack_linears(self.model, kind, self._fused_modules)
            if self.fused is not None:
                self.fused.repack(self.packed.kind)

    @property
    def _fused_modules(self) -> frozenset[int]:
        """The linear layers the fused stack packs itself (prepack_linears leaves them)."""
        return self.fused.fused_modules if self.fused is not None else frozenset()

    @property
    def slots(self) -> int:
        return self.cache.slots

    def set_slots(self, slots: int) -> None:
        """Hold `slots` sequences at once from now on (nothing cached survives)."""
        self.cache, self.lengths, self._fed = SlotCache(slots), [0] * slots, [0] * slots

    @property
    def past_len(self) -> int:
        """Tokens committed to slot 0's cache."""
        return self.lengths[0]

    @torch.inference_mode()
    def prefill(self, token_ids: list[int], layers: tuple[int, ...] = (-1,), slot: int = 0) -> torch.Tensor | None:
        """Start a new sequence in `slot`: cache `token_ids` (every prompt token but the last, the first root).

        Returns their features (len, F) from the hidden states `layers`, or None when there are none.
        """
        self.lengths[slot] = 0
        return self.extend(token_ids, layers, slot)

    @torch.inference_mode()
    def extend(
        self, token_ids: list[int], layers: tuple[int, ...] | None = (-1,), slot: int = 0
    ) -> torch.Tensor | None:
        """Cache `token_ids` after what `slot` holds (a prefill in chunks); their features as `prefill`'s (`layers`
        None: every hidden state, (layers + 1, len, H))."""
        if not token_ids:
            return None
        past = self.lengths[slot]
        ids = torch.tensor([token_ids], device=self.device)
        positions = torch.arange(past, past + len(token_ids), device=self.device)[None]
        out = self._forward(ids, None, positions, layers, slot, [past], logits_to_keep=1)  # causal: the model's mask
        self.lengths[slot] = past + len(token_ids)
        if layers is None:
            return torch.stack(out.hidden_states)[:, 0]
        return features(out.hidden_states, layers)[0] if layers else None

    @torch.inference_mode()
    def extend_batch(
        self, chunks: list[list[int]], first: int, layers: tuple[int, ...] = (-1,)
    ) -> list[torch.Tensor | None]:
        """`extend` for slots first, first + 1, ... in one forward, chunk i after what slot first + i holds: rows
        right-padded to the longest chunk (padding is written past a slot's end, never counted, never seen by a
        real row); each row sees its own slot's rows up to itself. Each chunk's features as `extend`'s."""
        if len(chunks) == 1:
            return [self.extend(chunks[0], layers, first)]
        r, q = len(chunks), max(map(len, chunks))
        pasts = self.lengths[first : first + r]
        positions = torch.tensor(pasts)[:, None] + torch.arange(q)  # (r, q)
        key_pos = torch.arange(max(pasts) + q).expand(r, -1)  # (r, k): slot row j holds position j
        allowed = key_pos[:, None, :] <= positions[:, :, None]  # (r, q, k)
        mask = self.layout.batch_masks(allowed, positions, key_pos, self.dtype, self.device)
        ids = torch.tensor([(c or [0]) + [(c or [0])[-1]] * (q - max(len(c), 1)) for c in chunks], device=self.device)
        out = self._forward(ids, mask, positions.to(self.device), layers, first, pasts, logits_to_keep=1)
        for i, c in enumerate(chunks):
            self.lengths[first + i] = pasts[i] + len(c)
        hidden = features(out.hidden_states, layers) if layers else None  # (r, q, F)
        return [None if hidden is None or not c else hidden[i, : len(c)] for i, c in enumerate(chunks)]

    @torch.inference_mode()
    def verify(self, root: int, tree: DraftTree, layers: tuple[int, ...] = (-1,), slot: int = 0) -> Verified:
        """Score the root and every node of `tree` in one forward: (n+1) rows of logits and features. The slot's
        cache grows by the rows fed (n + 1) until `commit`."""
        past, n = self.lengths[slot], len(tree)
        rows = n + 1
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
        out = self._forward(ids, mask, positions, layers, slot, [past])
        self.lengths[slot], self._fed[slot] = past + rows, rows
        hidden = features(out.hidden_states, layers)[0, : n + 1] if layers else None
        return Verified(out.logits[0, : n + 1], hidden, mask_s, self._lm_head_s())

    @property
    def mixes_prefill(self) -> bool:
        """Whether a joiner's prompt can ride in a round's forward (`verify_batch(prefills=...)`): with the fast
        path's attention on a model without sliding windows."""
        return self.grouped and self.layout.window is None

    @torch.inference_mode()
    def verify_batch(
        self,
        roots: list[int],
        trees: list[DraftTree],
        layers: tuple[int, ...] = (-1,),
        prefills: list[Prefill] = (),
    ) -> list[Verified]:
        """`verify` for the sequences in slots 0, 1, ..., len(roots) - 1 in one forward: each feeds its root and
        tree; every row sees only its own sequence's committed keys and tree ancestors (and its window). With the
        fast path's attention, trees of different sizes are packed end to end (`attention.Packing`: the linear
        layers see only real rows, attention reads them padded); otherwise rows are padded to the widest tree
        (padding rows repeat the root and are never committed). One sequence: `verify`.

        `prefills` (`mixes_prefill` only): joiners' prompt chunks in the slots right after, fed in the same
        forward (its weights read once for both: 16 plain sequences' round with a ~300-token joiner, median of 24,
        240 ms mixed against 246 apart in float32, 171 against 182 in bfloat16); one `Verified` each after the
        trees': its chunk's features, and the logits of its last row where the chunk ends the prompt (its root: the
        joiner's first token comes from this round)."""
        if len(roots) == 1 and not prefills:
            return [self.verify(roots[0], trees[0], layers)]
        if prefills and not self.mixes_prefill:
            raise ValueError("prefills ride in a round only with the fast path's attention and no sliding window")
        r, q = len(roots), max(len(t) for t in trees) + 1
        # rows each sequence feeds: its own where trees differ in size and the attention unpacks; else all q (plain
        # batched steps, equal trees: packed and padded rows are then the same rows, without the index work)
        packed = self.grouped and (bool(prefills) or any(len(t) + 1 < q for t in trees))
        sizes = [len(t) + 1 if packed else q for t in trees]
        pasts = self.lengths[:r]
        chunks = [(self.lengths[p.slot], len(p.tokens)) for p in prefills]  # (past, rows) of each prefill
        if [p.slot for p in prefills] != list(range(r, r + len(prefills))):
            raise ValueError(f"prefills feed the slots after the {r} decoding ones, in order")
        t0 = time.perf_counter()
        kv_len = max([max(pasts) + q] + [past + n for past, n in chunks])
        allowed = torch.zeros(r, q, kv_len, dtype=torch.bool)
        positions = torch.zeros(r, q, dtype=torch.long)
        key_pos = torch.zeros(r, kv_len, dtype=torch.long)
        ids = torch.zeros(r, q, dtype=torch.long)
        for i, (root, tree, past) in enumerate(zip(roots, trees, pasts, strict=True)):
            n = len(tree)
            allowed[i, :, :past] = True
            allowed[i, : n + 1, past : past + n + 1] = tree.ancestor_mask()
            allowed[i, n + 1 :, past] = True  # padding rows see the root (and the prefix): nothing reads them
            depths = torch.tensor([0, *tree.depths] + [0] * (q - n - 1))
            positions[i] = past + depths
            key_pos[i, :past] = torch.arange(past)
            key_pos[i, past : past + q] = past + depths
            ids[i] = torch.tensor([root, *tree.tokens] + [root] * (q - n - 1))
        mask = self.layout.batch_masks(allowed, positions, key_pos, self.dtype, self.device)
        packing = Packing.of(sizes, self.device, chunks, self.dtype) if packed else None
        keep = 0  # logits of every row
        if packing is not None:  # (r, q) -> (1, N): each sequence's own rows, end to end, then the prefills'
            real = torch.arange(q)[None] < torch.tensor(sizes)[:, None]  # (r, q)
            ids = torch.cat([ids[real], *(torch.tensor(p.tokens) for p in prefills)])[None]
            positions = torch.cat([positions[real], *(torch.arange(past, past + n) for past, n in chunks)])[None]
            ends = list(itertools.accumulate([sum(sizes)] + [n for _, n in chunks]))[1:]  # each chunk's end row
            rows = list(range(sum(sizes))) + [end - 1 for p, end in zip(prefills, ends, strict=True) if p.last]
            keep = torch.tensor(rows, device=self.device) if prefills else 0
        mask_s = time.perf_counter() - t0
        fed = sizes + [n for _, n in chunks]
        starts = pasts + [past for past, _ in chunks]
        out = self._forward(
            ids.to(self.device), mask, positions.to(self.device), layers, 0, starts, fed, packing, keep, kv_len
        )
        for i, (start, n) in enumerate(zip(starts, fed, strict=True)):
            self.lengths[i] = start + n
        for i in range(r):
            self._fed[i] = sizes[i]
        hidden = features(out.hidden_states, layers) if layers else None  # (r, q, F) or (1, N, F)
        logits = out.logits if packing is None else out.logits[0].split(sizes + [1] * sum(p.last for p in prefills))
        if hidden is not None:
            hidden = hidden if packing is None else hidden[0].split(fed)
        lm_head_s = self._lm_head_s()
        verified = [
            Verified(logits[i][: len(t) + 1], None if hidden is None else hidden[i][: len(t) + 1], mask_s, lm_head_s)
            for i, t in enumerate(trees)
        ]
        last = iter(logits[r:])
        for i, p in enumerate(prefills):
            own = next(last) if p.last else out.logits[0, :0]
            verified.append(Verified(own, None if hidden is None else hidden[r + i], mask_s, lm_head_s))
        return verified

    def _forward(
        self,
        ids,
        mask,
        positions,
        layers: tuple[int, ...] | None,
        first: int,
        starts: list[int],
        sizes: list[int] | None = None,
        packing: Packing | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        kv_len: int | None = None,
    ):
        """The model's forward over `ids` (r, q) fed to slots first.. from rows `starts`, or `sizes` rows each
        packed as (1, N) (`packing`); logits of the last `logits_to_keep` rows (0: all; a tensor: those rows);
        hidden states for `layers` (None: all); attention over the slots' first `kv_len` rows (None: the fed
        slots' furthest start plus the most rows fed)."""
        self.cache.feed(first, list(starts), max(sizes) if sizes else ids.shape[1], sizes, kv_len)
        if self._lm_head_clock is not None:
            self._lm_head_clock[1] = 0.0
        if self.fused is not None:
            return self.fused(ids, mask, positions, self.cache, _hidden_states_wanted(layers), logits_to_keep, packing)
        return self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            cache=self.cache,
            use_cache=True,
            output_hidden_states=_hidden_states_wanted(layers),
            logits_to_keep=logits_to_keep,
            **({} if packing is None else {"packing": packing}),
        )

    def _lm_head_s(self) -> float:
        return self._lm_head_clock[1] if self._lm_head_clock is not None else 0.0

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
    def commit(self, path: list[int], slot: int = 0) -> None:
        """After a `verify`, keep the root and the accepted `path` (node indices) in the slot's cache, drop the
        rest."""
        n_fed, self._fed[slot] = self._fed[slot], 0
        root_pos = self.lengths[slot] - n_fed
        self.lengths[slot] = root_pos + 1 + len(path)
        if path != list(range(len(path))):  # accepted nodes not right after the root: move only the path
            nodes = torch.tensor(path, device=self.device) + root_pos + 1  # (len(path),) rows of the accepted nodes
            self.cache.keep_rows(slot, root_pos + 1, nodes)

    @torch.inference_mode()
    def move(self, src: int, dst: int) -> None:
        """Sequence `src`'s cache to slot `dst` (a leaver's slot refilled by the last live one)."""
        self.cache.copy(src, dst, self.lengths[src])
        self.lengths[dst], self.lengths[src] = self.lengths[src], 0

    def kv_bytes_per_token(self) -> int:
        """Bytes of keys and values one cached token holds over every layer."""
        c = self.model.config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
        return 2 * c.num_hidden_layers * kv_heads * head_dim * torch.finfo(self.dtype).bits // 8
