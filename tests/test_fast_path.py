"""The target's fast path: the preallocated KV cache, the tree-mask buffer, the prepacked kernels (fp32) and the
grouped-query attention over a tree."""

import copy
import types

import pytest
import torch
import torch.nn.functional as F

from headstart.heads.masks import additive_mask
from headstart.runtime import kernels
from headstart.runtime.attention import GROUPED_SDPA, MaskBuffer, grouped_sdpa
from headstart.runtime.drafters.lookup import LookupDrafter
from headstart.runtime.generate import stream
from headstart.runtime.kernels import PackedLinear, prepack_linears
from headstart.runtime.kvcache import SlotCache
from headstart.runtime.target import Target
from headstart.runtime.tree import DraftTree, tree_visibility
from helpers.models import tiny_llama

PROMPT = [5, 9, 3, 17, 22, 8, 41, 3, 17]


def _filled_cache(rows: int, slots: int = 1) -> SlotCache:
    """Slot s, layer l, row j holds j + 1000 l + 100000 s."""
    cache = SlotCache(slots)
    for slot in range(slots):
        cache.feed(slot, [0], rows)
        for layer in range(2):
            k = torch.arange(rows, dtype=torch.float32).view(1, 1, rows, 1).expand(1, 2, rows, 4)
            k = k + 1000 * layer + 100000 * slot
            cache.update(k.clone(), -k.clone(), layer)
    return cache


def test_commit_moves_only_the_accepted_rows_of_its_slot():
    cache = _filled_cache(20, slots=2)  # rows 0..11 committed, 12 = the root, 13..19 a tree of 7 nodes
    buffers = [(layer._k.data_ptr(), layer._k.clone()) for layer in cache.layers]
    cache.keep_rows(1, 13, torch.tensor([14, 17, 19]))  # slot 1: nodes 1, 4, 6 accepted
    for layer, (ptr, before) in zip(cache.layers, buffers, strict=True):
        assert layer._k.data_ptr() == ptr  # no new cache: moved in place
        torch.testing.assert_close(layer._k[1, 0, :16, 0] % 1000, torch.tensor([*range(13), 14.0, 17, 19]))
        torch.testing.assert_close(layer._k[1, :, :13], before[1, :, :13])  # the prefix untouched
        torch.testing.assert_close(layer._k[1, :, 16:20], before[1, :, 16:20])  # past the new end: not written
        torch.testing.assert_close(layer._k[0], before[0])  # the other slot untouched
        torch.testing.assert_close(layer._v, -layer._k)


def test_cache_grows_by_doubling_and_slots_write_at_their_own_rows():
    cache, moves, last = SlotCache(2), 0, None
    for step in range(1, 2001):
        cache.feed(0, [step - 1, 2 * (step - 1)], 1)  # slot 1 writes every other row
        cache.update(torch.full((2, 1, 1, 2), float(step)), torch.zeros(2, 1, 1, 2), 0)
        ptr = cache.layers[0]._k.data_ptr()
        moves, last = moves + (ptr != last), ptr
    assert moves <= 6  # 1 + log2(4000 / 256) reallocations, not 2000
    assert cache.layers[0].keys.shape[-2] == 2 * 1999 + 1  # the fed slots' first kv_len rows
    torch.testing.assert_close(cache.layers[0]._k[0, 0, :2000, 0], torch.arange(1.0, 2001))
    torch.testing.assert_close(cache.layers[0]._k[1, 0, 0:4000:2, 0], torch.arange(1.0, 2001))
    cache.copy(1, 0, 3)
    torch.testing.assert_close(cache.layers[0]._k[0, 0, :4, 0], torch.tensor([1.0, 0, 2, 4]))
    kv = cache.snapshot(1, 5)
    cache.restore(0, kv)
    torch.testing.assert_close(cache.layers[0]._k[0, 0, :5, 0], cache.layers[0]._k[1, 0, :5, 0])
    cache.release()
    assert cache.nbytes() == 0


def test_more_slots_do_not_widen_the_cache():
    """Slots joining one by one, each 20 rows long: the buffer grows in slots, its rows stay what the longest
    needs (a slot's growth once doubled the rows too: 64 short prompts took 6.6 GB on SmolLM2, then died)."""
    cache = SlotCache(64)
    for slot in range(64):
        cache.feed(slot, [0], 20)
        cache.update(torch.ones(1, 2, 20, 4), torch.ones(1, 2, 20, 4), 0)
    k = cache.layers[0]._k
    assert k.shape[0] == 64 and k.shape[2] <= 20 + 256  # rows: the need + MIN_CAPACITY, never doubled by slots
    assert cache.nbytes() == 2 * k.numel() * k.element_size()


def test_mask_buffer_equals_a_fresh_mask_every_round():
    """Rounds with growing, shrinking and re-shaped trees: the buffer's view is always the full mask."""
    trees = [
        DraftTree([7, 44, 12, 19, 30, 2], [-1, -1, 0, 0, 2, 1]),
        DraftTree([1, 2], [-1, 0]),
        DraftTree([3, 4, 5, 6, 7, 8, 9, 10, 11], [-1, 0, 1, -1, 3, 4, 0, 6, 7]),
        DraftTree([5], [-1]),
    ]
    buffer, past = MaskBuffer(torch.float32, "cpu"), 3
    for round_ in range(12):
        tree = trees[round_ % len(trees)]
        got = buffer.mask(tree.ancestor_mask(), past)
        allowed, _ = tree_visibility(tree, past)
        torch.testing.assert_close(got, additive_mask(allowed, torch.float32), rtol=0, atol=0)
        past += 1 + round_ % 3 + (500 if round_ == 6 else 0)  # a jump past the buffer's first width


@pytest.fixture
def stock_kinds(monkeypatch):
    """The stock packings (MKL's, oneDNN's) as the defaults: the native ones (tests/test_native.py) off."""
    monkeypatch.setenv("HEADSTART_NATIVE", "0")


def test_packed_linears_equal_the_stock_ones(stock_kinds):
    torch.manual_seed(0)
    model = tiny_llama(vocab_size=64, init_std=0.2)
    stock = {n: m.weight for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    packed = prepack_linears(model)
    if packed.kind == "none":
        pytest.skip("neither MKL nor oneDNN is built into this torch")
    assert packed.seconds > 0
    packed = {n: m for n, m in model.named_modules() if isinstance(m, PackedLinear)}
    assert packed.keys() == stock.keys()
    assert all(packed[n].weight is w for n, w in stock.items())  # the same Parameters: ties kept
    assert model.lm_head.weight is model.model.embed_tokens.weight or not model.config.tie_word_embeddings
    plain = copy.deepcopy(model)  # a copy is a plain model again
    assert not any(isinstance(m, PackedLinear) for m in plain.modules())
    assert plain.lm_head.weight is plain.model.embed_tokens.weight or not model.config.tie_word_embeddings
    # float32 under MKL: one or two rows the stock GEMV, any other count MKL's packs (a tree, several sequences'
    # rows packed end to end, a prompt's chunk)
    lm_head = model.lm_head
    assert [lm_head.kernel(rows) for rows in (1, 2, 3, 4, 5, 17, 300)] == ["stock"] * 2 + ["mkl"] * 5
    with torch.inference_mode():
        for rows in (1, 3, 4, 5, 8, 17):
            x = torch.randn(rows, model.config.hidden_size)
            torch.testing.assert_close(model.lm_head(x), x @ model.lm_head.weight.T, atol=1e-5, rtol=0)


def test_two_mkl_packs_compute_every_row_count(monkeypatch):
    """MKL packs a weight for a row count; its two copies (for few rows and for many) serve every count, which the
    forward relies on: no tree is padded to a packed count. Every count 1-140 and a prompt's 300 rows equal the
    stock kernel's, through the copy for few rows up to MKL_LARGE_ROWS and the other past them."""
    if not kernels.mkl_packs_serve_any_rows():
        pytest.skip("this torch has no MKL packed GEMM that serves any row count (float32 packs as oneDNN)")
    torch.manual_seed(0)
    linear = torch.nn.Linear(48, 200)
    packed = PackedLinear.from_linear(linear, "mkl")
    with torch.inference_mode():
        for rows in [*range(1, 141), 300]:
            x = torch.randn(rows, 48)
            torch.testing.assert_close(packed(x), linear(x), atol=1e-5, rtol=1e-5)
    read, real = [], torch.ops.mkl._mkl_linear
    monkeypatch.setattr(
        torch.ops, "mkl", types.SimpleNamespace(_mkl_linear=lambda x, pack, *a: read.append(pack) or real(x, pack, *a))
    )
    with torch.inference_mode():
        for rows in (3, kernels.MKL_LARGE_ROWS, kernels.MKL_LARGE_ROWS + 1, 300):
            packed(torch.randn(rows, 48))
    assert [p is packed.packs[1] for p in read] == [False, False, True, True]


def test_float32_packs_as_onednn_where_mkl_packs_do_not_serve_every_count(monkeypatch, stock_kinds):
    monkeypatch.setattr(kernels, "mkl_packs_serve_any_rows", lambda: False)
    model = tiny_llama(vocab_size=64, init_std=0.2)
    assert prepack_linears(model, "mkl").kind == ("onednn" if torch.backends.mkldnn.is_available() else "none")


def test_bf16_packs_only_where_the_cpu_has_onednn_bf16_kernels(monkeypatch, stock_kinds):
    """oneDNN's bf16 kernels need AVX-512 BW/VL/DQ or AVX-NE-CONVERT; on an AVX2-only CPU packing raised at load.
    There the stock kernels stay, and the target decodes."""
    model = tiny_llama(vocab_size=64, init_std=0.2).to(torch.bfloat16)
    assert prepack_linears(copy.deepcopy(model)).kind == ("onednn" if kernels.onednn_bf16_supported() else "none")
    monkeypatch.setattr(kernels, "onednn_bf16_supported", lambda: False)
    target = Target(model, fast=True)
    assert target.packed.kind == "none" and not any(isinstance(m, PackedLinear) for m in model.modules())
    assert len([t for c in stream(target, PROMPT, LookupDrafter(), max_new_tokens=8) for t in c.tokens]) == 8


@pytest.mark.parametrize("kind", [*kernels.FP32_KINDS, kernels.NATIVE])
def test_fast_and_stock_targets_decode_alike(kind):
    """Greedy tokens and every round's logits of the fast path equal the stock path's (a tree drafter's rounds),
    with either float32 packing."""
    torch.manual_seed(0)
    logits = {}
    for fast in (False, True):
        model = tiny_llama(vocab_size=64, init_std=0.2)
        target = Target(model, fast=fast)
        target.use_kernels(kind)
        assert target.packed.kind == (kind if fast else "none")
        out = [t for c in stream(target, PROMPT, LookupDrafter(), max_new_tokens=40) for t in c.tokens]
        verified = target.verify(out[-1], DraftTree([1, 2, 3, 4], [-1, 0, -1, 2]))  # 5 rows, fed as they are
        assert verified.logits.shape == (5, 64) and target.past_len == len(PROMPT) + 40 - 1 + 5
        logits[fast] = (out, verified.logits)
    assert logits[True][0] == logits[False][0]
    torch.testing.assert_close(logits[True][1], logits[False][1], atol=1e-4, rtol=0)


def test_float32_linears_pack_again_as_onednn_and_heads_follow_the_target(stock_kinds):
    torch.manual_seed(0)
    model = tiny_llama(vocab_size=64, init_std=0.2)
    weights = {n: m.weight for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert prepack_linears(model).kind == "mkl"  # float32's default
    packed = prepack_linears(model, "onednn")  # packed again, in place
    assert packed.kind == "onednn"
    assert all(m.weight is weights[n] for n, m in model.named_modules() if isinstance(m, PackedLinear))
    with torch.inference_mode():
        for rows in (1, 3, 8, 20):  # one packed copy serves every row count
            x = torch.randn(rows, model.config.hidden_size)
            torch.testing.assert_close(model.lm_head(x), x @ model.lm_head.weight.T, atol=1e-5, rtol=0)
    heads = torch.nn.Sequential(torch.nn.Linear(32, 32))
    readout = types.SimpleNamespace(weight=torch.randn(10, 32), project=None)
    kernels.prepack_like_target(model.lm_head, heads, readout)
    assert heads[0].kind == "onednn" and readout.project.kind == "onednn"
    bf16 = tiny_llama(vocab_size=64).to(torch.bfloat16)  # a float32 kind never applies to bfloat16
    assert prepack_linears(bf16, "mkl").kind == ("onednn" if kernels.onednn_bf16_supported() else "none")


class _Attention(torch.nn.Module):
    num_key_value_groups, is_causal = 3, True


def test_grouped_sdpa_equals_stock_sdpa_on_a_tree():
    """6 query heads over 2 key/value heads, 5 queries (a root and a 4-node tree) under one mask over 12 keys."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    torch.manual_seed(0)
    query = torch.randn(1, 5, 6, 8).transpose(1, 2)  # (B, H, q, D), strided as a model's projection makes it
    key, value = torch.randn(1, 2, 12, 8), torch.randn(1, 2, 12, 8)
    tree = DraftTree([1, 2, 3, 4], [-1, 0, -1, 2])
    mask = additive_mask(tree_visibility(tree, 7)[0], torch.float32)  # (1, 1, 5, 12)
    want, _ = sdpa_attention_forward(_Attention(), query, key, value, mask, scaling=0.3)
    got, _ = grouped_sdpa(_Attention(), query, key, value, mask, scaling=0.3)
    assert got.shape == want.shape == (1, 5, 6, 8)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


def test_grouped_sdpa_equals_stock_sdpa_for_one_query(monkeypatch):
    """A plain step: one query, 6 heads over 2 key/value heads, unmasked (stock SDPA takes `enable_gqa`, which on
    CPU costs a copy of the cache) or under a (1, 1, 1, k) mask (a sliding window). Stacked heads, no SDPA GQA."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    torch.manual_seed(0)
    query = torch.randn(1, 1, 6, 8).transpose(1, 2)  # (B, H, 1, D)
    key, value = torch.randn(1, 2, 12, 8), torch.randn(1, 2, 12, 8)
    window = torch.zeros(1, 1, 1, 12)
    window[..., :4] = torch.finfo(torch.float32).min  # the first 4 keys out of the window
    real = F.scaled_dot_product_attention

    def no_gqa(*args, **kwargs):
        assert not kwargs.get("enable_gqa") and args[0].shape[1] == 2  # (B, G, r, D): heads stacked as rows
        return real(*args, **kwargs)

    for mask in (None, window):
        want, _ = sdpa_attention_forward(_Attention(), query, key, value, mask, scaling=0.3)
        monkeypatch.setattr(F, "scaled_dot_product_attention", no_gqa)
        got, _ = grouped_sdpa(_Attention(), query, key, value, mask, scaling=0.3)
        monkeypatch.undo()
        assert got.shape == want.shape == (1, 1, 6, 8)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


def test_fast_target_verifies_a_tree_without_repeating_the_cache(monkeypatch):
    """Stock SDPA copies every layer's keys and values for each query head (`repeat_kv`) under a tree mask; the
    fast target never calls it, and still scores every node as the stock target does."""
    import transformers.integrations.sdpa_attention as sdpa

    real, repeats, scored = sdpa.repeat_kv, {}, {}

    def counted(hidden_states, n_rep):
        repeats[fast] += 1
        return real(hidden_states, n_rep)

    monkeypatch.setattr(sdpa, "repeat_kv", counted)
    for fast in (False, True):
        model = tiny_llama(vocab_size=64, init_std=0.2)
        target = Target(model, fast=fast)
        assert target.grouped == fast and (model.config._attn_implementation == GROUPED_SDPA) == fast
        target.prefill(PROMPT)
        repeats[fast] = 0
        scored[fast] = target.verify(3, DraftTree([1, 2, 3, 4], [-1, 0, -1, 2])).logits
    assert repeats == {False: 2 * 2, True: 0}  # stock: keys and values in each of the 2 layers; fast: never
    torch.testing.assert_close(scored[True], scored[False], atol=1e-4, rtol=0)


def test_a_batch_packed_end_to_end_scores_as_padded_and_writes_only_its_rows(monkeypatch):
    """Three sequences verify trees of 0, 3 and 1 nodes in one forward. Padded (the stock target), every sequence
    feeds 4 rows (12 in all); packed (the fast path's attention), each feeds its own, 1 + 4 + 2 = 7:

        sequence 0: root                     rows 0
        sequence 1: root, a, b (a's child), c  rows 1-4
        sequence 2: root, d                  rows 5-6

    The linear layers see 7 rows; every sequence's logits and features equal the padded forward's, and the cache
    holds what the padded one holds after each commit, round after round."""
    trees = [DraftTree(), DraftTree([4, 5, 6], [-1, 0, -1]), DraftTree([7], [-1])]
    prompts = [PROMPT, PROMPT[:4], [3, 3, 8, 1, 9, 2, 6]]
    rows_seen: list[int] = []
    got = {}
    for fast in (False, True):
        model = tiny_llama(vocab_size=64, init_std=0.2).double()
        target = Target(model, fast=fast, slots=3)
        if fast:
            hook = model.model.layers[0].mlp.down_proj.register_forward_pre_hook(
                lambda m, a: rows_seen.append(a[0].shape[1])
            )
        for slot, p in enumerate(prompts):
            target.prefill(p, slot=slot)
        rounds = []
        for step in range(3):
            verified = target.verify_batch([11, 12, 13], trees, layers=(-1,))
            rounds.append([(v.logits, v.hidden) for v in verified])
            for slot, path in enumerate([[], [[2], [0, 1], [0]][step], [0]]):  # c; a, b; a: siblings, then chains
                target.commit(path, slot)
        got[fast] = (rounds, list(target.lengths))
        if fast:
            hook.remove()
    assert rows_seen[-3:] == [7, 7, 7]  # packed: 1 + 4 + 2 rows a forward, not 3 x 4
    assert got[True][1] == got[False][1]
    for packed, padded in zip(got[True][0], got[False][0], strict=True):
        for (lp, hp), (lq, hq) in zip(packed, padded, strict=True):
            assert lp.shape == lq.shape
            torch.testing.assert_close(lp, lq, atol=1e-10, rtol=0)
            torch.testing.assert_close(hp, hq, atol=1e-10, rtol=0)


def test_float32_trees_of_a_batch_feed_their_own_rows_and_score_as_the_stock_target():
    """Under MKL's packs (float32) a batch's trees of 0, 3 and 1 nodes feed their 7 rows as they are (they were padded
    to a packed row count, 8, when MKL's copies served only the counts they were packed for); every sequence's
    logits are the stock target's, and the caches hold the same after each commit."""
    trees = [DraftTree(), DraftTree([4, 5, 6], [-1, 0, -1]), DraftTree([7], [-1])]
    prompts = [PROMPT, PROMPT[:4], [3, 3, 8, 1, 9, 2, 6]]
    rows_seen: list[int] = []
    got = {}
    for fast in (False, True):
        torch.manual_seed(0)
        model = tiny_llama(vocab_size=64, init_std=0.2)
        target = Target(model, fast=fast, slots=3)
        if fast:
            target.use_kernels("mkl")
            hook = model.model.layers[0].mlp.down_proj.register_forward_pre_hook(
                lambda m, a: rows_seen.append(a[0].shape[1])
            )
        for slot, p in enumerate(prompts):
            target.prefill(p, slot=slot)
        rounds = []
        for step in range(3):
            rounds.append([v.logits for v in target.verify_batch([11, 12, 13], trees, layers=(-1,))])
            for slot, path in enumerate([[], [[2], [0, 1], [0]][step], [0]]):
                target.commit(path, slot)
        got[fast] = (rounds, list(target.lengths))
        if fast:
            hook.remove()
    assert rows_seen[-3:] == [7, 7, 7]
    assert got[True][1] == got[False][1]
    for fast_round, stock_round in zip(got[True][0], got[False][0], strict=True):
        for lp, lq in zip(fast_round, stock_round, strict=True):
            assert lp.shape == lq.shape
            torch.testing.assert_close(lp, lq, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "dtype",
    [
        pytest.param(
            torch.bfloat16,
            marks=pytest.mark.skipif(not kernels.onednn_bf16_supported(), reason="no oneDNN bf16 kernels on this CPU"),
        ),
        torch.float64,
    ],
)
def test_the_fused_stack_computes_the_generic_forward(dtype, stock_kinds):
    """runtime/fused.py runs the model's own layers with q/k/v and gate/up fused: the same roundings in the same order
    as transformers' forward over the same modules. In bfloat16 (oneDNN's packed kernels, whose products give each
    output the same sums whatever the width) every output is bitwise equal; in float64 (the stock GEMM, which blocks a
    fused product otherwise than three) equal to 1e-10. Checked through a prefill (features of layers 1 and -1), plain
    steps, a tree whose accepted branch is committed, and a batch of two sequences' trees packed end to end."""
    tree = DraftTree([4, 5, 6], [-1, 0, -1])
    outs = []
    for fused in (True, False):
        model = tiny_llama(vocab_size=64, init_std=0.2, hidden_size=128).to(dtype)
        target = Target(model, slots=2)
        assert target.fused is not None
        if not fused:
            target.fused = None  # transformers' forward over the same modules (q/k/v now views of the fused weight)
        got = [target.prefill(PROMPT, layers=(1, -1)), target.prefill(PROMPT[:5], layers=(1, -1), slot=1)]
        for step in range(2):
            v = target.verify(11 + step, DraftTree(), layers=(1, -1))
            target.commit([])
            got += [v.logits, v.hidden]
        v = target.verify(13, tree, layers=(-1,))
        target.commit([0, 1])
        got += [v.logits, v.hidden]
        for v in target.verify_batch([14, 15], [tree, DraftTree([7], [-1])], layers=(-1,)):
            got += [v.logits, v.hidden]
        got += [target.cache.layers[1]._k[:, :, : max(target.lengths)].clone()]
        outs.append(got)
    for a, b in zip(*outs, strict=True):
        assert a.shape == b.shape
        if dtype == torch.bfloat16:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=0, atol=1e-10)


def test_a_second_target_over_the_same_model_keeps_the_fast_path():
    """The first Target switches the model's attention to grouped SDPA; a second one over the same model (a drafter's
    view of it, a new Engine) must see that as the fast path's, not as another attention it leaves alone."""
    model = tiny_llama(vocab_size=64)
    first, second = Target(model), Target(model)
    assert first.grouped and second.grouped and second.fused is not None
    assert model.config._attn_implementation == GROUPED_SDPA
