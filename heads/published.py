"""Published draft heads: read the layouts other projects publish as headstart heads (../shared/ENGINES.md).

    headstart generate --drafter eagle3 --heads DOWNLOADED_DIR ...       # read and checked at load
    headstart convert DOWNLOADED_DIR OUT --model TARGET                  # written once as headstart heads

Layouts, recognised by their files and config.json (`detect_layout`), each with its trap:

- `medusa`: the Medusa authors' `medusa_lm_head.{pt,safetensors}`, tensors `{h}.{l}.linear.*` (block l of
  head h) and `{h}.{L}.weight` (the head's own readout). Heads and blocks are counted from the tensor names:
  the published configs' `medusa_num_heads` is wrong.
- `eagle`: the EAGLE authors' EAGLE-1/2 heads, `fc` (with a bias unless there is none), `layers.0.*` without
  an input norm, `embed_tokens` (the target's is used; it is compared). Features are the target's last hidden
  state after its final norm, as headstart's EAGLE heads read them.
- `eagle3-authors` (`midlayer.*`, maybe `embed_tokens`), `eagle3-specforge` (`LlamaForCausalLMEagle3`) and
  `eagle3-speculators` (`layers.0.*`, `speculators_config`, `norm_before_residual`, which means true when
  absent): `d2t` offsets (target id = i + d2t[i]) or the full vocabulary. Fused layers: a top-level
  `eagle_aux_hidden_state_layer_ids` is read as vLLM reads it (id k = the input of layer k = Hugging Face's
  hidden state k); SpecForge's `eagle_config.eagle_aux_hidden_state_layer_ids` as SGLang reads it (the output
  of layer k = hidden state k + 1); null or absent: (2, N//2, N-3).

A published draft vocabulary is ordered by token id, not by frequency, so imported heads read out every
draft token (`CheckpointConfig.vocab_order`). Pickled files are read with `torch.load(weights_only=True)`: a pickle
holding anything but tensors is refused. Published heads carry no per-rank accuracies: Medusa trees then come
from a prior (`runtime/tree.py`, `prior_rank_accuracy`), EAGLE trees grow dynamically, until `headstart
calibrate` measures them on the user's prompts.
"""

from __future__ import annotations

import json
import pickle
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

from headstart.heads.checkpoint import CheckpointConfig, build_heads, save_heads, target_fingerprint
from headstart.heads.eagle3 import LAYER_OVERRIDES, VARIANT_FLAGS, draft_config
from headstart.heads.export import write_new_dir
from headstart.heads.kinds import Misfit, get_kind

LAYOUTS = ("medusa", "eagle", "eagle3-authors", "eagle3-specforge", "eagle3-speculators")
MEDUSA_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
EMBED_TOLERANCE = 1e-3  # a stored embedding further than this from the target's is reported (the target's is used)


class PublishedHeadsError(ValueError):
    """A folder that holds no readable heads, or heads that do not fit the target: one line saying which."""


@dataclass(frozen=True)
class Published:
    """A published head read into headstart's terms."""

    layout: str  # one of LAYOUTS
    kind: str  # the headstart head kind it becomes
    options: dict  # `build_heads` keyword arguments
    weights: dict[str, torch.Tensor]  # under headstart's names
    embed: torch.Tensor | None = None  # a stored token embedding (compared with the target's, never used)
    base_model: str | None = None  # the base model its config names (a hub path, usually)
    vocab_size: int | None = None  # the target vocabulary its files imply (t2d's length, the readout's rows)
    layer: dict = field(default_factory=dict)  # EAGLE-3: the draft layer's config as published
    notes: list[str] = field(default_factory=list)


def _config(directory: Path) -> dict | None:
    path = directory / "config.json"
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise PublishedHeadsError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise PublishedHeadsError(f"{path} holds no JSON object")
    return config


def _weight_file(directory: Path) -> Path | None:
    found = [directory / n for n in WEIGHT_FILES if (directory / n).is_file()]
    if len(found) > 1:
        raise PublishedHeadsError(f"{directory} holds both {found[0].name} and {found[1].name}: keep one")
    return found[0] if found else None


def _tensor_names(path: Path) -> set[str]:
    if path.suffix == ".safetensors":
        try:
            with safe_open(str(path), "pt") as f:
                return set(f.keys())
        except Exception as e:  # a truncated or foreign file: whatever its reader raises, in one line
            raise PublishedHeadsError(f"cannot read {path}: {type(e).__name__}: {str(e)[:200]}") from None
    return set(read_tensors(path))


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """The tensors in a safetensors file or a pickled state dict (tensors only: `weights_only=True`)."""
    try:
        if path.suffix == ".safetensors":
            return load_file(str(path))
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise PublishedHeadsError(
            f"{path} is refused: its pickle holds more than tensors ({str(e).splitlines()[0][:160]})"
        ) from None
    except Exception as e:  # truncated, foreign: one line naming the file
        raise PublishedHeadsError(f"cannot read {path}: {type(e).__name__}: {str(e)[:200]}") from None
    if not isinstance(state, dict) or not all(isinstance(k, str) and torch.is_tensor(v) for k, v in state.items()):
        raise PublishedHeadsError(f"{path} is refused: it is not a dictionary of named tensors")
    return state


def detect_layout(directory: str | Path) -> str:
    """ "headstart" or one of LAYOUTS, from the files in `directory`; a PublishedHeadsError for an empty folder,
    one with two layouts' files, or one with none."""
    directory = Path(directory)
    if not directory.is_dir():
        raise PublishedHeadsError(f"{directory} is not a heads checkpoint (no such directory)")
    if not any(directory.iterdir()):
        raise PublishedHeadsError(f"{directory} is empty")
    config = _config(directory)
    medusa = [n for n in MEDUSA_FILES if (directory / n).is_file()]
    weights = _weight_file(directory)
    found = []
    if config is not None and "kind" in config and "target" in config:
        found.append("headstart")
    if medusa:
        found.append("medusa")
    if config is not None and weights is not None and "headstart" not in found:
        architectures = config.get("architectures") or []
        if config.get("speculators_model_type") == "eagle3":
            found.append("eagle3-speculators")
        elif "LlamaForCausalLMEagle3" in architectures:
            found.append("eagle3-specforge")
        else:
            names = _tensor_names(weights)
            if any(n.startswith("midlayer.") for n in names):
                found.append("eagle3-authors")
            elif "fc.weight" in names and any(n.startswith("layers.0.") for n in names):
                found.append("eagle")
    if len(found) > 1:
        raise PublishedHeadsError(f"{directory} holds the files of two layouts ({' and '.join(found)}): keep one")
    if not found:
        raise PublishedHeadsError(
            f"{directory} is not a heads checkpoint: it holds no heads headstart can read (expected headstart's "
            "config.json + model.safetensors, "
            "Medusa's medusa_lm_head.*, or an EAGLE / EAGLE-3 config.json with model.safetensors or pytorch_model.bin)"
        )
    return found[0]


def heads_kind(directory: str | Path) -> str:
    """The head kind (medusa, medusa2, eagle, eagle3) of the heads in `directory`, in any layout."""
    layout = detect_layout(directory)
    if layout == "headstart":
        return CheckpointConfig.read(directory).kind
    return "eagle3" if layout.startswith("eagle3") else layout


def _need(config: dict, key: str, where: Path):
    if key not in config:
        raise PublishedHeadsError(f"{where / 'config.json'} lacks '{key}', which this layout needs")
    return config[key]


def _medusa(directory: Path, config: dict | None) -> Published:
    path = next(directory / n for n in MEDUSA_FILES if (directory / n).is_file())
    tensors = read_tensors(path)
    blocks: dict[int, set[int]] = {}
    for name in tensors:
        m = re.fullmatch(r"(\d+)\.(\d+)\.(linear\.weight|linear\.bias|weight)", name)
        if m is None:
            raise PublishedHeadsError(f"{path} holds '{name}', which is no Medusa head tensor")
        if m[3] == "linear.weight":
            blocks.setdefault(int(m[1]), set()).add(int(m[2]))
    heads = len(blocks)
    if heads == 0 or sorted(blocks) != list(range(heads)):
        raise PublishedHeadsError(f"{path} holds no Medusa heads numbered 0..K-1")
    layers = len(blocks[0])
    weights = {}
    for h in range(heads):
        if blocks[h] != set(range(layers)):
            raise PublishedHeadsError(f"{path}: head {h} has blocks {sorted(blocks[h])}, head 0 has 0..{layers - 1}")
        for b in range(layers):
            prefix = f"blocks.{h}." if layers == 1 else f"blocks.{h}.{b}."
            for part in ("weight", "bias"):
                name = f"{h}.{b}.linear.{part}"
                if name not in tensors:
                    raise PublishedHeadsError(f"{path} lacks '{name}'")
                weights[f"{prefix}linear.{part}"] = tensors[name]
        if f"{h}.{layers}.weight" not in tensors:
            raise PublishedHeadsError(f"{path} lacks '{h}.{layers}.weight' (head {h}'s readout)")
        weights[f"lm_heads.{h}.weight"] = tensors[f"{h}.{layers}.weight"]
    notes = []
    said = (config or {}).get("medusa_num_heads")
    if said is not None and said != heads:
        notes.append(f"its config says {said} heads, its file holds {heads}: the file is read")
    options = {"num_heads": heads, "own_lm_head": True, **({"num_layers": layers} if layers != 1 else {})}
    return Published(
        "medusa",
        "medusa",
        options,
        weights,
        base_model=(config or {}).get("base_model_name_or_path"),
        vocab_size=weights["lm_heads.0.weight"].shape[0],
        notes=notes,
    )


def _eagle(directory: Path, config: dict, tensors: dict[str, torch.Tensor]) -> Published:
    hidden = _need(config, "hidden_size", directory)
    if "fc.weight" not in tensors or tuple(tensors["fc.weight"].shape) != (hidden, 2 * hidden):
        raise PublishedHeadsError(
            f"{directory}: fc.weight is not ({hidden}, {2 * hidden}) as hidden_size {hidden} says"
        )
    weights, embed = {}, tensors.get("embed_tokens.weight")
    for name, t in tensors.items():
        if name in ("fc.weight", "fc.bias"):
            weights[name] = t
        elif name.startswith("layers.0.") and not name.startswith("layers.0.input_layernorm."):
            weights["layer." + name.removeprefix("layers.0.")] = t
        elif name != "embed_tokens.weight":
            raise PublishedHeadsError(f"{directory} holds '{name}', which an EAGLE-1/2 head does not have")
    options = {} if "fc.bias" in tensors else {"fc_bias": False}
    return Published(
        "eagle", "eagle", options, weights, embed=embed, vocab_size=None if embed is None else embed.shape[0]
    )


def _layer_config(config: dict, layout: str) -> dict:
    return config.get("transformer_layer_config") or {} if layout == "eagle3-speculators" else config


# Every key an EAGLE-3 config.json of the three dialects may hold: used (they change the drafts), or inert (they
# do not). Any other key, or an inert key set to a value that would change the drafts, is refused in one line.
EAGLE3_USED = frozenset(
    (
        "draft_vocab_size eagle_aux_hidden_state_layer_ids eagle_config norm_before_residual fc_norm "
        "norm_before_fc norm_output transformer_layer_config speculators_config target_hidden_size "
        "vocab_size hidden_size intermediate_size num_attention_heads num_key_value_heads head_dim "
        "rms_norm_eps rope_theta rope_scaling rope_parameters num_hidden_layers"
    ).split()
)
# use_aux_hidden_state: false is refused below; num_aux_hidden_states: the fc's shape and the fused ids say it
EAGLE3_INERT = frozenset(
    (
        "architectures model_type auto_map speculators_model_type speculators_version embed_requires_grad "
        "max_position_embeddings initializer_range tie_word_embeddings use_cache attention_dropout "
        "pretraining_tp torch_dtype dtype transformers_version bos_token_id eos_token_id pad_token_id "
        "enable_sp_ulysses layer_types max_window_layers use_aux_hidden_state num_aux_hidden_states"
    ).split()
)
# inert only at these values (another value changes the drafts, and headstart does not build it)
EAGLE3_INERT_AT = {
    "hidden_act": ("silu",),
    "attention_bias": (False, None),
    "mlp_bias": (False, None),
    "sliding_window": (None,),
    "use_sliding_window": (False, None),
}
EAGLE_CONFIG_KEYS = frozenset({"eagle_aux_hidden_state_layer_ids", "use_aux_hidden_state", "norm_before_fc"})


def _generic_keys() -> frozenset[str]:
    """The keys every Hugging Face config writes (`PretrainedConfig().to_dict()`): inert for a head."""
    from transformers import PretrainedConfig

    return frozenset(PretrainedConfig().to_dict())


def check_eagle3_keys(config: dict, layout: str, where: Path) -> None:
    """Refuse, in one line naming it, a key of an EAGLE-3 config that headstart neither uses nor knows to be
    inert, or an inert key at a value that would change the drafts."""
    generic = _generic_keys()
    sections = [("", config)]
    if layout == "eagle3-speculators":
        sections.append(("transformer_layer_config.", config.get("transformer_layer_config") or {}))
    for prefix, section in sections:
        for key, value in section.items():
            if key in EAGLE3_INERT_AT and value not in EAGLE3_INERT_AT[key]:
                raise PublishedHeadsError(
                    f"{where / 'config.json'}: {prefix}{key} = {value!r} changes the drafts in a "
                    "way headstart does not build"
                )
            if key not in EAGLE3_USED | EAGLE3_INERT | EAGLE3_INERT_AT.keys() and key not in generic:
                raise PublishedHeadsError(
                    f"{where / 'config.json'}: unknown EAGLE-3 key '{prefix}{key}' (it might "
                    "change the drafts: refused rather than ignored)"
                )
    if (
        config.get("use_aux_hidden_state", True) is False
        or (config.get("eagle_config") or {}).get("use_aux_hidden_state", True) is False
    ):
        raise PublishedHeadsError(
            f"{where / 'config.json'}: use_aux_hidden_state false (no fused layers) is not EAGLE-3"
        )
    for key in config.get("eagle_config") or {}:
        if key not in EAGLE_CONFIG_KEYS:
            raise PublishedHeadsError(
                f"{where / 'config.json'}: unknown EAGLE-3 key 'eagle_config.{key}' (refused rather than ignored)"
            )
    layer_types = _layer_config(config, layout).get("layer_types") or []
    if any(t != "full_attention" for t in layer_types):
        raise PublishedHeadsError(
            f"{where / 'config.json'}: draft layers of types {layer_types}: headstart builds "
            "full-attention draft layers only"
        )


def _eagle3_tensor(name: str, first: str) -> str | None:
    """headstart's name of a published EAGLE-3 tensor, or None when it is no tensor of the head."""
    if name.startswith(first):
        return "midlayer." + name.removeprefix(first)
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
    if m and int(m[1]) >= 1:
        return f"extra_layers.{int(m[1]) - 1}.{m[2]}"
    if name in ("fc.weight", "norm.weight", "lm_head.weight", "input_norm.weight") or re.fullmatch(
        r"fc_norm\.\d+\.weight", name
    ):
        return name
    return None


def _eagle3(directory: Path, config: dict, tensors: dict[str, torch.Tensor], layout: str) -> Published:
    check_eagle3_keys(config, layout, directory)
    first = "midlayer." if any(n.startswith("midlayer.") for n in tensors) else "layers.0."
    weights, embed = {}, tensors.get("embed_tokens.weight")
    for name, t in tensors.items():
        ours = _eagle3_tensor(name, first)
        if ours is not None:
            weights[ours] = t
        elif name not in ("d2t", "t2d", "embed_tokens.weight"):
            raise PublishedHeadsError(f"{directory} holds '{name}', which an EAGLE-3 head ({layout}) does not have")
    for name in ("fc.weight", "norm.weight", "lm_head.weight"):
        if name not in weights:
            raise PublishedHeadsError(f"{directory} lacks the tensor '{name}'")
    rows = weights["lm_head.weight"].shape[0]
    said = _need(config, "draft_vocab_size", directory)
    if layout == "eagle3-speculators":
        _need(config, "transformer_layer_config", directory)
    if said != rows:
        raise PublishedHeadsError(f"{directory / 'config.json'} says draft_vocab_size {said}; its lm_head has {rows}")
    vocab_size, options = None, {}
    if "d2t" in tensors:
        ids = torch.arange(rows) + tensors["d2t"].long()  # target id of each draft row
        if len(ids) != rows or len(set(ids.tolist())) != rows or int(ids.min()) < 0:
            raise PublishedHeadsError(f"{directory}: d2t does not map the {rows} draft rows to distinct target ids")
        if "t2d" in tensors:
            t2d = tensors["t2d"].bool()
            vocab_size = len(t2d)
            if int(ids.max()) >= vocab_size or int(t2d.sum()) != rows or not bool(t2d[ids].all()):
                raise PublishedHeadsError(f"{directory}: t2d does not mark the target ids d2t gives")
        weights["draft_vocab"] = ids
        options["draft_vocab"] = rows
    else:
        vocab_size = rows  # no d2t: the draft vocabulary is the target's whole vocabulary, in order
    eagle_config = config.get("eagle_config") or {}
    layers = config.get("eagle_aux_hidden_state_layer_ids")  # vLLM's reading: the input of layer k = HF index k
    nested = eagle_config.get("eagle_aux_hidden_state_layer_ids")
    if layers:
        options["layers"] = [int(k) for k in layers]
    elif nested and layout == "eagle3-specforge":  # SGLang's reading: the output of layer k = HF index k + 1
        options["layers"] = [int(k) + 1 for k in nested]
    # speculators' layers default to the residual (true); the other layouts have no such choice (false)
    if config.get("norm_before_residual", layout == "eagle3-speculators"):
        options["norm_before_residual"] = True
    for flag in VARIANT_FLAGS:
        if config.get(flag, eagle_config.get(flag, False)):
            options[flag] = True
    for flag, tensor in (("fc_norm", "fc_norm.0.weight"), ("norm_before_fc", "input_norm.weight")):
        if bool(options.get(flag)) != (tensor in weights):
            said_so = "says" if options.get(flag) else "does not say"
            raise PublishedHeadsError(
                f"{directory}: its config {said_so} {flag}, its weights "
                f"{'lack' if options.get(flag) else 'hold'} {tensor}"
            )
    extra = {int(n.split(".")[1]) for n in weights if n.startswith("extra_layers.")}
    if extra != set(range(len(extra))):
        raise PublishedHeadsError(f"{directory}: draft layers numbered {sorted(extra)} after layer 0, not 1..n")
    said_layers = _layer_config(config, layout).get("num_hidden_layers", 1)
    if said_layers != 1 + len(extra):
        raise PublishedHeadsError(
            f"{directory / 'config.json'} says {said_layers} draft layers; its weights hold {1 + len(extra)}"
        )
    if extra:
        options["num_layers"] = 1 + len(extra)
    verifier = ((config.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
    return Published(
        layout,
        "eagle3",
        options,
        weights,
        embed=embed,
        base_model=verifier,
        vocab_size=vocab_size,
        layer=_layer_config(config, layout),
    )


def read_published(directory: str | Path) -> Published:
    """The heads in `directory`, in a published layout (`detect_layout`), in headstart's names and options."""
    directory = Path(directory)
    layout = detect_layout(directory)
    if layout == "headstart":
        raise PublishedHeadsError(f"{directory} holds headstart heads already")
    config = _config(directory)
    if layout == "medusa":
        return _medusa(directory, config)
    path = _weight_file(directory)
    tensors = read_tensors(path)
    if layout == "eagle":
        return _eagle(directory, config, tensors)
    return _eagle3(directory, config, tensors, layout)


def _layer_overrides(layer: dict, target) -> dict:
    """The draft layer's sizes where a published EAGLE-3 config sets them differently from the target's."""
    ours = draft_config(target, 0).to_dict()
    theirs = {k: layer[k] for k in LAYER_OVERRIDES if k in layer and k != "rope_parameters"}
    rope = layer.get("rope_parameters") or (
        {**(layer.get("rope_scaling") or {}), "rope_theta": layer["rope_theta"]} if "rope_theta" in layer else None
    )
    if rope is not None:
        rope = dict(rope)
        rope.setdefault("rope_type", rope.pop("type", "default"))
        theirs["rope_parameters"] = rope
    return {k: v for k, v in theirs.items() if v is not None and ours.get(k) != v}


def adopt(published: Published, model: nn.Module, tokenizer=None, where: str = "") -> tuple[CheckpointConfig, dict]:
    """(config, weights) of `published` as heads of `model`: refused in one line, naming both sides, when they do
    not fit it (hidden size, vocabulary, fused layers, embedding shape); warned about when its config names
    another base model or its stored embedding differs from the target's."""
    cfg, name = model.config, f"the heads in {where}" if where else "the heads"
    w = published.weights

    def refuse(what: str, theirs, ours) -> None:
        raise PublishedHeadsError(
            f"{name} ({published.layout}) do not fit the target: {what} {theirs} in the heads, "
            f"{ours} in {type(model).__name__}"
        )

    if published.vocab_size is not None and published.vocab_size != cfg.vocab_size:
        refuse("vocabulary", published.vocab_size, cfg.vocab_size)
    kind = get_kind(published.kind)
    try:  # the kind's own shape checks (heads/kinds.py), which complete the options (EAGLE-3's fused layers)
        options = kind.fit(w, cfg, dict(published.options))
    except Misfit as e:
        if e.theirs is None:
            raise PublishedHeadsError(f"{name} do not fit the target: {e.what}") from None
        refuse(e.what, e.theirs, e.ours)
    overrides = _layer_overrides(published.layer, cfg) if published.layer else {}  # EAGLE-3's draft layer
    if overrides:
        options["layer"] = overrides
    if published.embed is not None:
        ours = model.get_input_embeddings().weight.detach()
        if published.embed.shape != ours.shape:
            refuse("embedding of shape", tuple(published.embed.shape), tuple(ours.shape))
        diff = float((published.embed.float() - ours.float().cpu()).abs().max())
        if diff > EMBED_TOLERANCE:
            warnings.warn(
                f"{name}: the stored embedding differs from the target's (largest difference {diff:.3g}); "
                "the target's is used",
                stacklevel=2,
            )
    fingerprint = target_fingerprint(model, tokenizer)
    base = published.base_model
    if base and Path(base).name.lower() != Path(fingerprint["name"]).name.lower():
        warnings.warn(f"{name} name {base} as their base model; the target is {fingerprint['name']}", stacklevel=2)
    for note in published.notes:
        warnings.warn(f"{name}: {note}", stacklevel=2)
    config = CheckpointConfig(
        kind=published.kind,
        target=fingerprint,
        options=options,
        dtype="float32",
        vocab_order="token_id",
        extra={"imported_from": published.layout},
    )
    return config, dict(w)


def convert_heads(src: str | Path, out: str | Path, model: nn.Module, tokenizer=None) -> Path:
    """Write the published heads in `src` to `out` (a new folder) as a headstart heads directory bound to `model`."""
    src, out = Path(src), Path(out)
    config, weights = adopt(read_published(src), model, tokenizer, str(src))
    heads = build_heads(config.kind, model, **config.options)
    missing, unexpected = heads.load_state_dict(weights, strict=False)
    if missing or unexpected:
        raise PublishedHeadsError(f"{src}: tensors missing {missing[:3]} / unexpected {unexpected[:3]}")
    dtype = str(next(t for t in weights.values() if t.is_floating_point()).dtype).removeprefix("torch.")
    extra = {k: v for k, v in config.to_json().items() if k not in ("kind", "target", "options")}
    return write_new_dir(
        out, lambda tmp: save_heads(tmp, heads, config.kind, config.options, config.target, {**extra, "dtype": dtype})
    )
