"""Training configuration: dataclasses (the one place every default is defined), YAML, dotted overrides.

cfg = load_config("configs/smoke.yaml", ["optim.lr=3e-4", "heads.kind=eagle"])
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

HELDOUT_IDS = "configs/heldout-ids.txt"  # the committed held-out prompt list (train/heldout.py)


@dataclass
class TargetConfig:
    model: str = "smollm2-135m-instruct"  # as `headstart --model`; or `tiny:<layers>` for a random test model
    dtype: str = "float32"  # of the frozen target; heads train in float32 (+ autocast where available)
    adapter: str = ""  # a peft LoRA adapter directory applied on top of the model (merged); "" = none


@dataclass
class LoraConfig:
    """medusa2 only: the LoRA on the target that trains together with the Medusa heads (train/medusa2.py)."""

    r: int = 8  # LoRA rank
    alpha: float = 16.0  # LoRA scaling: alpha / r
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=list)  # module names in the layers; [] = every linear layer
    layers: list[int] = field(default_factory=list)  # decoder layers that get the LoRA; [] = all of them
    lr: float = 1e-4  # the adapter's learning rate (the heads keep optim.lr), same warmup and decay
    kl_weight: float = 1.0  # loss = heads' losses + kl_weight * KL(original model's p || adapted model's p)


@dataclass
class HeadsConfig:
    kind: str = "medusa"  # medusa | medusa2 | eagle | eagle3, or a comma list: medusa,eagle (runs in output_dir/<kind>)
    num_heads: int = 4  # medusa, medusa2: heads trained; every kind: the drafting depths evaluation scores
    own_lm_head: bool = False  # medusa, medusa2: a trainable lm_head copy per head
    lora: LoraConfig = field(default_factory=LoraConfig)  # medusa2 only
    feature_noise: float = 0.2  # eagle only: uniform noise U(-a/2, a/2) on input features while training
    ce_weight: float = 0.1  # eagle only: loss = SmoothL1(feature) + ce_weight * CE(target distribution)
    unroll: int = 1  # eagle, eagle3: head steps run on its own outputs in training (heads/losses.py eagle_unroll)
    unroll_from_step: int = 0  # eagle, eagle3: optimizer steps before this one train with unroll = 1
    draft_vocab: int = 0  # read out only the N most frequent response tokens (heads/vocab.py); 0 = all
    init_from: str = ""  # a trained heads directory to start from (its vocabulary recomputed): new data, new schedule
    keep_vocab: bool = False  # with init_from: keep its draft vocabulary as trained instead (draft_vocab: its size)
    fused_layers: list[int] = field(default_factory=list)  # eagle3: the target layers fused; [] = 2, N//2, N-3
    fc_norm: bool = False  # eagle3: an RMSNorm per fused state before fc (EAGLE 3.1)
    norm_before_fc: bool = False  # eagle3: one RMSNorm over the fused states before fc (gpt-oss style)
    norm_output: bool = False  # eagle3: the next drafting step reads the normed output (EAGLE 3.1)
    draft_layers: int = 1  # eagle3: decoder layers in the head
    options: dict = field(default_factory=dict)  # a kind's own options (heads/kinds.py HeadKind.options), by name


@dataclass
class DataConfig:
    path: str = ""  # distilled shards (train/distill.py output): required
    sources: list[str] = field(default_factory=list)  # more distilled folders, read with `path` as one (read-only)
    distill_prompts: str = ""  # if set and `path` holds no shards: distill these prompts first
    distill_limit: int = 256  # rows to distill then
    distill_max_new_tokens: int = 64
    engine: str = ""  # distill on this OpenAI-compatible server (vLLM, SGLang, headstart serve); "" = locally
    engine_concurrency: int = 16  # requests in flight on the engine
    eval_rows: int = 64  # held-out rows (chosen by a hash of their tokens), never trained on; unused with `heldout`
    heldout: str = ""  # distilled answers to the committed held-out prompts (train/heldout.py): scored, never trained
    max_len: int = 512  # tokens per row (prompt + response), longer rows are cut
    batch_tokens: int = 4096  # tokens per micro-batch, rows bucketed by length to waste little on padding
    features: str = ""  # cache the target's final features here once (train/features.py); "" = run it every step


@dataclass
class OptimConfig:
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    warmup_steps: int = 50
    max_steps: int = 2000
    schedule: str = "cosine"  # after warmup: cosine (to 10 % of lr at max_steps) | constant (sessions that train on)
    grad_clip: float = 1.0
    grad_accum: int = 1


@dataclass
class TrainConfig:
    output_dir: str = ""  # checkpoints, metrics and the trained heads: required
    seed: int = 0
    target: TargetConfig = field(default_factory=TargetConfig)
    heads: HeadsConfig = field(default_factory=HeadsConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    mixed_precision: str = ""  # no | bf16 | fp16, passed to Accelerate; "" = the launch config's (no without one)
    log_every: int = 10
    eval_every: int = 200
    eval_every_cpu_s: float = 0.0  # also score the first eval_quick_rows held-out rows every this many CPU-seconds
    eval_quick_rows: int = 64  # (`cpu_s`: training's, every thread of every process, evaluation excluded); 0 = off
    max_cpu_s: float = 0.0  # stop once training has spent this many CPU-seconds (`cpu_s`); 0 = max_steps only
    save_every: int = 200
    report_to: str = "none"  # wandb | tensorboard | none
    save_dtype: str = "bfloat16"  # of the saved heads' weights (float32 keeps every bit)
    run_name: str = ""  # default: <kind>-<target>-<data>


class ConfigError(ValueError):
    """A config file or override that does not fit the dataclasses; the message names the key."""


def _build(cls, values: dict, prefix: str = ""):
    if not isinstance(values, dict):
        raise ConfigError(f"'{prefix.rstrip('.') or 'config'}' must be a mapping, got {values!r}")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"unknown config key '{prefix}{unknown[0]}' (known: {', '.join(sorted(known))})")
    kwargs = {}
    for name, value in values.items():
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            kwargs[name] = _build(hint, value, f"{prefix}{name}.")
        else:
            kwargs[name] = _coerce(value, hint, f"{prefix}{name}")
    return cls(**kwargs)


def _coerce(value, hint, key: str):
    origin = typing.get_origin(hint)
    if origin is list:
        if not isinstance(value, list | tuple):
            raise ConfigError(f"'{key}' must be a list, got {value!r}")
        return [_coerce(v, typing.get_args(hint)[0], key) for v in value]
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise ConfigError(f"'{key}' must be a list, got {value!r}")
        return tuple(_coerce(v, t, key) for v, t in zip(value, typing.get_args(hint), strict=True))
    if origin in (typing.Union, types.UnionType):
        return value
    if hint is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"'{key}' must be a mapping, got {value!r}")
        return value
    if hint is float and not isinstance(value, bool):
        try:  # YAML 1.1 reads `3e-4` as a string
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"'{key}' must be a number, got {value!r}") from None
    if hint in (int, str, bool) and not (isinstance(value, hint) and (hint is bool or not isinstance(value, bool))):
        raise ConfigError(f"'{key}' must be {hint.__name__}, got {value!r}")
    return value


def own_options(kind, values: dict):
    """A head kind's own training options: its `options` dataclass built from `heads.options` (None when it takes
    none); a key it does not take, or a value of the wrong type, is a ConfigError naming it."""
    if kind.options is None:
        if values:
            raise ConfigError(f"heads.options: the {kind.name} kind takes no options of its own (got {sorted(values)})")
        return None
    return _build(kind.options, values, "heads.options.")


def _set_dotted(tree: dict, dotted: str, value) -> None:
    keys = dotted.split(".")
    for key in keys[:-1]:
        tree = tree.setdefault(key, {})
        if not isinstance(tree, dict):
            raise ConfigError(f"cannot set '{dotted}': '{key}' is not a section")
    tree[keys[-1]] = value


@functools.cache
def _yaml_loader():
    """A SafeLoader with only true/false as booleans (YAML 1.2): `mixed_precision: no` is the string "no"."""
    import yaml  # pyyaml: the train extra

    class Loader(yaml.SafeLoader):
        pass

    Loader.yaml_implicit_resolvers = {
        first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }
    booleans = re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$")
    Loader.add_implicit_resolver("tag:yaml.org,2002:bool", booleans, list("tTfF"))
    return Loader


def _parse_yaml(text: str):
    """`text` as YAML (`_yaml_loader`'s booleans), or a ValueError."""
    import yaml

    try:
        return yaml.load(text, Loader=_yaml_loader())  # a SafeLoader
    except yaml.YAMLError as e:
        raise ValueError(str(e)) from e


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> TrainConfig:
    """TrainConfig from a YAML file (optional) and `key.sub=value` overrides (values parsed as YAML)."""
    values: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            values = _parse_yaml(path.read_text()) or {}
        except ValueError as e:
            raise ConfigError(f"{path}: not valid YAML ({e})") from e
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}' is not key=value")
        key, raw = item.split("=", 1)
        try:
            value = _parse_yaml(raw) if raw.strip() else ""  # `key=`: the empty string (YAML would read null)
        except ValueError as e:
            raise ConfigError(f"override '{item}': not valid YAML ({e})") from e
        _set_dotted(values, key.strip(), value)
    return _build(TrainConfig, values)


def config_to_dict(cfg) -> dict:
    """Plain JSON-able dict of a (nested) config, tuples as lists: what is saved and logged."""
    return json.loads(json.dumps(dataclasses.asdict(cfg)))


def portable(values):
    """`values` (a config as `config_to_dict` gives it) with every path under the home folder written `~/...`: what
    a saved file tells others, without this machine's home."""
    home = str(Path.home())
    if isinstance(values, dict):
        return {k: portable(v) for k, v in values.items()}
    if isinstance(values, list):
        return [portable(v) for v in values]
    if isinstance(values, str) and (values == home or values.startswith(home + os.sep)):
        return "~" + values[len(home) :]
    return values


def ensure_writable_dir(path: str | Path) -> Path:
    """Create `path` if needed and check that files can be written there; a ConfigError says why not."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-test-{os.getpid()}"  # one per process: DDP ranks check the same folder at once
        probe.touch()
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"output directory {path} is not writable ({e.strerror})") from e
    return path
