"""The training recipe: a config checked, the launch set up (Accelerate, DeepSpeed on CPUs, W&B), the target
loaded, data distilled when missing, then one `Trainer` per head kind. `train/heads.py` is its entry point."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

import torch

from headstart.heads.kinds import KINDS
from headstart.runtime import background
from headstart.runtime.models import load_model
from headstart.train.config import ConfigError, TrainConfig, config_to_dict, ensure_writable_dir, own_options
from headstart.train.data import load_rows
from headstart.train.fsdp import fsdp_launch
from headstart.train.sources import answered_ids, check_sources
from headstart.train.trainer import SCHEDULES, Trainer


def load_target(cfg: TrainConfig):
    """(frozen model, tokenizer) of `target` (`tiny`: runtime/models.py's test model, from the run's seed)."""
    model, tokenizer = load_model(cfg.target.model, dtype=cfg.target.dtype, adapter=cfg.target.adapter or None)
    model.config.name_or_path = cfg.target.model
    return model, tokenizer


def run(cfg: TrainConfig) -> dict[str, dict[str, float]]:
    """Train each head kind of `cfg.heads.kind` (one of KINDS or a comma list); returns {kind: held-out metrics}."""
    kinds = [k.strip() for k in cfg.heads.kind.split(",") if k.strip()]
    if not kinds or any(k not in KINDS for k in kinds):
        raise ConfigError(f"heads.kind must be one of {', '.join(KINDS)} or a comma list; got '{cfg.heads.kind}'")
    for k in kinds:
        own_options(KINDS[k], cfg.heads.options)  # checked before anything loads
    lora = [k for k in kinds if KINDS[k].trains_target]  # Medusa-2: a LoRA on the target trains too
    for key, value in (("output_dir", cfg.output_dir), ("data.path", cfg.data.path)):
        if not value:
            raise ConfigError(f"{key} is required (a folder; the configs in configs/ set it)")
    if cfg.heads.keep_vocab and not cfg.heads.init_from:
        raise ConfigError("heads.keep_vocab keeps the vocabulary of heads.init_from, which is not set")
    if cfg.mixed_precision not in ("", "no", "bf16", "fp16"):
        raise ConfigError(
            f"mixed_precision must be no, bf16 or fp16 (or unset: the launcher's), got '{cfg.mixed_precision}'"
        )
    if cfg.optim.schedule not in SCHEDULES:
        raise ConfigError(f"optim.schedule must be one of {', '.join(SCHEDULES)}, got '{cfg.optim.schedule}'")
    if cfg.save_dtype not in ("bfloat16", "float32", "float16"):
        raise ConfigError(f"save_dtype must be bfloat16, float32 or float16, got '{cfg.save_dtype}'")
    if cfg.heads.unroll < 1:
        raise ConfigError(f"heads.unroll must be >= 1, got {cfg.heads.unroll}")
    if lora and cfg.data.features:
        raise ConfigError(
            f"data.features: a {lora[0]} run cannot use a feature cache (the target's features change as "
            "its LoRA trains); remove data.features"
        )
    if lora and cfg.target.adapter:
        raise ConfigError(
            f"target.adapter: a {lora[0]} run trains its own LoRA on the base model; remove target.adapter"
        )
    if len(kinds) == 1:
        return {kinds[0]: run_one(cfg, last=True)}
    results = {}
    for kind in kinds:
        one = dataclasses.replace(cfg, output_dir=str(Path(cfg.output_dir) / kind))
        one.heads = dataclasses.replace(cfg.heads, kind=kind)
        results[kind] = run_one(one, last=kind == kinds[-1])
    return results


def ensure_data(cfg: TrainConfig, model, tokenizer, accelerator) -> None:
    """Distill `data.distill_prompts` into `data.path` when it holds no shards yet (main process only)."""
    if not cfg.data.distill_prompts or any(Path(cfg.data.path).glob("shard-*.jsonl")):
        return
    if accelerator.is_main_process:
        from headstart.runtime.prompts import load_prompts
        from headstart.train.distill import distill

        prompts = load_prompts(
            cfg.data.distill_prompts, permissive_only=True, limit=cfg.data.distill_limit, skip_malformed=True
        )
        if cfg.data.engine:
            from headstart.train.distill_remote import distill_with_engine

            distill_with_engine(
                cfg.data.engine,
                model,
                tokenizer,
                prompts,
                cfg.data.path,
                cfg.data.distill_max_new_tokens,
                concurrency=cfg.data.engine_concurrency,
            )
        else:
            distill(
                model,
                tokenizer,
                prompts,
                cfg.data.path,
                max_new_tokens=cfg.data.distill_max_new_tokens,
                skip_ids=answered_ids(cfg.data.sources),
            )
    accelerator.wait_for_everyone()


def make_accelerator(cfg: TrainConfig, log_with: str | None, out: Path):
    """Accelerate's Accelerator for this launch. Without GPUs a DeepSpeed launch runs DeepSpeed's CPU accelerator
    over gloo (Accelerate's CPU mode would drop DeepSpeed silently); other launches run in that CPU mode."""
    from accelerate import Accelerator, PartialState
    from accelerate.utils import DistributedType

    deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    cpu = not torch.cuda.is_available()
    if cpu and deepspeed:
        PartialState(backend="gloo")
    mixed = cfg.mixed_precision or None  # None: what `accelerate launch --config_file ...` says (its environment)
    accelerator = Accelerator(mixed_precision=mixed, log_with=log_with, project_dir=str(out), cpu=cpu and not deepspeed)
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        if cfg.optim.grad_accum != 1:  # DeepSpeed's engine steps at each backward the loop runs
            raise ConfigError(
                f"optim.grad_accum: a DeepSpeed launch takes 1, not {cfg.optim.grad_accum} (raise "
                "data.batch_tokens or the number of processes instead)"
            )
        config = accelerator.state.deepspeed_plugin.deepspeed_config
        config["train_micro_batch_size_per_gpu"] = 1  # batches are token budgets: DeepSpeed only logs this number
        config["gradient_accumulation_steps"] = 1
        config["gradient_clipping"] = cfg.optim.grad_clip
    return accelerator


def run_one(cfg: TrainConfig, last: bool = True) -> dict[str, float]:
    """Train one head kind as `cfg` says; returns the final held-out metrics. Only the `last` run of a launch
    ends training (which tears the process group down): the others only close their trackers."""
    from accelerate.utils import set_seed

    out = ensure_writable_dir(cfg.output_dir)
    log_with = None if cfg.report_to == "none" else cfg.report_to
    if cfg.report_to == "wandb" and not os.environ.get("WANDB_API_KEY") and "WANDB_MODE" not in os.environ:
        os.environ["WANDB_MODE"] = "offline"
        print("headstart: no WANDB_API_KEY: W&B logs offline (sync later with `wandb sync`)", file=sys.stderr)
    accelerator = make_accelerator(cfg, log_with, out)
    background.register(f"train {cfg.heads.kind} -> {cfg.output_dir}")  # benchmarks stop it while they measure
    if KINDS[cfg.heads.kind].trains_target and fsdp_launch(accelerator):
        raise ConfigError(
            f"heads.kind: {cfg.heads.kind} trains a LoRA inside the target, which an FSDP launch would "
            "shard; launch it with configs/accelerate/ddp.yaml or deepspeed_zero2.yaml"
        )
    set_seed(cfg.seed)
    model, tokenizer = load_target(cfg)
    ensure_data(cfg, model.to(accelerator.device), tokenizer, accelerator)
    folders = [cfg.data.path, *cfg.data.sources]
    check_sources(folders, model, tokenizer)
    rows = load_rows(folders, cfg.data.max_len)
    heldout = None
    if cfg.data.heldout:
        check_sources([cfg.data.heldout], model, tokenizer)
        heldout = load_rows(cfg.data.heldout, cfg.data.max_len)
    trainer = Trainer(cfg, accelerator, model, tokenizer, rows, heldout)
    if accelerator.is_main_process:
        (out / "config.json").write_text(json.dumps(config_to_dict(cfg), indent=2))
    if log_with:
        name = cfg.run_name or f"{cfg.heads.kind}-{Path(cfg.target.model).name}-{Path(cfg.data.path).name}"
        init = {"wandb": {"name": name, "dir": str(out)}} if cfg.report_to == "wandb" else {}
        accelerator.init_trackers("headstart", config=config_to_dict(cfg), init_kwargs=init)
    metrics = trainer.fit()
    if last:
        accelerator.end_training()
    else:
        for tracker in accelerator.trackers:
            tracker.finish()
    return metrics
