"""Trees sized by measured cost: the choice on synthetic cost curves, interpolation, the cached curve, the
live resizing from the acceptance seen."""

import copy

import pytest
import torch

from headstart.runtime import kernels, native
from headstart.runtime.engine import Engine
from headstart.runtime.generate import stream
from headstart.runtime.sizing import cost_curve as curves
from headstart.runtime.sizing.cost_curve import (
    LiveSizer,
    choose_budget,
    cost_at,
    cost_curve,
    fit_factor,
)
from headstart.runtime.target import Target
from headstart.runtime.tree import choose_tree_shape, expected_acceptance_length, scale_accuracy
from helpers.models import tiny_llama

# an EAGLE head's measured per-depth, per-rank accuracies (the shape of the shipped head's)
ACCURACY = [[0.62, 0.14, 0.05, 0.03], [0.55, 0.15, 0.05, 0.02], [0.5, 0.12, 0.04], [0.45, 0.1], [0.4]]
FLAT = {1: 10.0, 64: 10.6}  # a GPU at batch 1: 64 rows cost what one does
STEEP = {1: 40.0, 2: 55.0, 4: 65.0, 8: 78.0, 16: 96.0, 32: 130.0, 64: 200.0}  # a 2-core CPU in float32


def test_a_flat_cost_curve_buys_a_larger_tree_than_a_steep_one():
    flat = choose_budget(FLAT, ACCURACY, draft_ms_per_depth=0.5)
    steep = choose_budget(STEEP, ACCURACY, draft_ms_per_depth=0.5)
    assert flat.budget > steep.budget and flat.depth >= steep.depth
    assert flat.expected_tokens > steep.expected_tokens
    assert flat.expected_speedup > steep.expected_speedup > 1
    # the steep curve's choice is the best of every budget by hand: tokens per ms of each
    rate = {b: choose_budget(STEEP, ACCURACY, 0.5, max_budget=b) for b in range(1, 30)}
    assert max(rate.values(), key=lambda c: c.expected_tokens / c.round_ms).budget == steep.budget


def test_costly_drafting_buys_a_shallower_tree():
    cheap = choose_budget(FLAT, ACCURACY, draft_ms_per_depth=0.1)
    dear = choose_budget(FLAT, ACCURACY, draft_ms_per_depth=8.0)
    assert dear.depth < cheap.depth


def test_cost_between_and_past_the_measured_rows():
    curve = {1: 10.0, 4: 16.0, 8: 20.0}
    assert cost_at(curve, 1) == 10.0 and cost_at(curve, 2) == 12.0 and cost_at(curve, 6) == 18.0
    assert cost_at(curve, 12) == 24.0  # the last slope, 1 ms a row


def test_the_curve_is_measured_once_and_cached(tmp_path, monkeypatch):
    target = Target(tiny_llama(vocab_size=64))
    curve = cost_curve(target, tmp_path)
    assert sorted(curve) == list(curves.ROWS) and all(ms > 0 for ms in curve.values())
    assert all(curve[a] <= curve[b] for a, b in zip(curves.ROWS, curves.ROWS[1:], strict=False))
    assert target.past_len == 0
    monkeypatch.setattr(curves, "measure_cost_curve", lambda *a, **k: pytest.fail("measured twice"))
    assert cost_curve(target, tmp_path) == curve
    assert len(list(tmp_path.iterdir())) == 1
    monkeypatch.setattr(curves, "cpu_name", lambda: "another CPU avx2")  # the home folder on another machine
    monkeypatch.setattr(curves, "measure_cost_curve", lambda *a, **k: {1: 1.0})
    assert cost_curve(target, tmp_path) == {1: 1.0} and len(list(tmp_path.iterdir())) == 2


def test_the_float32_kernels_are_chosen_by_their_measured_cost_and_the_choice_cached(tmp_path, monkeypatch):
    if native.library() is not None:  # the native products are kept, never timed against the stock ones
        assert curves.choose_kernels(Target(tiny_llama(vocab_size=64)), tmp_path) == "native"
        assert not list(tmp_path.iterdir())
    monkeypatch.setenv("HEADSTART_NATIVE", "0")
    target = Target(tiny_llama(vocab_size=64))
    assert curves.choose_kernels(target, tmp_path) in curves.FP32_KINDS  # timed for real on the tiny target
    assert len(list(tmp_path.iterdir())) == 1

    def timed(target, reps, rows_timed):  # oneDNN's forward cheaper than MKL's from 2 rows on
        assert rows_timed == curves.TREE_ROWS
        return {rows: 10.0 + (1 if target.packed.kind == "onednn" else 5) * (rows > 1) for rows in rows_timed}

    monkeypatch.setattr(curves, "measure_cost_curve", timed)
    assert curves.choose_kernels(target, None) == "onednn" == target.packed.kind
    monkeypatch.setattr(curves, "cpu_name", lambda: "another CPU avx2")
    assert curves.choose_kernels(target, tmp_path) == "onednn"  # measured there, then read back:
    monkeypatch.setattr(curves, "measure_cost_curve", lambda *a, **k: pytest.fail("measured twice"))
    target.use_kernels("mkl")
    assert curves.choose_kernels(target, tmp_path) == "onednn" == target.packed.kind
    assert curves.choose_kernels(Target(tiny_llama(vocab_size=64), fast=False), tmp_path) == "none"


def test_the_float32_kernels_are_timed_in_turn_so_drift_hits_both(monkeypatch):
    """The machine slows down while the kinds are timed (a neighbour starts): timed one after the other, the
    second kind took the whole slowdown and lost though it is the cheaper one (oneDNN chosen on a 2-core Xeon
    where MKL is cheaper at every count up to 16 rows: 1.1x slower plain decoding, served)."""
    monkeypatch.setenv("HEADSTART_NATIVE", "0")  # the stock kinds, timed
    target = Target(tiny_llama(vocab_size=64))
    order, clock = [], iter(range(100))

    def timed(target, reps, rows_timed):  # MKL 10 % cheaper; every call 30 % dearer than the one before
        order.append(target.packed.kind)
        slow = 1.3 ** next(clock)
        return {rows: slow * (0.9 if target.packed.kind == "mkl" else 1.0) for rows in rows_timed}

    monkeypatch.setattr(curves, "measure_cost_curve", timed)
    assert curves.choose_kernels(target, None) == "mkl"
    assert order[:4] == ["mkl", "onednn", "mkl", "onednn"]


def test_a_bfloat16_target_keeps_onednn_beside_a_cached_float32_choice(tmp_path, monkeypatch):
    """A bfloat16 target packs as oneDNN; the float32 choice (MKL here) must not reach it: on an AVX-512 CPU a bf16
    load after a float32 one once repacked the bf16 weights for MKL, which takes float32 only, and raised. (The
    packing itself is not run: oneDNN's bf16 kernels raise on an AVX2-only CPU; tests/test_fast_path.py packs
    for real where they exist.)"""
    monkeypatch.setattr(curves, "measure_cost_curve", lambda *a, **k: pytest.fail("a bf16 target timed"))
    target = Target(tiny_llama(vocab_size=64).to(torch.bfloat16), fast=False)
    target.packed = kernels.Prepacked(kind="onednn")  # as a bf16 target packed on an AVX-512 BF16 or AMX CPU says
    assert curves.choose_kernels(target, tmp_path) == "onednn" == target.packed.kind
    assert not list(tmp_path.iterdir())
    assert kernels._chosen("onednn", "mkl", torch.bfloat16) == "onednn"
    assert kernels._chosen("onednn", "mkl", torch.float32) == "mkl"


@pytest.fixture
def engine(tiny_drafters, tmp_path, monkeypatch) -> Engine:
    """An engine on the tiny drafters' target, its cost curve cached under tmp_path."""
    model, tokenizer, _ = tiny_drafters
    monkeypatch.setenv("HEADSTART_CACHE", str(tmp_path))
    return Engine(copy.deepcopy(model), tokenizer)


def test_engine_sizes_trained_heads_unless_told(engine, tiny_drafters):
    model, tokenizer, options = tiny_drafters
    heads = options["eagle"]["heads"]
    choice = engine.tree_choice("eagle+lookup", heads=heads)
    assert choice is not None and choice.budget >= 1
    drafter = engine.make_drafter("eagle", heads=heads)
    assert (drafter.budget, drafter.depth) == (choice.budget, choice.depth)
    assert engine.make_drafter("eagle", heads=heads, budget=3).budget == 3  # a given budget wins
    for spec in ("eagle:3", "eagle+lookup:3"):  # a budget given in the spec wins too, and nothing resizes it
        fixed = engine.make_drafter(spec, heads=heads)
        heads_of = getattr(fixed, "inner", fixed)
        assert (heads_of.budget, heads_of.sizer) == (3, None) and engine.tree_choice(spec, heads=heads) is None
    assert engine.tree_choice("lookup") is None
    assert Engine(copy.deepcopy(model), tokenizer, profile="neutral").tree_choice("eagle", heads=heads) is None


def test_fit_factor_inverts_the_expected_acceptance():
    shape = choose_tree_shape(ACCURACY, 12)
    for factor in (0.2, 0.8, 1.0, 1.3):  # 1.3: depth 1's ranks would sum past 1 and are scaled back to 1
        observed = expected_acceptance_length(scale_accuracy(ACCURACY, factor), shape)
        assert fit_factor(ACCURACY, tuple(shape), observed) == pytest.approx(factor, abs=1e-4)
    assert sum(scale_accuracy(ACCURACY, 1.3)[0]) == pytest.approx(1.0)
    assert fit_factor(ACCURACY, tuple(shape), 1.0) == pytest.approx(1 / 16)  # nothing accepted: the lower bound
    assert fit_factor(ACCURACY, tuple(shape), 99.0) == pytest.approx(8.0)


def test_live_acceptance_resizes_greedy_and_sampled_trees_apart():
    sizer = LiveSizer(STEEP, ACCURACY, draft_ms_per_depth=0.5, every=8)
    start = sizer.choice[False]
    assert sizer.choice[True] == start and start.shape == tuple(choose_tree_shape(ACCURACY, start.budget))
    # sampled rounds accept less than the greedy metrics promise: the sampled tree shrinks, the greedy one stays
    changes = [sizer.record(True, 0) for _ in range(8 * 3)]
    assert [c is not None for c in changes].count(True) >= 1 and all(c is None for c in changes[:7])
    assert sizer.choice[True].budget < start.budget and sizer.choice[False] == start
    assert sizer.factor[True] == pytest.approx((1 / 16) ** (1 - 0.5**3), rel=1e-3)  # halfway to 1/16, 3 times
    # greedy rounds that accept every node of the tree: the greedy tree grows
    for _ in range(8 * 3):
        sizer.record(False, start.depth)
    assert sizer.choice[False].budget > start.budget and sizer.factor[False] > 1


def test_live_sizer_fits_the_trees_drafted_not_its_choice():
    """The load budget drafts trees of its own sizes: a window of 1-node trees accepting what a 1-node tree should
    (the likeliest first guess, 0.62 of rounds) leaves the accuracies as they are; fitted against the sizer's own
    larger choice it read as the heads failing and the factor fell."""
    sizer = LiveSizer(STEEP, ACCURACY, draft_ms_per_depth=0.5, every=50)
    assert sizer.choice[False].budget > 1
    one = tuple(choose_tree_shape(ACCURACY, 1))
    for k in range(50):
        sizer.record(False, int(k % 50 < 31), one)  # 31 of 50 rounds accept the node
    assert sizer.factor[False] == pytest.approx(1.0, abs=0.01)
    # a mixture: half the rounds 1 node, half 6 nodes, each accepting its expectation at factor 0.5
    six, half = tuple(choose_tree_shape(ACCURACY, 6)), scale_accuracy(ACCURACY, 0.5)
    mean = (expected_acceptance_length(half, list(one)) + expected_acceptance_length(half, list(six))) / 2
    assert fit_factor(ACCURACY, {one: 5, six: 5}, mean) == pytest.approx(0.5, abs=1e-4)


def test_engine_drafters_resize_from_what_they_accept(engine, tiny_drafters):
    options = tiny_drafters[2]
    heads = options["eagle"]["heads"]
    graft = engine.make_drafter("eagle+lookup", heads=heads)
    eagle = graft.inner
    sizer = engine._sizer("eagle+lookup", heads=heads)
    assert eagle.sizer is sizer and engine.make_drafter("eagle+lookup", heads=heads).inner.sizer is sizer  # one a spec
    assert engine.make_drafter("eagle", heads=heads).sizer is not sizer  # the bare heads see other rounds
    assert engine.make_drafter("eagle", heads=heads, depth=2).sizer is None  # a given size is kept as given
    sizer.every = 4
    start = sizer.choice[False]
    prompt = [1, 2, 3, 4, 5, 6, 7, 1, 2, 3]
    plain = [t for chunk in stream(engine.target, prompt, max_new_tokens=40) for t in chunk.tokens]
    tokens = [t for chunk in stream(engine.target, prompt, graft, max_new_tokens=40) for t in chunk.tokens]
    assert tokens == plain  # resizing between rounds changes no token
    # random heads accept less than their recorded accuracies: the tree in use shrinks with the fitted factor
    assert sizer.factor[False] < 1 and sizer.choice[False] != start
    assert (eagle.budget, eagle.depth) == (sizer.choice[False].budget, sizer.choice[False].depth)


@pytest.mark.parametrize("module", ["cost_curve", "batch_cost"])
def test_the_measuring_commands_time_the_kernels_the_engine_chose(module, tmp_path, monkeypatch, capsys):
    """`python -m headstart.runtime.sizing.cost_curve` / `.batch_cost` timed the default float32 kernels (MKL's)
    whatever `choose_kernels` had chosen: on a 2-core AMD EPYC, where oneDNN's forward costs half of MKL's and the
    engine runs oneDNN, both printed MKL's costs."""
    import importlib

    monkeypatch.setenv("HEADSTART_NATIVE", "0")  # the stock kinds, one chosen by cost

    from headstart.runtime import models

    monkeypatch.setattr(models, "load_model", lambda name, dtype: (tiny_llama(vocab_size=64), None))
    monkeypatch.setenv("HEADSTART_CACHE", str(tmp_path))
    monkeypatch.setattr(curves, "_time_fp32_kernels", lambda target: {"mkl": 2.0, "onednn": 1.0})
    assert importlib.import_module(f"headstart.runtime.sizing.{module}").main(["--dtype", "float32"]) == 0
    assert "kernels onednn" in capsys.readouterr().out
