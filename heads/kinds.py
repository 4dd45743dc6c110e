"""The head-kind registry: everything the rest of headstart needs to know about a kind of draft head, in one entry.

Training, evaluation, the checkpoint reader, `headstart calibrate`, the export and the drafters ask this table
instead of branching on a kind's name. Adding a kind (docs/architecture.md, "Adding a head kind") is its module
(the head: an nn.Module, its loss and its per-depth logits) plus one line in `KINDS`; a test may `register` one.

The contract of an entry's functions, `tools` being `Tools` (what the trainer or the evaluation provides):

    build(model, **options) -> head             a fresh head for the target `model` (a Hugging Face causal LM)
    training_options(cfg) -> dict               build options from the training config's `heads` section
    saved_options(head) -> dict                 options only known once built (saved with the weights)
    prepare(head, model) -> None                after the draft vocabulary is set, before training (optional)
    feature_layers(head) -> tuple[int, ...]     the target's hidden states the loss reads (-1: the final feature)
    eval_depth(head, cfg) -> int                the drafting depths evaluation scores
    loss(module, head, hidden, batch, tools, step) -> scalar            training (`module`: head as wrapped)
    depth_logits(head, hidden, ids, depths, tools) -> [(B, T', N)]      depth k at t: the token k + 1 ahead
    fit(weights, model_config, options) -> options     published heads' tensors checked against the target (raises
                                                      `Misfit`); the options completed from them (optional)

A kind's drafter is a drafter registered by name (runtime/drafters/registry.py) or, for a kind that brings its
own, "module:attr" of that drafter's registry `Entry`: then the drafter is called by the kind's name. A kind's own
training options are a dataclass (`options`) read from a training config's `heads.options` mapping.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from headstart.heads import losses
from headstart.heads.eagle import EagleHead
from headstart.heads.eagle3 import PLAIN_VARIANT, VARIANT_FLAGS, Eagle3Head, engine_feature_layers
from headstart.heads.medusa import MedusaHeads


@dataclass(frozen=True)
class Tools:
    """What a kind's loss and per-depth logits are given: readouts and embeddings in float32, the options."""

    readout: Callable[[torch.Tensor], torch.Tensor]  # (..., H) -> (..., N): the target's lm_head over the draft vocab
    embed: Callable[[torch.Tensor], torch.Tensor]  # token ids -> (..., H) embeddings
    target_readout: Any = None  # the target's DraftReadout (p over the draft vocabulary)
    to_draft: Callable[[torch.Tensor], torch.Tensor] | None = None  # target ids -> draft indices (-1: outside)
    options: Any = None  # the training config's `heads` section (num_heads, unroll, feature_noise ...)


def _final(head: nn.Module) -> tuple[int, ...]:
    return (-1,)


class Misfit(ValueError):
    """Published heads whose tensors do not fit the target: `what` differs, `theirs` in the heads, `ours` in the
    target (or one message of its own)."""

    def __init__(self, what: str, theirs: Any = None, ours: Any = None) -> None:
        super().__init__(what)
        self.what, self.theirs, self.ours = what, theirs, ours


@dataclass(frozen=True)
class HeadKind:
    name: str
    build: Callable[..., nn.Module]
    drafter: str  # the drafter that decodes with heads of this kind: a registered name, or "module:attr" (its own)
    loss: Callable[..., torch.Tensor] | None  # None: its `trains_target` hook's loss
    depth_logits: Callable[..., list[torch.Tensor]]
    training_options: Callable[[Any], dict] = lambda cfg: {"draft_vocab": cfg.draft_vocab}
    saved_options: Callable[[nn.Module], dict] = lambda head: {}
    prepare: Callable[[nn.Module, nn.Module], None] | None = None
    feature_layers: Callable[[nn.Module], tuple[int, ...]] = _final
    eval_depth: Callable[[nn.Module, Any], int] = lambda head, cfg: cfg.num_heads
    static_tree: bool = False  # its tree is shaped from measured per-rank accuracies (Medusa) when not sampled
    sized: bool = True  # its drafter's tree budget is chosen by the cost curve (runtime/engine.py `tree_choice`)
    # "module:Class" of a hook that trains the target beside the heads (the trainer builds it; train/trainer.py)
    trains_target: str | None = None
    export_refusal: str | None = "only EAGLE-3 heads export: vLLM and SGLang load those"  # None: it is one
    fit: Callable[[dict, Any, dict], dict] | None = None  # published heads' shape checks (None: none are read)
    options: type | None = None  # a dataclass of its own training options (`heads.options`); None: it takes none

    @property
    def own_drafter(self) -> str | None:
        """ "module:attr" of the drafter `Entry` this kind brings (called by the kind's name), or None."""
        return self.drafter if ":" in self.drafter else None

    @property
    def drafter_name(self) -> str:
        """The name its heads are decoded by: `--drafter NAME`."""
        return self.name if self.own_drafter else self.drafter


# ---- the built-in kinds -------------------------------------------------------------------------------------


def _medusa_options(cfg) -> dict:
    return {"draft_vocab": cfg.draft_vocab, "num_heads": cfg.num_heads, "own_lm_head": cfg.own_lm_head}


def _medusa_fit(w: dict, cfg, options: dict) -> dict:
    if w["lm_heads.0.weight"].shape[1] != cfg.hidden_size:
        raise Misfit("hidden size", w["lm_heads.0.weight"].shape[1], cfg.hidden_size)
    return options


def _heads_built(head: nn.Module, cfg) -> int:
    """Medusa's evaluation depth: one per head it has."""
    return head.num_heads


def _medusa_build(model: nn.Module, **options) -> MedusaHeads:
    heads = MedusaHeads(model.config.hidden_size, model.config.vocab_size, **options)
    heads.init_lm_heads(model.get_output_embeddings())
    return heads


def _medusa_loss(module, head, hidden, batch, tools: Tools, step: int) -> torch.Tensor:
    return losses.medusa_loss(
        module, hidden, tools.readout, batch["input_ids"], batch["loss_mask"], tools.options.num_heads, tools.to_draft
    )


def _medusa_depths(head, hidden, ids, depths: int, tools: Tools) -> list[torch.Tensor]:
    feats = head.features(hidden)
    return [head.head_logits(k, feats[k - 1], tools.readout) for k in range(1, depths + 1)]


def _unroll(cfg, step: int) -> int:
    """Steps of the training-time test at optimizer step `step`."""
    return cfg.unroll if step >= cfg.unroll_from_step else 1


def _eagle_loss(module, head, hidden, batch, tools: Tools, step: int) -> torch.Tensor:
    o = tools.options
    loss, _ = losses.eagle_loss(
        module,
        hidden,
        tools.embed,
        tools.readout,
        batch["input_ids"],
        batch["loss_mask"],
        noise=o.feature_noise,
        ce_weight=o.ce_weight,
        unroll=_unroll(o, step),
    )
    return loss


def _eagle_depths(head, hidden, ids, depths: int, tools: Tools) -> list[torch.Tensor]:
    outs = losses.eagle_unroll(head, hidden[:, :-1], tools.embed(ids[:, 1:]), depths)  # out_k[s]: root s - k + 1
    return [tools.readout(out[:, k - 1 :]) for k, out in enumerate(outs, 1)]  # re-indexed by root


def _eagle_fit(w: dict, cfg, options: dict) -> dict:
    if tuple(w["fc.weight"].shape) != (cfg.hidden_size, 2 * cfg.hidden_size):
        raise Misfit("hidden size", w["fc.weight"].shape[0], cfg.hidden_size)
    return options


def _eagle3_fit(w: dict, cfg, options: dict) -> dict:
    """fc fuses k >= 2 of the target's hidden states; which ones its config says (else k = 3: the default three)."""
    hidden, n_layers, fc = cfg.hidden_size, cfg.num_hidden_layers, tuple(w["fc.weight"].shape)
    fused = fc[1] // hidden if fc[0] == hidden else 0
    if fused < 2 or fc != (hidden, fused * hidden):
        raise Misfit("fc of shape", fc, f"(hidden {hidden}, k x hidden)")
    if "layers" not in options and fused != 3:
        raise Misfit(
            f"they fuse {fused} target layers and their config does not say which "
            "(eagle_aux_hidden_state_layer_ids): refused rather than guessed"
        )
    layers = options.get("layers") or list(engine_feature_layers(n_layers))
    if not all(1 <= k <= n_layers for k in layers) or len(layers) != fused:
        raise Misfit(f"{fused} fused layers", layers, f"{n_layers} layers")
    if "draft_vocab" in w and int(w["draft_vocab"].max()) >= cfg.vocab_size:
        raise Misfit("draft token id", int(w["draft_vocab"].max()), f"a vocabulary of {cfg.vocab_size}")
    return {**options, "layers": layers}


def _eagle3_loss(module, head, hidden, batch, tools: Tools, step: int) -> torch.Tensor:
    return losses.eagle3_loss(
        module,
        hidden,
        tools.embed,
        head.logits,
        tools.target_readout,
        batch["input_ids"],
        batch["loss_mask"],
        _unroll(tools.options, step),
        tools.to_draft,
        fused_width=head.fc.in_features,
    )


def _eagle3_depths(head, hidden, ids, depths: int, tools: Tools) -> list[torch.Tensor]:
    fused = head.fc.in_features  # the fused layers in (the final feature after them is not read here)
    outs = losses.eagle_unroll(head, hidden[:, :-1, :fused], tools.embed(ids[:, 1:]), depths)
    return [head.logits(out[:, k - 1 :]).float() for k, out in enumerate(outs, 1)]


def _eagle3_options(cfg) -> dict:
    variant = {flag: getattr(cfg, flag) for flag in VARIANT_FLAGS} | {"num_layers": cfg.draft_layers}
    changed = {k: v for k, v in variant.items() if PLAIN_VARIANT[k] != v}
    layers = {"layers": list(cfg.fused_layers)} if cfg.fused_layers else {}
    return {"draft_vocab": cfg.draft_vocab, **layers, **changed}


MEDUSA = HeadKind(
    "medusa",
    _medusa_build,
    "medusa",
    _medusa_loss,
    _medusa_depths,
    _medusa_options,
    static_tree=True,
    eval_depth=_heads_built,
    fit=_medusa_fit,
    export_refusal="medusa heads cannot be exported: vLLM and SGLang load EAGLE-3 heads (vLLM 0.33 removed Medusa; "
    "SGLang never had it)",
)
MEDUSA2 = HeadKind(  # Medusa heads + the LoRA on the target they trained with (train/medusa2.py trains both)
    "medusa2",
    _medusa_build,
    "medusa2",
    None,
    _medusa_depths,
    _medusa_options,
    static_tree=True,
    eval_depth=_heads_built,
    trains_target="headstart.train.medusa2:LoraTraining",
    export_refusal="medusa2 heads cannot be exported: vLLM and SGLang load EAGLE-3 heads",
)
EAGLE = HeadKind(
    "eagle",
    EagleHead.for_target,
    "eagle",
    _eagle_loss,
    _eagle_depths,
    fit=_eagle_fit,
    export_refusal="EAGLE-1 heads cannot be exported faithfully: their fc has a bias (vLLM drops it) and they "
    "predict post-norm features; train an eagle3 head (heads.kind: eagle3)",
)
EAGLE3 = HeadKind(
    "eagle3",
    Eagle3Head.for_target,
    "eagle3",
    _eagle3_loss,
    _eagle3_depths,
    training_options=_eagle3_options,
    saved_options=lambda head: {"layers": list(head.feature_layers), **head.variant(changed_only=True)},
    prepare=lambda head, model: head.init_lm_head(model.get_output_embeddings()),
    feature_layers=lambda head: (*head.feature_layers, -1),  # and the final feature, for p
    fit=_eagle3_fit,
    export_refusal=None,
)
KINDS: dict[str, HeadKind] = {kind.name: kind for kind in (MEDUSA, MEDUSA2, EAGLE, EAGLE3)}


def register(kind: HeadKind) -> HeadKind:
    """Add a kind (a new one, or a test's); returns it."""
    KINDS[kind.name] = kind
    return kind


def get_kind(name: str) -> HeadKind:
    """The registered kind `name`, or a ValueError naming the kinds there are."""
    if name not in KINDS:
        raise ValueError(f"unknown head kind '{name}': choose one of {', '.join(KINDS)}")
    return KINDS[name]
