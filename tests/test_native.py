"""The native forward (runtime/native.py, runtime/csrc/forward.cpp): its products and layers against transformers'
float64 forward, and row-count invariance: a row's values do not depend on how many rows share its forward (a
tree's rows, a batch's, a prefill's chunk), bitwise, in bfloat16 as in float32."""

import os
import platform
import subprocess
import sys

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from headstart.runtime import kernels, native
from headstart.runtime.kernels import PackedLinear, prepack_linears
from headstart.runtime.target import Target
from headstart.runtime.tree import DraftTree
from helpers.models import tiny_llama

pytestmark = pytest.mark.skipif(native.library() is None, reason=f"no native library: {native.build_error()}")
PROMPT = [5, 9, 3, 17, 22, 8, 41, 3, 17, 30, 2]
DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
def test_products_equal_float64_and_each_row_its_one_row_product(dtype):
    torch.manual_seed(0)
    weight = torch.randn(80, 288, dtype=torch.float64).to(dtype)  # 5 strips of 16 outputs, 288 inputs: 3 blocks of k
    bias = torch.randn(80, dtype=torch.float64).to(dtype)
    packed = native.pack(weight)
    x = torch.randn(33, 288, dtype=torch.float64).to(dtype)
    exact = x.double() @ weight.double().T + bias.double()
    alone = torch.cat([native.linear(x[i : i + 1], packed, bias) for i in range(33)])
    tol = 1e-4 if dtype == torch.float32 else 0.05 * exact.abs().max().item()
    torch.testing.assert_close(alone.double(), exact, rtol=0, atol=tol)
    # one tile of every row up to 12 (R x 4 strips, 8 x 3, 12 x 2), beyond it tiles of up to 8 rows as even as can
    # be, the last prefetching the next block: every row as alone
    for rows in (2, 3, 5, 6, 7, 8, 9, 12, 13, 17, 24, 25, 33):
        assert torch.equal(native.linear(x[:rows], packed, bias), alone[:rows])


PRODUCTS = """
import sys, torch
from headstart.runtime import native
assert native.library() is not None, native.build_error()
torch.manual_seed(0)
out = {}
for dtype in (torch.float32, torch.bfloat16):
    w, x = torch.randn(80, 288).to(dtype), torch.randn(9, 288).to(dtype)
    out[str(dtype)] = native.linear(x, native.pack(w), None)
torch.save(out, sys.argv[1])
"""


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 flags (-mno-avx512f)")
def test_the_portable_builds_pass_these_tests_and_agree_with_avx512f(tmp_path):
    """The loops for CPUs without AVX-512 BF16 (bf16 as two float32 FMAs a pair) and without AVX-512 (plain C++):
    this file's tests pass on each build, and both compute the very same float32 FMA chains."""
    products = []
    for extra in ("-mno-avx512bf16", "-mno-avx512f"):
        env = {**os.environ, "HEADSTART_NATIVE_FLAGS": extra}
        out = tmp_path / f"{extra}.pt"
        subprocess.run([sys.executable, "-c", PRODUCTS, str(out)], env=env, check=True)  # fails where it cannot build
        products.append(torch.load(out))
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", "not portable"],
            env=env,
            capture_output=True,
            text=True,
        )
        assert done.returncode == 0 and "skipped" not in done.stdout, f"{extra}: {done.stdout[-3000:]}"
    for dtype in products[0]:
        assert torch.equal(products[0][dtype], products[1][dtype]), dtype


def test_a_weight_of_another_shape_keeps_the_stock_packing():
    assert native.packable(torch.zeros(63, 64)) is not None and native.packable(torch.zeros(64, 64)) is None
    assert native.packable(torch.zeros(64, 47, dtype=torch.bfloat16)) is not None  # bf16 columns: pairs
    model = tiny_llama(vocab_size=62)  # an lm_head of 62 rows
    prepack_linears(model)
    assert model.lm_head.kind == kernels.own_kind(model.lm_head.weight, "native") != "native"
    assert model.model.layers[0].mlp.down_proj.kind == "native"


def test_native_off_by_environment(monkeypatch):
    monkeypatch.setenv("HEADSTART_NATIVE", "0")
    target = Target(tiny_llama())
    assert target.packed.kind != "native" and target.fused.native_layers() is None


def _run(target: Target, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Prefills (features of layers 1 and -1), plain steps, a tree, a committed branch and a batch of trees packed
    end to end: every logit and feature, and the cache's rows."""
    got = []
    for slot, prompt in enumerate(prompts):
        got.append(target.prefill(prompt, layers=(1, -1), slot=slot))
    for step in range(2):
        v = target.verify(11 + step, DraftTree(), layers=(1, -1))
        target.commit([])
        got += [v.logits, v.hidden]
    v = target.verify(13, DraftTree([4, 5, 6], [-1, 0, -1]), layers=(-1,))
    target.commit([0, 1])
    got += [v.logits, v.hidden]
    for v in target.verify_batch([14, 15], [DraftTree([4, 5, 6], [-1, 0, -1]), DraftTree([7], [-1])], layers=(-1,)):
        got += [v.logits, v.hidden]
    return [*got, target.cache.layers[1]._k[:, :, : max(target.lengths)].clone()]


def _qwen(kind: str, dtype: torch.dtype):
    torch.manual_seed(0)
    cls = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}[kind]
    config = cls[0](
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, attn_implementation="sdpa",
        tie_word_embeddings=False, initializer_range=0.2,
    )  # fmt: skip
    return cls[1](config).to(dtype).eval()


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_the_native_forward_computes_transformers_forward(family):
    """Float32 native against transformers' own forward (the generic path, float64): prefill features, steps, a
    tree, a committed branch, a packed batch, the cache (Qwen2: q/k/v biases; Qwen3: q/k norms)."""
    outs = {}
    for dtype in (torch.float32, torch.float64):
        model = tiny_llama(init_std=0.2).to(dtype) if family == "llama" else _qwen(family, dtype)
        target = Target(model, slots=2)
        assert (target.fused.native_layers() is not None) == (dtype == torch.float32)
        outs[dtype] = _run(target, [PROMPT, PROMPT[:5]])
    for a, b in zip(outs[torch.float32], outs[torch.float64], strict=True):
        torch.testing.assert_close(a.double(), b, rtol=0, atol=1e-4)


def _greedy_steps(model, n: int, slots: int = 1) -> tuple[Target, list[tuple[torch.Tensor, torch.Tensor]]]:
    """PROMPT prefilled, then `n` greedy one-row steps from root 7: the target and each step's (logits, feature)."""
    steps = Target(model, slots=slots)
    steps.prefill(PROMPT)
    root, plain = 7, []
    for _ in range(n):
        v = steps.verify(root, DraftTree(), layers=(-1,))
        steps.commit([])
        plain.append((v.logits[0], v.hidden[0]))
        root = int(v.logits[0].argmax())
    return steps, plain


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_do_not_depend_on_the_rows_beside_them(dtype):
    """Row-count invariance, bitwise: greedy one-row steps, then the same tokens verified as one chain (a tree of 5
    rows), inside a batch beside another sequence's tree, and the prompt fed in chunks of 1, 3 and 7 rows: the same
    logits, features and cache rows as the one-row steps computed."""
    model = tiny_llama(init_std=0.2).to(dtype)
    steps, plain = _greedy_steps(model, 5, slots=2)
    chain = [int(logits.argmax()) for logits, _ in plain[:4]]
    kv = steps.cache.layers[1]._k[0, :, : steps.lengths[0]].clone()

    tree = Target(model, slots=2)
    for i in range(0, len(PROMPT), 3):  # the prompt in chunks of 3 rows (its last chunk 2)
        tree.extend(PROMPT[i : i + 3], layers=())
    tree.prefill([3, 1, 4], slot=1)
    v = tree.verify_batch([7, 9], [DraftTree(chain, [-1, 0, 1, 2]), DraftTree([1, 2], [-1, -1])], layers=(-1,))[0]
    for i, (logits, hidden) in enumerate(plain):
        assert torch.equal(v.logits[i], logits) and torch.equal(v.hidden[i], hidden)
    tree.commit([0, 1, 2, 3], slot=0)
    assert torch.equal(tree.cache.layers[1]._k[0, :, : tree.lengths[0]], kv)

    alone = Target(model)
    alone.prefill(PROMPT[:4])
    alone.extend(PROMPT[4:], layers=())  # 7 rows
    v = alone.verify(7, DraftTree(chain[:2], [-1, 0]), layers=(-1,))
    for i in range(3):
        assert torch.equal(v.logits[i], plain[i][0]) and torch.equal(v.hidden[i], plain[i][1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_in_a_tree_of_2_to_64_rows_computes_its_one_row_step(dtype):
    r"""Trees of 2-64 rows: a greedy chain (rows 1..c) with siblings hanging off it (rows after, masked from the
    chain): every chain row's logits and features, and after the chain's commit every key and value written, are
    bitwise the one-row steps'.

        root - g1 - g2 - ... - gc        (the greedy tokens)
          \-s   \-s   \-s              (siblings: token 5, each a child of a chain node in turn)"""
    model = tiny_llama(init_std=0.2).to(dtype)
    steps, plain = _greedy_steps(model, 64)
    greedy = [int(logits.argmax()) for logits, _ in plain]
    for rows in (2, 3, 8, 17, 33, 64):
        c = max(1, (rows - 1) // 2)
        siblings = rows - 1 - c
        tokens = greedy[:c] + [5] * siblings
        parents = [*range(-1, c - 1), *((i % c) - 1 for i in range(siblings))]
        target = Target(model)
        target.prefill(PROMPT)
        v = target.verify(7, DraftTree(tokens, parents), layers=(-1,))
        for i in range(c + 1):
            assert torch.equal(v.logits[i], plain[i][0]) and torch.equal(v.hidden[i], plain[i][1]), (rows, i)
        target.commit(list(range(c)))
        n = target.lengths[0]
        for ours, theirs in zip(target.cache.layers, steps.cache.layers, strict=True):
            assert torch.equal(ours._k[0, :, :n], theirs._k[0, :, :n])
            assert torch.equal(ours._v[0, :, :n], theirs._v[0, :, :n])


def test_a_second_target_over_the_same_model_leaves_the_first_computing_right():
    """A second Target packs the model's o_proj and down_proj again (new modules); the first one's native table
    pointed into the old packs, freed with them: its next rows were garbage (the cache test of every drafter caught
    it, 9.3 off). It now reads the new modules, and its cache rows equal a fresh prefill's."""
    model = tiny_llama(init_std=0.2)
    first = Target(model)
    first.prefill(PROMPT)
    context, root = [*PROMPT, 7], 7
    for _ in range(3):
        v = first.verify(root, DraftTree(), layers=())
        first.commit([])
        root = int(v.logits[0].argmax())
        context.append(root)
        fresh = Target(model)  # packs the shared model's modules again
        fresh.prefill(context[:-1])
        n = first.lengths[0]
        for ours, theirs in zip(first.cache.layers, fresh.cache.layers, strict=True):
            assert torch.equal(ours._k[0, :, :n], theirs._k[0, :, :n])


def test_draft_heads_pack_like_a_native_target():
    model = tiny_llama()
    target = Target(model)
    heads = torch.nn.Sequential(torch.nn.Linear(64, 64))
    readout = type("Readout", (), {"weight": torch.randn(32, 64), "project": None})()
    kernels.prepack_like_target(target.model.lm_head, heads, readout)
    assert isinstance(heads[0], PackedLinear) and heads[0].kind == "native" and readout.project.kind == "native"
