"""The drafter registry: every drafter by name, its options dataclass, and the one parser of method specs.

A spec is a registered name, optionally `+lookup` or `+suffix`, optionally `:VALUE` for the drafter's one
positional option:

    none  lookup  suffix  medusa  medusa2  eagle  eagle3  model:PATH  layerskip:N  medusa:16  eagle+lookup
    eagle+suffix:12

`NAME+lookup` grafts prompt-lookup branches onto NAME's tree (`graft.LookupGraft`); its options are
NAME's, the lookup's n-gram options and `graft_budget`. `NAME+suffix` grafts the suffix drafter's branches
(prompt lookup, then the continuations of the server's finished requests: `suffix.py`), with its options.
Option values come, in order of precedence, from the caller, the spec's positional value, the profile
(`headstart.runtime.profiles`) and the options dataclass (`options`). An option the drafter does not take is an
error that names it. Builders import their modules when called: reading this table loads no model code.
"""

from __future__ import annotations

import dataclasses
import importlib
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from headstart.runtime import profiles
from headstart.runtime.drafters.options import (
    EagleOptions,
    GraftOptions,
    LayerskipOptions,
    LookupOptions,
    MedusaOptions,
    ModelOptions,
    NoOptions,
    SuffixOptions,
)

if TYPE_CHECKING:
    from headstart.runtime.drafters.base import Drafter

GRAFTS = ("lookup", "suffix")  # NAME+KEY: the branches of the drafter KEY (its entry) grafted onto NAME's tree


@dataclass(frozen=True)
class Context:
    """What a builder may need: the target model, its tokenizer, and the name it was loaded by."""

    model: Any = None
    tokenizer: Any = None
    model_name: str | None = None


@dataclass(frozen=True)
class Entry:
    options: type  # the options dataclass
    build: Callable[[Any, Context], Drafter]
    summary: str
    positional: str | None = None  # the option `NAME:VALUE` sets
    graftable: bool = True  # NAME+lookup exists
    # drafted as its branches grafted onto the none drafter (`graft.LookupGraft`): the same tree, and what a round's
    # branches are worth is known from the branches found then, as for any graft (runtime/sizing; priced as a whole
    # tree of the size its rounds had, `lookup` under the load budget was planned blind: on Spec-Bench most of its
    # trees were taken where it found nothing, 1.00 tokens a round against 1.49 in a fixed tree)
    branches_alone: bool = False
    also_sets: dict[str, str] = dataclasses.field(default_factory=dict)  # an option set by the caller sets these too


def _none(options: NoOptions, ctx: Context) -> Drafter:
    from headstart.runtime.drafters.base import Drafter

    return Drafter()


def _lookup(options: LookupOptions, ctx: Context) -> Drafter:
    from headstart.runtime.drafters.lookup import LookupDrafter

    return LookupDrafter(options)


def _suffix(options: SuffixOptions, ctx: Context) -> Drafter:
    from headstart.runtime.drafters.suffix import SuffixDrafter

    return SuffixDrafter(options)


def heads_dir(kind: str, heads: str | None, model_name: str | None):
    """The heads a trained drafter of `kind` loads: `heads`, else those shipped for `model_name` (or None)."""
    from headstart.heads.checkpoint import shipped_heads

    if heads is None and model_name is not None:
        return shipped_heads(model_name, kind)
    return heads


def heads_adapter(spec: str | DrafterSpec, model_name: str | None, heads: str | None = None) -> str | None:
    """The LoRA adapter the spec's heads were trained with (Medusa-2 heads hold it beside them), or None:
    a target for those heads is loaded as base + that adapter (`Engine.load`, bench)."""
    from headstart.runtime.adapters import is_adapter_dir

    spec = parse_spec(spec) if isinstance(spec, str) else spec
    if "heads" not in option_names(spec):
        return None
    directory = heads_dir(spec.base, heads, model_name)
    return str(directory) if directory is not None and is_adapter_dir(directory) else None


def trained_heads(kind: str, options: Any, ctx: Context):
    """(module, config) of the heads `options.heads`, else of those shipped for `ctx.model_name`, checked to be
    heads the drafter `kind` decodes (`options`: a dataclass with `heads` and `allow_adapter_mismatch`)."""
    from headstart.heads.kinds import get_kind
    from headstart.heads.load import load_heads

    heads = heads_dir(kind, options.heads, ctx.model_name)
    if heads is None or ctx.model is None:
        shipped = f": none are shipped for {ctx.model_name}" if ctx.model_name else ""
        raise ValueError(f"the {kind} drafter needs trained heads (`heads`: their directory){shipped}")
    module, config = load_heads(heads, ctx.model, ctx.tokenizer, options.allow_adapter_mismatch)
    if get_kind(config.kind).drafter_name != kind:  # a kind names the drafter that decodes with it (heads/kinds.py)
        raise ValueError(f"{heads} holds {config.kind} heads, not {kind} heads")
    return module, config


def _readout_limit(options: MedusaOptions | EagleOptions, config) -> int | None:
    """How many draft tokens to read out: all of them when the rows are not ordered by frequency (published)."""
    return options.draft_vocab if config.vocab_order == "frequency" else None


def _medusa(options: MedusaOptions, ctx: Context, kind: str = "medusa") -> Drafter:
    from headstart.runtime.drafters.medusa import MedusaDrafter
    from headstart.runtime.tree import choose_tree_shape, prior_rank_accuracy

    module, config = trained_heads(kind, options, ctx)
    accuracy = config.measured_accuracy
    if accuracy is None:
        why = "measured 0 for every rank" if config.rank_accuracy else "carry no measured per-rank accuracies"
        accuracy = prior_rank_accuracy(module.num_heads)
        warnings.warn(
            f"the {kind} heads {why}: their tree comes from a prior (runtime/tree.py, prior_rank_accuracy)",
            stacklevel=2,
        )
    shape = choose_tree_shape(accuracy, options.budget)
    return MedusaDrafter(
        module,
        ctx.model.get_output_embeddings(),
        shape,
        _readout_limit(options, config),
        options.draft_temperature,
        name=kind,
    )


def _eagle(options: EagleOptions, ctx: Context, kind: str = "eagle") -> Drafter:
    from headstart.heads.eagle import EagleHead
    from headstart.runtime.drafters.eagle import EagleDrafter

    if ctx.model is not None and kind == "eagle":
        EagleHead.check_target(ctx.model)  # before any file is read (an EAGLE-3 layer is Llama's on any target)
    module, config = trained_heads(kind, options, ctx)
    embed, lm_head = ctx.model.get_input_embeddings(), ctx.model.get_output_embeddings()
    options = dataclasses.replace(options, draft_vocab=_readout_limit(options, config))
    return EagleDrafter(module, embed, lm_head, options, rank_accuracy=config.measured_accuracy, name=kind)


def _model(options: ModelOptions, ctx: Context) -> Drafter:
    from headstart.runtime.drafters.model import ModelDrafter, check_same_tokenizer
    from headstart.runtime.models import load_model

    if ctx.model is None:
        raise ValueError("the model drafter needs the target model")
    if options.draft_model is None:
        raise ValueError("the model drafter needs `draft_model` (a model path or name, or the spec model:PATH)")
    draft, draft_tokenizer = load_model(options.draft_model, dtype=ctx.model.dtype, device=str(ctx.model.device))
    check_same_tokenizer(ctx.tokenizer, draft_tokenizer, ctx.model_name or "the target", options.draft_model)
    return ModelDrafter(draft, options, vocab_size=ctx.model.config.vocab_size)


def _layerskip(options: LayerskipOptions, ctx: Context) -> Drafter:
    from headstart.runtime.drafters.model import ModelDrafter

    if ctx.model is None:
        raise ValueError("the layerskip drafter needs the target model")
    return ModelDrafter.layerskip(ctx.model, options.layers(), options)


REGISTRY: dict[str, Entry] = {
    "none": Entry(NoOptions, _none, "plain decoding: one target forward per token", graftable=False),
    "lookup": Entry(
        LookupOptions,
        _lookup,
        "prompt lookup: copy what followed the last n-gram",
        graftable=False,
        branches_alone=True,
    ),
    "suffix": Entry(
        SuffixOptions, _suffix, "prompt lookup, then what followed in the server's finished requests", graftable=False
    ),
    "medusa": Entry(MedusaOptions, _medusa, "trained Medusa heads, a static tree", positional="budget"),
    "medusa2": Entry(
        MedusaOptions,
        lambda options, ctx: _medusa(options, ctx, "medusa2"),
        "Medusa-2 heads: trained with a LoRA on the target, which then runs as base + that adapter",
        positional="budget",
    ),
    "eagle": Entry(
        EagleOptions,
        _eagle,
        "a trained EAGLE head, a dynamic tree",
        positional="budget",
        also_sets={"budget": "sampled_budget"},
    ),  # a budget the user sets holds at every temperature
    "eagle3": Entry(
        EagleOptions,
        lambda options, ctx: _eagle(options, ctx, "eagle3"),
        "a trained EAGLE-3 head (three target layers fused), a dynamic tree",
        positional="budget",
        also_sets={"budget": "sampled_budget"},
    ),
    "model": Entry(ModelOptions, _model, "a small draft model with the same tokenizer", positional="draft_model"),
    "layerskip": Entry(LayerskipOptions, _layerskip, "the target's first layers", positional="draft_layers"),
}


def entry(name: str) -> Entry | None:
    """The drafter `name`: one of REGISTRY, or the one a head kind of that name brings (heads/kinds.py: its
    `drafter` is "module:attr" of an Entry; the kinds are read only for a name REGISTRY lacks). None: no such."""
    if name in REGISTRY:
        return REGISTRY[name]
    from headstart.heads.kinds import KINDS

    kind = KINDS.get(name)
    if kind is None or kind.own_drafter is None:
        return None
    module, _, attr = kind.own_drafter.partition(":")
    return getattr(importlib.import_module(module), attr)


def names() -> list[str]:
    """Every drafter name a spec may start with, grafted ones included."""
    return [*REGISTRY, *(f"{n}+{g}" for g in GRAFTS for n, e in REGISTRY.items() if e.graftable)]


@dataclass(frozen=True)
class DrafterSpec:
    base: str  # a drafter name (`entry`)
    graft: str = ""  # base+graft: a key of GRAFTS, "" none
    value: Any = None  # the positional option's value, as its field's type

    @property
    def name(self) -> str:
        return self.base + (f"+{self.graft}" if self.graft else "")


def parse_spec(text: str) -> DrafterSpec:
    """`eagle+lookup:12` -> DrafterSpec('eagle', graft='lookup', value='12'); unknown names are an error."""
    name, colon, value = text.strip().partition(":")
    base, plus, graft = name.partition("+")
    if plus and graft not in GRAFTS:
        raise ValueError(f"unknown drafter '{text}': choose from {', '.join(names())}")
    found = entry(base)
    if found is None or (name != base and not found.graftable):
        raise ValueError(f"unknown drafter '{text}': choose from {', '.join(names())}")
    if colon and found.positional is None:
        raise ValueError(f"'{text}': the {base} drafter takes no ':' value")
    if colon and not value:
        raise ValueError(f"'{text}': give a value after ':' ({found.positional})")
    if not colon:
        return DrafterSpec(base, graft)
    return DrafterSpec(base, graft, _coerce(value, _fields(found.options)[found.positional], text))


def _fields(cls: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def option_names(spec: str | DrafterSpec) -> list[str]:
    """The options a drafter spec takes."""
    spec = parse_spec(spec) if isinstance(spec, str) else spec
    keys = list(_fields(entry(spec.base).options))
    if spec.graft:
        keys += [k for k in _fields(REGISTRY[spec.graft].options) if k != "budget" and k not in keys] + list(
            _fields(GraftOptions)
        )
    return keys


def _coerce(value: str, field: dataclasses.Field, where: str) -> Any:
    """A positional value (a string) as the field's type."""
    if "str" in field.type:
        return value
    number = float if field.type.startswith("float") else int
    try:
        return number(value)
    except ValueError:
        raise ValueError(f"'{where}': {field.name} takes a number, got {value!r}") from None


def resolve(spec: str | DrafterSpec, profile: str | None = None, **options: Any) -> dict[str, Any]:
    """The options objects of a spec: {'inner': ..., 'lookup': ..., 'graft': ...} (the last two when grafted).

    `options` with value None are left to the profile and the defaults.
    """
    spec = parse_spec(spec) if isinstance(spec, str) else spec
    found = entry(spec.base)
    given = {k: v for k, v in options.items() if v is not None}
    unknown = [k for k in given if k not in option_names(spec)]
    if unknown:
        raise ValueError(
            f"the {spec.name} drafter takes no option {', '.join(repr(k) for k in unknown)} "
            f"(it takes: {', '.join(option_names(spec)) or 'none'})"
        )
    if spec.value is not None:
        given.setdefault(found.positional, spec.value)
    for source, target in found.also_sets.items():
        if source in given:
            given.setdefault(target, given[source])
    values = {**profiles.options(profile, spec.base), **given}
    groups = {"inner": found.options}
    if spec.graft:
        groups.update(lookup=REGISTRY[spec.graft].options, graft=GraftOptions)
    resolved = {}
    for group, cls in groups.items():
        keys = [k for k in _fields(cls) if not (group == "lookup" and k == "budget")]  # a graft's budget is its own
        resolved[group] = cls(**{k: v for k, v in values.items() if k in keys})
        values = {k: v for k, v in values.items() if k not in keys}
    return resolved


def make_drafter(
    spec: str | DrafterSpec,
    model: Any = None,
    tokenizer: Any = None,
    *,
    model_name: str | None = None,
    profile: str | None = None,
    **options: Any,
) -> Drafter:
    """Build the drafter `spec` names for `model`; trained drafters load `heads=DIR`, else the heads shipped
    for `model_name` (an embedded model's name). `profile` None: the profile of `model_name`
    (`profiles.default_profile`); pass "neutral" for the library defaults alone."""
    spec = parse_spec(spec) if isinstance(spec, str) else spec
    if profile is None:
        profile = profiles.default_profile(model_name)
    resolved = resolve(spec, profile, **options)
    ctx = Context(model, tokenizer, model_name)
    drafter = entry(spec.base).build(resolved["inner"], ctx)
    if not spec.graft and not entry(spec.base).branches_alone:
        return drafter
    from headstart.runtime.drafters.base import Drafter
    from headstart.runtime.drafters.graft import LookupGraft

    if not spec.graft:  # `branches_alone`: its branches grafted onto the none drafter
        return LookupGraft(Drafter(), drafter, resolved["inner"].budget, name=spec.base)

    branches = REGISTRY[spec.graft].build(resolved["lookup"], ctx)
    return LookupGraft(drafter, branches, resolved["graft"].graft_budget)
