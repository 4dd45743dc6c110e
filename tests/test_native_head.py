"""The EAGLE heads' draft layers through the native forward (runtime/drafters/native_head.py): what transformers'
layer computes, every variant; a sequence's rows bitwise alike alone and beside other sequences; the slot pool."""

import gc

import pytest
import torch
from transformers import DynamicCache

from headstart.heads.eagle3 import Eagle3Head
from headstart.heads.masks import causal_after
from headstart.runtime import native
from headstart.runtime.drafters.eagle import EagleDrafter
from headstart.runtime.drafters.native_head import HeadSlots, NativeHead
from headstart.runtime.drafters.options import EagleOptions
from headstart.runtime.drafters.together import HeadStep, run_alone, run_together
from headstart.runtime.target import Target
from helpers.exactness import random_heads
from helpers.models import tiny_llama

pytestmark = pytest.mark.skipif(native.library() is None, reason=f"no native library: {native.build_error()}")
HEADS = [
    ("eagle", {}),
    ("eagle3", {}),
    ("eagle3", {"norm_before_residual": True, "norm_output": True, "num_layers": 2}),
    ("eagle3", {"fc_norm": True}),
]


def drafter_for(kind: str, options: dict, dtype: torch.dtype = torch.float32) -> tuple[EagleDrafter, torch.nn.Module]:
    model = tiny_llama(vocab_size=64, init_std=0.2)
    Target(model)  # prepacks the target: the heads are packed like it
    heads = random_heads(kind, model, 0.1, **options)
    head_dtype = "float32" if dtype == torch.float32 else "bfloat16"
    return EagleDrafter(heads, model.model.embed_tokens, model.lm_head, EagleOptions(head_dtype=head_dtype)), model


def steps_of(drafter: EagleDrafter, head, cache, seed: int, past: int = 0) -> list[HeadStep]:
    """Two drafting steps of one sequence: 7 committed pairs entered (causal), then a tree of 3 rows (the third
    row a child of the first) after them."""
    g = torch.Generator().manual_seed(seed)
    module = drafter.head.head if isinstance(drafter.head, NativeHead) else drafter.head
    width = module.fc.in_features if isinstance(module, Eagle3Head) else module.fc.in_features // 2  # target features
    enter = HeadStep(
        head, drafter.readout, drafter.embed, cache, torch.randn(7, width, generator=g).to(drafter.dtype),
        torch.randint(0, 64, (7,), generator=g).tolist(), torch.arange(past, past + 7), causal_after(past, 7), read=1,
    )  # fmt: skip
    allowed = torch.ones(3, past + 7 + 3, dtype=torch.bool)
    allowed[:, past + 7 :] = torch.tensor([[1, 0, 0], [0, 1, 0], [1, 0, 1]], dtype=torch.bool)  # node 2: child of 0
    hidden = 64
    tree = HeadStep(
        head, drafter.readout, drafter.embed, cache, torch.randn(3, hidden, generator=g).to(drafter.dtype),
        [4, 9, 11], torch.tensor([past + 7, past + 7, past + 8]), allowed, read=3,
    )  # fmt: skip
    return [enter, tree]


@torch.inference_mode()  # as drafting runs (a packed product under autograd takes the stock kernel)
@pytest.mark.parametrize("kind, options", HEADS)
def test_native_draft_layers_compute_what_transformers_layer_computes(kind, options):
    drafter, _ = drafter_for(kind, options)
    assert isinstance(drafter.head, NativeHead), "the tiny heads run natively"
    native_head = drafter.head
    for step_native, step_module in zip(
        steps_of(drafter, native_head, native_head.new_cache(), seed=1),
        steps_of(drafter, native_head.head, DynamicCache(), seed=1),
        strict=True,
    ):
        out, logits = run_alone(step_native)
        out_ref, logits_ref = run_alone(step_module)
        torch.testing.assert_close(out, out_ref, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(logits, logits_ref, atol=2e-5, rtol=1e-4)


@torch.inference_mode()
def test_rotary_rows_past_the_first_table_are_the_heads_own():
    """A step after a sequence's first 256 + rows (the tables grow): still the head's forward."""
    drafter, _ = drafter_for("eagle3", {})
    native_head, held = drafter.head, []
    for past in (0, 300, 1000):  # the tables made for 263 rows, then grown past 300, then past 1000
        fork_native, fork_module = native_head.new_cache(), DynamicCache()
        held.append(fork_native)  # a fresh slot each: zeros before the steps' rows, as the module's
        fork_native.length = past
        fork_module.update(*(torch.zeros(1, 2, past, 16),) * 2, 0)  # as many rows before (zeros in both)
        for a, b in zip(
            steps_of(drafter, native_head, fork_native, seed=2, past=past),
            steps_of(drafter, native_head.head, fork_module, seed=2, past=past),
            strict=True,
        ):
            torch.testing.assert_close(run_alone(a)[0], run_alone(b)[0], atol=2e-5, rtol=1e-4)
    assert len(native_head._cos) >= 1010


@torch.inference_mode()
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind, options", HEADS[:2])
def test_a_sequence_drafts_the_same_bits_alone_and_beside_others(kind, options, dtype):
    """Three forks' steps in one native call (each in its own slot, past lengths 0, 5, 2) give each fork's rows
    bitwise what its steps give alone: the kernel's row-count invariance, so a batch drafts each fork's own tree."""
    drafter, _ = drafter_for(kind, options, dtype)
    alone, together, held = [], [], []
    for k, past in enumerate((0, 5, 2)):
        fork = drafter.fork()
        held.append(fork)  # each fork a fresh slot: the rows before the steps' own are zeros in both runs
        fork.cache.length = past
        alone.append([run_alone(s) for s in steps_of(fork, fork.head, fork.cache, seed=k, past=past)])
    forks = [drafter.fork() for _ in range(3)]
    per_fork = []
    for k, (fork, past) in enumerate(zip(forks, (0, 5, 2), strict=True)):
        fork.cache.length = past
        per_fork.append(steps_of(fork, fork.head, fork.cache, seed=k, past=past))
    for depth in range(2):
        together.append(run_together([steps[depth] for steps in per_fork]))
    for k in range(3):
        for depth in range(2):
            out, logits = alone[k][depth]
            out2, logits2 = together[depth][k]
            assert torch.equal(out, out2) and torch.equal(logits, logits2), (k, depth)


def test_forks_hold_slots_of_one_pool_and_give_them_back():
    drafter, _ = drafter_for("eagle3", {})
    pool = drafter.head.pool
    forks = [drafter.fork() for _ in range(3)]
    slots = {f.cache.slot for f in forks}
    assert len(slots) == 3
    dropped = forks.pop().cache.slot
    gc.collect()
    assert drafter.fork().cache.slot == dropped  # reused, not a new slot
    assert pool.handed == len(slots) + 1  # the drafter's own slot and three forks'


def test_the_pool_grows_keeping_every_slots_rows():
    pool = HeadSlots(layers=2, kv_heads=2, head_dim=16, dtype=torch.float32)
    kv = pool.reserve(1, 10)
    kv[1][0][0, :, :10] = 1.5
    grown = pool.reserve(3, 600)
    assert grown[1][0].shape == (3, 2, 856, 16)  # rows + 256, past double the 266 it had
    assert torch.equal(grown[1][0][0, :, :10], torch.full((2, 10, 16), 1.5))
    assert pool.reserve(2, 500) is grown  # already holds it


def test_a_head_the_kernel_does_not_run_keeps_transformers_layer(monkeypatch):
    monkeypatch.setenv("HEADSTART_NATIVE", "0")
    model = tiny_llama(vocab_size=64, init_std=0.2)
    Target(model)
    heads = random_heads("eagle3", model, 0.1)
    drafter = EagleDrafter(heads, model.model.embed_tokens, model.lm_head, EagleOptions(head_dtype="float32"))
    assert not isinstance(drafter.head, NativeHead) and isinstance(drafter.cache, DynamicCache)
