"""The native forward: a Llama-style decoder stack in one C++ call (runtime/csrc/forward.cpp), row-count invariant.

Why: at batch size 1 a small model's forward is not bound by its weights but by dispatches (SmolLM2-135M bf16: ~600
operations, ~8 ms of a 22 ms forward outside the products, and oneDNN's products themselves ~18 us a call above
what their bytes cost; docs/tuning.md, "The native forward"). Here every decoder layer runs inside one OpenMP
region: ~10 barriers a layer instead of ~20 dispatches, products that stream a packed copy of each weight, and a
row's every reduction in one fixed order whatever the number of rows, so a verified tree's rows, a batch's rows
and a prefill's rows equal what a one-row step computes for them (speculation and batching give the plain loop's
very tokens, in bfloat16 as in float32).

The library is compiled at first use with the machine's C++ compiler (`g++ -O3 -march=native -fopenmp`, FLAGS; $CXX
overrides; $HEADSTART_NATIVE_FLAGS adds flags, e.g. `-mno-avx512f` for the portable loops the tests also build) into
the cache folder (runtime/paths.cache_dir, `native/`), keyed by the source, flags and CPU (`build_id`): once per
machine, ~2.5 s. Without a compiler, or where the build fails, `library()` is None and the fused stack
(runtime/fused.py) runs as before (`build_error()` says why); `HEADSTART_NATIVE=0` turns it off
(runtime/kernels.native_enabled). OpenMP is the one torch already loaded (libgomp), so its threads are torch's.

Which products: the same weights as the model's (packed copies: `kernels.PackedLinear` of kind "native"); the module
weights stay what they are (peft, training, export, tied embeddings read them). The lm_head and any other linear
layer packed so run the same products, one call each (`linear`).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

SOURCE = Path(__file__).parent / "csrc" / "forward.cpp"
# -ffp-contract=off: a * b + c stays two roundings wherever the compiler meets it, so code it vectorises for one
# row count and not another still computes alike (the explicit FMAs of the AVX-512 paths are FMAs everywhere)
FLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-shared", "-fPIC", "-std=c++17")
DTYPES = {torch.float32: 0, torch.bfloat16: 1}
MAX_HEAD_DIM = 512  # the kernel's per-head buffers


class _Layer(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_void_p)
        for name in (
            "in_norm post_norm q_norm k_norm qkv qkv_bias o o_bias gate_up down k_cache v_cache hidden_out".split()
        )
    ]


class _Forward(ctypes.Structure):
    _fields_ = [
        *[(n, ctypes.c_int32) for n in "dtype N hidden heads kv_heads head_dim intermediate layers capacity".split()],
        ("threads", ctypes.c_int32),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        *[(n, ctypes.c_void_p) for n in "h cos sin slot row keys mask final_norm out layer work x_in".split()],
        ("x_width", ctypes.c_int32),
    ]


def flags() -> tuple[str, ...]:
    """The compiler's flags: FLAGS and then $HEADSTART_NATIVE_FLAGS."""
    return FLAGS + tuple(os.environ.get("HEADSTART_NATIVE_FLAGS", "").split())


def _cpu_key() -> str:
    """What the build depends on besides the source: the CPU's flags (-march=native) and the compiler."""
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    return cpu + os.environ.get("CXX", "g++")


def build_id() -> str:
    """What the library is built from: the source, the flags, the CPU and the compiler (a digest)."""
    return hashlib.sha256(SOURCE.read_bytes() + " ".join(flags()).encode() + _cpu_key().encode()).hexdigest()[:16]


def _build_dir() -> Path:
    from headstart.runtime.paths import cache_dir

    return cache_dir() / "native" / build_id()


_why_not: list[str] = []


def compile_library(source: Path, out: Path) -> str | None:
    """Compile `source` into the shared library `out` with $CXX (g++) and `flags()`: None, or why it failed."""
    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None:
        return f"no C++ compiler ({cxx}) on PATH"
    done = subprocess.run([cxx, *flags(), str(source), "-o", str(out)], capture_output=True, text=True)
    return f"{cxx} failed: {done.stderr.strip()[-500:]}" if done.returncode else None


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled library (built here at first use, see the module docstring), or None where it cannot be built
    (`build_error()` says why)."""
    out = _build_dir() / "libheadstart_forward.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            tmp_out = Path(tmp) / out.name
            if error := compile_library(SOURCE, tmp_out):
                _why_not.append(error)
                return None
            os.replace(tmp_out, out)  # atomic: a concurrent build (test workers) finds a whole library or none
    lib = ctypes.CDLL(str(out))
    lib.hs_pack.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    lib.hs_linear.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int] + [ctypes.c_void_p] * 3
    lib.hs_linear.argtypes += [ctypes.c_int, ctypes.c_int]
    lib.hs_workspace_bytes.argtypes = [ctypes.c_int] * 7
    lib.hs_workspace_bytes.restype = ctypes.c_size_t
    lib.hs_forward.argtypes = [ctypes.c_void_p]
    for name in ("hs_sizeof_forward", "hs_sizeof_layer"):
        getattr(lib, name).restype = ctypes.c_size_t
    if lib.hs_sizeof_forward() != ctypes.sizeof(_Forward) or lib.hs_sizeof_layer() != ctypes.sizeof(_Layer):
        _why_not.append("the library's structures differ from native.py's")
        return None
    return lib


def build_error() -> str | None:
    """Why `library()` is None (None when it is not)."""
    return None if library() is not None else (_why_not[-1] if _why_not else "not built")


def packable(weight: torch.Tensor) -> str | None:
    """Why `weight` (out, in) cannot be packed for the native products, or None where it can."""
    lib = library()
    if lib is None:
        return build_error()
    if weight.device.type != "cpu" or weight.dtype not in DTYPES:
        return f"a {weight.dtype} weight on {weight.device.type} (the native products run float32 and bfloat16 on CPU)"
    n, k = weight.shape
    rows, chunk = lib.hs_rows_multiple(), lib.hs_chunk(DTYPES[weight.dtype])
    if n % rows or k % chunk:
        return f"a {n} x {k} weight (rows a multiple of {rows}, columns of {chunk})"
    return None


def pack(weight: torch.Tensor) -> torch.Tensor:
    """The packed copy of `weight` (out, in) the native products read."""
    w = weight.detach().contiguous()
    packed = torch.empty_like(w)
    library().hs_pack(DTYPES[w.dtype], w.data_ptr(), packed.data_ptr(), w.shape[0], w.shape[1])
    return packed


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x (..., K) @ W.T + bias for W packed by `pack`: each row in one fixed order whatever the rows."""
    n, k = packed.shape
    x2 = x.reshape(-1, k)
    if not x2.is_contiguous() or x2.dtype != packed.dtype:
        x2 = x2.contiguous().to(packed.dtype)
    y = x2.new_empty((x2.shape[0], n))
    library().hs_linear(
        DTYPES[packed.dtype],
        x2.data_ptr(),
        x2.shape[0],
        k,
        packed.data_ptr(),
        None if bias is None else bias.data_ptr(),
        y.data_ptr(),
        n,
        torch.get_num_threads(),  # OpenMP's count is per thread: a server's worker thread gets torch's, not all cores
    )
    return y.view(*x.shape[:-1], n)


def _packed(module) -> torch.Tensor | None:
    """The native packed weight of a linear module, None where it is not packed so."""
    return module.packs[0] if getattr(module, "kind", None) == "native" else None


class Layers:
    """The fused stack's layers as the native forward reads them: the table of pointers and the tensors it points
    into (held here, so none is freed while the table lives: a second Target over the same model packs its modules
    again and drops the first one's; the stack then builds its table again, `FusedStack.native_layers`)."""

    def __init__(self, table: ctypes.Array, tensors: list[torch.Tensor]) -> None:
        self.table, self.tensors = table, tensors


def layers(fused_layers: list) -> Layers | None:
    """The fused stack's layers (runtime/fused.FusedLayer) as the native forward reads them, or None where one of
    their products is not packed for it, or their norms or heads are of a kind it does not run. A layer whose input
    norm has no weight (an EAGLE head's `nn.Identity`) feeds its input to q/k/v as it is."""
    if library() is None or not fused_layers:
        return None
    eps = set()
    table = (_Layer * len(fused_layers))()
    tensors: list[torch.Tensor] = []
    for entry, fl in zip(table, fused_layers, strict=True):
        products = [_packed(m) for m in (fl.qkv, fl.attn.o_proj, fl.gate_up, fl.mlp.down_proj)]
        if any(p is None for p in products) or fl.head_dim > MAX_HEAD_DIM or fl.head_dim % 16:
            return None
        in_norm = fl.input_norm if hasattr(fl.input_norm, "weight") else None
        norms = [n for n in (in_norm, fl.post_norm, fl.q_norm, fl.k_norm) if n is not None]
        eps |= {n.variance_epsilon for n in norms}
        if any(n.weight.dtype != products[0].dtype or not n.weight.is_contiguous() for n in norms):
            return None
        biases = [fl.qkv.bias, fl.attn.o_proj.bias]
        tensors += products + [n.weight for n in norms] + [b for b in biases if b is not None]
        entry.in_norm = in_norm.weight.data_ptr() if in_norm is not None else None
        entry.post_norm = fl.post_norm.weight.data_ptr()
        entry.q_norm = fl.q_norm.weight.data_ptr() if fl.q_norm is not None else None
        entry.k_norm = fl.k_norm.weight.data_ptr() if fl.k_norm is not None else None
        entry.qkv, entry.o, entry.gate_up, entry.down = (p.data_ptr() for p in products)
        entry.qkv_bias, entry.o_bias = (b.data_ptr() if b is not None else None for b in biases)
    if len(eps) != 1:  # one epsilon for every norm (the kernel's)
        return None
    return Layers(table, tensors)


def _reserve(cache, like: torch.Tensor, n: int) -> list:
    """Every one of the cache's `n` layers holding the rows the fed slots write and read (runtime/kvcache.py's
    `SlotLayer._reserve`, as its `update` would): the layers. All grow alike, so the first one says when none
    needs to."""
    layers = cache.layers
    if len(layers) == n and layers[0]._k is not None:
        k = layers[0]._k
        if k.shape[0] >= cache.slots_used and k.shape[2] >= cache.kv_len and k.dtype == like.dtype:
            return layers
    while len(layers) < n:
        layers.append(cache.layer_class_to_replicate())
    for layer in layers:
        if not layer.is_initialized:
            layer.lazy_initialization(like, like)
        layer._reserve(like, cache.slots_used, cache.kv_len)
    return layers


def _rows(cache, mask, packing, B: int, q: int, device) -> tuple[torch.Tensor, ...]:
    """Per fed row (N = B * q, in feeding order): its cache slot, the row it writes, the keys it reads and the
    address of its mask row (0: none, causal up to itself)."""
    if len(cache.starts) == 1:
        which = torch.zeros(q, dtype=torch.long)
        rows = cache.starts[0] + torch.arange(q)
    else:
        which, rows = (t.cpu() for t in cache.index(device))
    if mask is None:
        return which + cache.first, rows, rows + 1, torch.zeros_like(rows)
    within = rows - torch.tensor(cache.starts)[which]  # each row's place in its own sequence's block
    addr, keys = torch.zeros_like(rows), torch.zeros_like(rows)
    blocks = [(which < (packing.r if packing else 1 << 30), mask, which)]
    for j, (_, chunk_mask) in enumerate(packing.chunks if packing else ()):
        blocks.append((which == packing.r + j, chunk_mask, torch.zeros_like(which)))
    for sel, m, b in blocks:
        if m.shape[1] != 1 or m.stride(-1) != 1:
            raise ValueError(f"the native forward takes a (B, 1, q, k) mask, got {tuple(m.shape)}")
        b = b if m.shape[0] > 1 else torch.zeros_like(b)
        addr[sel] = m.data_ptr() + m.element_size() * (b[sel] * m.stride(0) + within[sel] * m.stride(2))
        keys[sel] = m.shape[-1]
    return which + cache.first, rows, keys, addr


def forward(
    stack, layers: Layers, h: torch.Tensor, mask, cos, sin, cache, wanted: set[int], packing
) -> tuple[list, torch.Tensor]:
    """The fused stack's decoder layers (`layers`: its `native_layers()`) and final norm over the embeddings `h`
    (B, q, E) in one native call (see `runtime/fused.FusedStack.__call__` for the arguments; `cos`, `sin` (B, q, D),
    sin's first half negated): the hidden states `wanted` (indices as `output_hidden_states`'), and the final
    norm's output (B, q, E)."""
    B, q, E = h.shape
    N, n, dtype = B * q, len(stack.layers), h.dtype
    fl = stack.layers[0]
    if isinstance(mask, dict) or (mask is not None and mask.dtype != dtype):
        raise ValueError("the native forward takes one float mask of the model's dtype")
    rows = _rows(cache, mask, packing, B, q, h.device)
    cache_layers = _reserve(cache, h.new_empty((1, fl.kv_heads, 0, fl.head_dim)), n)
    hidden: list[torch.Tensor | None] = [None] * (n + 1)
    h = h.contiguous()
    if 0 in wanted:
        hidden[0] = h.clone()  # the kernel writes h in place
    for i in range(1, n):
        if i in wanted:
            hidden[i] = torch.empty_like(h)
    kv = [(layer._k, layer._v) for layer in cache_layers[:n]]
    out = run(stack, fl, layers, h.view(N, E), cos.reshape(N, -1), sin.reshape(N, -1), rows, kv, stack.norm.weight,
              hidden[1:n])  # fmt: skip
    if n in wanted:
        hidden[n] = out.view(B, q, E)
    return hidden, out.view(B, q, E)


def run(
    holder,
    fl,
    layers: Layers,
    h: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    rows: tuple[torch.Tensor, ...],
    kv: list[tuple[torch.Tensor, torch.Tensor]],
    final_norm: torch.Tensor | None,
    hidden_out: list[torch.Tensor | None] = (),
    x_in: torch.Tensor | None = None,
) -> torch.Tensor:
    """One native call: the layers of `layers` (shaped like the FusedLayer `fl`) over h (N, E), contiguous, written in
    place, each row at its rotary `cos`/`sin` (N, D), sin's first half negated, and its `rows` (slot, row written,
    keys read, mask row address; each (N,)) in the caches `kv` (each layer's (slots, G, capacity, D) keys and values);
    the first layer's q/k/v read `x_in` (N, X) instead of its input norm where given; a layer's output to
    `hidden_out[i]` where not None. Returns final_norm(h) (N, E), or h's copy without a `final_norm`. `holder` keeps
    the workspace between calls."""
    N, E = h.shape
    H, G, D, dtype = fl.heads, fl.kv_heads, fl.head_dim, h.dtype
    cos, sin = cos.to(dtype).contiguous(), sin.to(dtype).contiguous()
    slot, row, keys, addr = (t.contiguous() for t in rows)
    capacity = kv[0][0].shape[2]
    if len(kv) != len(layers.table):
        raise ValueError(f"{len(kv)} layers' caches for {len(layers.table)} layers")
    for entry, (k, v), out_i in zip(layers.table, kv, [*hidden_out, *[None] * len(kv)], strict=False):
        if k.shape[2] != capacity or not (k.is_contiguous() and v.is_contiguous()):
            raise RuntimeError("the cache's layers differ in capacity or are not contiguous")
        entry.k_cache, entry.v_cache = k.data_ptr(), v.data_ptr()
        entry.hidden_out = out_i.data_ptr() if out_i is not None else None
    out = torch.empty_like(h)
    lib = library()
    code = DTYPES[dtype]
    need = lib.hs_workspace_bytes(code, N, E, H, G, D, fl.intermediate)
    work = getattr(holder, "_work", None)
    if work is None or work.numel() < need:
        work = holder._work = torch.empty(need, dtype=torch.uint8)
    if x_in is not None:
        x_in = x_in.to(dtype).contiguous()
    eps, threads = float(fl.post_norm.variance_epsilon), torch.get_num_threads()  # one epsilon: `layers`
    f = _Forward(
        code, N, E, H, G, D, fl.intermediate, len(kv), capacity, threads, eps, float(fl.scaling),
        h.data_ptr(), cos.data_ptr(), sin.data_ptr(), slot.data_ptr(), row.data_ptr(), keys.data_ptr(),
        addr.data_ptr(), None if final_norm is None else final_norm.data_ptr(), out.data_ptr(),
        ctypes.addressof(layers.table), work.data_ptr(), None if x_in is None else x_in.data_ptr(),
        0 if x_in is None else x_in.shape[1],
    )  # fmt: skip
    lib.hs_forward(ctypes.byref(f))
    return out
