"""Prepacked linear layers: a verified tree's rows cost little more than one row.

At batch size 1 a forward is bound by reading the weights, so scoring a few more rows should be nearly free.
The default CPU kernels make it dear: a product with more than one row repacks the weight into the layout
the GEMM reads, an extra pass over every weight at every call. Here each `nn.Linear` of the target is
swapped, once at load, for a `PackedLinear` that keeps the weight packed (the prepacking inductor's freezing
pass does, without compiling anything):

- bfloat16: one oneDNN-packed copy serves every row count (AMX / AVX-512 BF16 kernels; a CPU without
  AVX-512 BW/VL/DQ or AVX-NE-CONVERT, e.g. AVX2 only, has no such kernels and keeps the stock ones);
- float32, two kinds (`FP32_KINDS`): MKL's packed GEMM ("mkl", the default) or oneDNN's ("onednn", one copy
  for every row count, as in bfloat16). MKL packs a weight for a row count, but a copy packed for one count
  computes any other as that count's own copy does (the count only tunes its blocking), so two copies
  serve every count: the one packed for `MKL_PACK_ROWS[0]` rows up to `MKL_LARGE_ROWS` rows (trees, several
  sequences' trees packed end to end), the one for `MKL_PACK_ROWS[1]` past them (a prompt's chunk); one or two rows
  keep the stock kernel (a GEMV reads the plain layout best). `mkl_packs_serve_any_rows` checks that at first use
  (else float32 packs as oneDNN). The forward's cost by rows under each copy: docs/tuning.md ("One MKL pack for
  every row count"); before, a copy was made per bucket of 4, 8, 16 and 32 rows and a tree padded to the next.
  Which kind is cheaper depends on the CPU: `runtime/sizing/cost_curve.choose_kernels` times both on the whole target
  once per machine (an AVX2-only AMD EPYC: oneDNN 66 / 75 / 94 / 133 ms for 1 / 2 / 4 / 8 rows, MKL 69 / 112 /
  112 / 154; a 2-core AMD EPYC Zen 4: oneDNN, docs/tuning.md).

Measured on an earlier round's 2-core CPU with AVX-512 (SmolLM2-135M, 256 cached tokens, ms per forward): float32
1 / 4 / 8 / 16 rows 44.8 / 68.4 / 82.3 / 96.3 stock, 45.0 / 59.0 / 63.7 / 74.9 packed; bfloat16 50.9 / 59.6 /
61.6 / 64.4 stock, 40.8 / 47.0 / 51.7 / 57.1 packed. The original weight stays the module's `weight` (tied
embeddings and drafters that read `lm_head.weight` see no change); results equal the stock kernel's to float
rounding. Memory: a packed copy of every linear weight for oneDNN, two for MKL (packing is skipped when the copies
would take more than half the memory available). Packing takes 0.2-0.3 s for SmolLM2-135M and is redone at each
load (reading a cached copy would cost as much). CPU only (CUDA kernels need no packing; CUDA graphs, the GPU's tool
against launch overhead, are not built yet), inference only.
"""

from __future__ import annotations

import copy
import functools
import os
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from headstart.runtime import native

MKL_PACK_ROWS = (64, 256)  # float32 "mkl": the row counts its two copies are packed for (either computes any count)
MKL_LARGE_ROWS = 96  # ... products over more rows than this read the second
STOCK_ROWS = 2  # float32 under "mkl": up to this many rows the stock kernel (a GEMV) is the cheapest
FP32_KINDS = ("mkl", "onednn")  # float32's packings, the default first (where the native kind does not run)
NATIVE = "native"  # runtime/native.py's products: the default for float32 and bfloat16 where its library builds
ONEDNN_PACK_ROWS = 16  # bfloat16: the row count oneDNN chooses its packed layout for


@dataclass(frozen=True)
class Prepacked:
    seconds: float = 0.0  # the time packing took at load
    kind: str = "none"  # "onednn", "mkl" or "none"


def _packing(model: nn.Module) -> str:
    """Which packing suits `model`: "onednn" (CPU bf16), "mkl" (CPU fp32), or "none" (another device or dtype,
    a torch without the kernels, a live LoRA wrapping the layers)."""
    if live_lora(model):
        return "none"
    return _packing_for(next(model.parameters()))


def live_lora(model: nn.Module) -> bool:
    """Whether peft's LoRA wrappers sit in `model` (an adapter kept live, not merged): its layers are peft's."""
    return any(type(m).__module__.startswith("peft.") for m in model.modules())


def _packing_for(param: torch.Tensor) -> str:
    if param.device.type != "cpu":
        return "none"
    if native_enabled() and param.dtype in (torch.float32, torch.bfloat16):
        return NATIVE
    if param.dtype == torch.bfloat16 and onednn_bf16_supported():
        return "onednn"
    if param.dtype == torch.float32:
        return next(iter(fp32_kinds()), "none")
    return "none"


def fp32_kinds() -> tuple[str, ...]:
    """The float32 packings this machine runs, the default first: FP32_KINDS less MKL's where its packs fail
    `mkl_packs_serve_any_rows`, less oneDNN's where torch is built without it."""
    usable = {"mkl": mkl_packs_serve_any_rows(), "onednn": torch.backends.mkldnn.is_available()}
    return tuple(kind for kind in FP32_KINDS if usable[kind])


def native_enabled() -> bool:
    """Whether the native products (runtime/native.py) pack by default: its library builds here and
    HEADSTART_NATIVE is not 0."""
    return os.environ.get("HEADSTART_NATIVE", "1") != "0" and native.library() is not None


@functools.cache
def mkl_packs_serve_any_rows() -> bool:
    """Whether this torch has MKL's packed GEMM and a weight packed by it for each of MKL_PACK_ROWS computes other
    row counts as the stock kernel does (MKL documents a pack for the count it was made for; every count tried here
    reads either correctly, which this confirms on the running CPU, once: a few ms)."""
    if not torch.backends.mkl.is_available():
        return False
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 80, generator=gen)
    for packed_for in MKL_PACK_ROWS:
        pack = torch.ops.mkl._mkl_reorder_linear_weight(weight, packed_for)
        for rows in (3, 17, 100, 300):
            x = torch.randn(rows, 80, generator=gen)
            got = torch.ops.mkl._mkl_linear(x, pack, weight, None, rows)
            if not torch.allclose(got, F.linear(x, weight), rtol=1e-4, atol=1e-4):
                return False
    return True


@functools.cache
def onednn_bf16_supported() -> bool:
    """Whether this CPU runs oneDNN's bf16 linear kernels: packing a bf16 weight raises on one that lacks them
    (AVX2-only CPUs: "bf16 path needs the cpu support avx_ne_convert or avx512bw, avx512vl and avx512dq")."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def head_dtypes(choice: str, target_weight: torch.Tensor) -> tuple[torch.dtype, torch.dtype]:
    """(greedy, sampled): the dtypes a draft head runs in for greedy and for sampled decodes under a target whose
    weights are like `target_weight`; `choice` one of `options.HEAD_DTYPES`. "auto" drafts greedy decodes in bfloat16
    under a float32 target on a CPU with oneDNN's bf16 kernels, everything else in the target's dtype: a drafting
    step is bound by reading the head's weights (an EAGLE-3 head for SmolLM2-135M: 37 MB in float32, ~2.5 ms a step
    on a 2-core Xeon), the head was trained under bfloat16 autocast, and a greedy decode's tokens are the target's
    whatever the draft. A sampled decode drafts in the target's dtype: exact in any (its q is the one the head
    computed), but a bfloat16 head through transformers' layer rounds differently at another row count (sequences
    drafting together), enough to move a draw: its tokens for a seed would then differ alone and in a batch. (The
    native draft layers, runtime/drafters/native_head.py, do not; sampled decodes could draft in bfloat16 where they
    run: not done, not measured.)"""
    own = target_weight.dtype
    if choice == "auto":
        cpu_fp32 = target_weight.device.type == "cpu" and own == torch.float32
        return (torch.bfloat16 if cpu_fp32 and onednn_bf16_supported() else own), own
    dtype = own if choice == "target" else getattr(torch, choice)
    return dtype, dtype


class PackedLinear(nn.Linear):
    """An `nn.Linear` whose products read a prepacked copy of the weight (see the module docstring)."""

    @classmethod
    def from_linear(cls, linear: nn.Linear, kind: str) -> PackedLinear:
        return cls.from_weight(linear.weight, linear.bias, kind)

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None, kind: str) -> PackedLinear:
        """`weight` (out, in) and `bias` are kept as they are (the same Parameters: ties and readers unchanged);
        `kind` "onednn" or "mkl" (float32 only)."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.out_features, new.in_features = weight.shape
        new.weight, new.bias, new.kind = weight, bias, kind
        w = weight.detach()
        if kind == NATIVE:
            new.packs = [native.pack(w)]
        elif kind == "mkl":  # the copies for few and for many rows
            new.packs = [torch.ops.mkl._mkl_reorder_linear_weight(w, m) for m in MKL_PACK_ROWS]
        else:
            new.packs = [torch.ops.mkldnn._reorder_linear_weight(w, ONEDNN_PACK_ROWS)]
        return new

    def kernel(self, rows: int) -> str:
        """Which kernel a product over `rows` rows runs: "native", "onednn", "mkl" or "stock"."""
        if self.kind in ("onednn", NATIVE):
            return self.kind
        return "stock" if rows <= STOCK_ROWS else "mkl"

    def __deepcopy__(self, memo: dict) -> nn.Linear:
        """A copy is a plain `nn.Linear` (packed tensors are opaque to copying; a copy may be trained or moved)."""
        plain = nn.Linear.__new__(nn.Linear)
        nn.Module.__init__(plain)
        plain.in_features, plain.out_features = self.in_features, self.out_features
        plain.weight = copy.deepcopy(self.weight, memo)
        plain.bias = copy.deepcopy(self.bias, memo)
        return plain

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():  # training: the stock kernel, which autograd knows
            return F.linear(x, self.weight, self.bias)
        rows = x.numel() // x.shape[-1]
        kernel = self.kernel(rows)
        if kernel == NATIVE:
            return native.linear(x, self.packs[0], self.bias)
        if kernel == "onednn":
            return torch.ops.mkldnn._linear_pointwise(x, self.packs[0], self.bias, "none", [], "")
        if kernel == "mkl":
            pack = self.packs[rows > MKL_LARGE_ROWS]
            return torch.ops.mkl._mkl_linear(x, pack, self.weight, self.bias, rows)
        return F.linear(x, self.weight, self.bias)


def packed_projection(weight: torch.Tensor, kind: str | None = None) -> PackedLinear | None:
    """x -> x @ weight.T with `weight` (N, H) prepacked (a drafter's readout) as `kind` (None: the default that
    suits it); None where no packing suits it."""
    kind = own_kind(weight, _chosen(_packing_for(weight), kind, weight.dtype))
    return None if kind == "none" else PackedLinear.from_weight(weight.detach(), None, kind)


def _chosen(default: str, kind: str | None, dtype: torch.dtype) -> str:
    """`kind` where it may replace `default` (a float32 model's kinds are interchangeable, a bfloat16 model's are
    oneDNN's and the native ones), else `default`."""
    kinds = {torch.float32: fp32_kinds(), torch.bfloat16: ("onednn",) if onednn_bf16_supported() else ()}
    kinds = (*kinds.get(dtype, ()), *((NATIVE,) if native_enabled() and dtype in kinds else ()))
    return kind if default in kinds and kind in kinds else default


def available_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (Linux), else None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def prepack_like_target(target_lm_head: nn.Module, heads: nn.Module, readout) -> None:
    """Draft heads (and their readout, `heads.vocab.DraftReadout`) get the kernels of the target whose lm_head is
    `target_lm_head`: packed as it is when the target was prepacked, stock otherwise."""
    if isinstance(target_lm_head, PackedLinear):
        prepack_linears(heads, target_lm_head.kind)
        readout.project = packed_projection(readout.weight, target_lm_head.kind)


def own_kind(weight: torch.Tensor, kind: str) -> str:
    """`kind`, but where the native products cannot pack `weight` (its shape: runtime/native.packable) the kind
    the stock packing would give it."""
    if kind != NATIVE:
        return kind
    if native.packable(weight) is None:
        return kind
    fallback = "onednn" if weight.dtype == torch.bfloat16 and onednn_bf16_supported() else "none"
    return next(iter(fp32_kinds()), "none") if weight.dtype == torch.float32 else fallback


def packing_kind(model: nn.Module, kind: str | None = None) -> str:
    """The packing `prepack_linears` gives `model`: "onednn", "mkl" or "none" (none suits it, or its packed copies,
    one for "onednn", two for "mkl", would take more than half the memory available). `kind`: one of `FP32_KINDS`
    for a float32 model (None: the default)."""
    kind = _chosen(_packing(model), kind, next(model.parameters()).dtype)
    if kind == "none":
        return kind
    copies = len(MKL_PACK_ROWS) if kind == "mkl" else 1
    linears = (nn.Linear, PackedLinear)
    linear_bytes = sum(m.weight.numel() * m.weight.element_size() for m in model.modules() if type(m) in linears)
    available = available_bytes()
    return "none" if available is not None and copies * linear_bytes > available // 2 else kind


_packings = 0  # prepack_linears calls so far: the native forward's table holds the modules of one (packings())


def packings() -> int:
    """How many times `prepack_linears` has swapped modules (in any model) so far."""
    return _packings


def prepack_linears(model: nn.Module, kind: str | None = None, skip: frozenset[int] = frozenset()) -> Prepacked:
    """Swap every `nn.Linear` of `model` (a `PackedLinear` too: packed again) for a `PackedLinear` in place, as
    `packing_kind` says, but those whose `id` is in `skip` (the fused stack's: runtime/fused.py)."""
    kind = packing_kind(model, kind)
    if kind == "none":
        return Prepacked()
    linears = (nn.Linear, PackedLinear)
    global _packings
    _packings += 1
    t0 = time.perf_counter()
    with torch.no_grad():
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if type(child) in linears and id(child) not in skip:
                    setattr(parent, name, PackedLinear.from_linear(child, own_kind(child.weight, kind)))
    return Prepacked(time.perf_counter() - t0, kind)
