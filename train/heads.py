"""Train Medusa, Medusa-2, EAGLE or EAGLE-3 heads on a target: the `accelerate launch` entry point.

    accelerate launch train/heads.py --config configs/smoke.yaml [key.sub=value ...]

One process on a CPU to many GPUs on many nodes: only Accelerate's own launch options change.
The target runs under no_grad and only the heads train, except in Medusa-2 (`heads.kind: medusa2`,
train/medusa2.py), where a LoRA on the target trains with them. Checkpoints (`accelerator.save_state`) every
`save_every` steps; started again with the same command, a run resumes from its last checkpoint and
reaches the same weights as an uninterrupted run (same seed, single process).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

import torch
from torch import nn

from headstart.extras import MissingExtraError, require
from headstart.heads.checkpoint import build_heads, save_heads, target_fingerprint
from headstart.heads.kinds import KINDS, Tools, get_kind
from headstart.heads.load import load_heads
from headstart.heads.vocab import DraftReadout, frequent_tokens
from headstart.runtime import background
from headstart.runtime.tokens import pad_id
from headstart.train.config import (
    ConfigError,
    TrainConfig,
    config_to_dict,
    ensure_writable_dir,
    load_config,
    portable,
)
from headstart.train.data import Row, collate, load_rows, make_batches, split_rows
from headstart.train.evaluate import rank_hits, summarize
from headstart.train.features import FeatureCache, target_features
from headstart.train.fsdp import fsdp_launch, held_share, shard_target
from headstart.train.medusa2 import AdaptedTarget, attach_lora, drift_kl, medusa2_loss, save_adapter
from headstart.train.sources import answered_ids, check_sources


def load_target(cfg: TrainConfig):
    """(frozen model, tokenizer). `tiny` = a 2-layer random Llama over the SmolLM2 tokenizer's vocabulary."""
    from headstart.runtime.models import DEFAULT_MODEL, load_model

    if cfg.target.model == "tiny":
        from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

        from headstart.runtime.models import resolve_model_dir

        tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(DEFAULT_MODEL), local_files_only=True)
        torch.manual_seed(cfg.seed)
        config = LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=2048,
            tie_word_embeddings=True,
        )
        model = LlamaForCausalLM(config).eval().requires_grad_(False)
        model.config.name_or_path = "tiny"
        return model, tokenizer
    model, tokenizer = load_model(cfg.target.model, dtype=cfg.target.dtype, adapter=cfg.target.adapter or None)
    model.config.name_or_path = cfg.target.model
    return model, tokenizer


SCHEDULES = ("cosine", "constant")


def lr_lambda(cfg: TrainConfig):
    """Linear warmup, then cosine decay to 10 % of the peak over max_steps optimizer steps, or the peak held
    (`constant`: a run that later sessions continue has no end to decay towards)."""
    warmup, total = cfg.optim.warmup_steps, cfg.optim.max_steps

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if cfg.optim.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


class Trainer:
    def __init__(
        self, cfg: TrainConfig, accelerator, model, tokenizer, rows: list[Row], heldout: list[Row] | None = None
    ) -> None:
        self.cfg = cfg
        self.acc = accelerator
        self.model = self.base = model.to(accelerator.device)  # Medusa-2: self.model becomes base + its LoRA
        self.tokenizer = tokenizer
        self.pad_id = pad_id(tokenizer)
        if heldout is None:
            self.train_rows, self.eval_rows = split_rows(rows, cfg.data.eval_rows)
        else:  # the committed held-out rows: their ids never train, whichever source holds them
            scored = {row.id for row in heldout}
            self.train_rows, self.eval_rows = [r for r in rows if r.id not in scored], heldout
            rows = self.train_rows + heldout
            for i, row in enumerate(rows):
                row.index = i
        if not self.train_rows:
            raise ValueError(f"no training rows left after holding out {cfg.data.eval_rows} for evaluation")
        self.kind = get_kind(cfg.heads.kind)  # what the kind needs (heads/kinds.py)
        self.options = self.kind.training_options(cfg.heads)
        heads = build_heads(cfg.heads.kind, model, **self.options).float()
        self.options.update(self.kind.saved_options(heads))
        self.layers = self.kind.feature_layers(heads)  # the target hidden states the loss reads
        self.sharded = shard_target(model, accelerator)  # an FSDP launch: each process holds 1/N of the target
        if self.sharded:
            held, total = held_share(model)
            print(
                f"headstart: process {accelerator.process_index} of {accelerator.num_processes} holds {held} of the "
                f"target's {total} decoder-layer weights",
                file=sys.stderr,
                flush=True,
            )
        self.features = self.cache_features(rows) if cfg.data.features else None
        if cfg.heads.draft_vocab and not cfg.heads.keep_vocab:
            responses = (row.input_ids[row.n_prompt :] for row in self.train_rows)
            heads.draft_vocab.copy_(frequent_tokens(responses, cfg.heads.draft_vocab, model.config.vocab_size))
        if self.kind.prepare is not None:
            self.kind.prepare(heads, model)
        self.started_from = None  # the trained heads this run starts from (config.json's "init_from")
        if cfg.heads.init_from:
            self.started_from = init_from_trained(heads, cfg.heads.init_from, model, tokenizer, cfg.heads.keep_vocab)
        groups = [{"params": list(heads.parameters())}]
        trained: nn.Module = heads
        if self.kind.trains_target:  # Medusa-2: the target's LoRA trains beside the heads, at its own learning rate
            self.model = attach_lora(model, cfg.heads.lora)
            trained = AdaptedTarget(self.model, heads)
            groups.append({"params": [p for p in self.model.parameters() if p.requires_grad], "lr": cfg.heads.lora.lr})
        optimizer = torch.optim.AdamW(
            groups, lr=cfg.optim.lr, betas=cfg.optim.betas, weight_decay=cfg.optim.weight_decay
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
        # `self.module`: what trains, as Accelerate wrapped it (DDP ...); its forward is what a step runs first
        self.module, self.optimizer = accelerator.prepare(trained, optimizer)
        accelerator.register_for_checkpointing(self.scheduler)
        self.readout = heads.readout(model.get_output_embeddings())
        self.target_readout = DraftReadout(model.get_output_embeddings(), heads.draft_vocab)  # p over the draft vocab
        self.embed = model.get_input_embeddings()
        self.tools = Tools(self.readout_f32, self.embed_f32, self.target_readout, self.readout.to_draft, cfg.heads)
        self._epoch = 0
        self.rank_accuracy: list[list[float]] = []
        self._batches = make_batches(self.train_rows, cfg.data.batch_tokens, cfg.seed)
        self.batches_per_epoch = len(self._batches)  # the grouping is fixed, only its order changes per epoch

    @property
    def heads(self) -> nn.Module:
        """The heads being trained, unwrapped."""
        module = self.acc.unwrap_model(self.module)
        return module.heads if isinstance(module, AdaptedTarget) else module

    # ---- data ------------------------------------------------------------------------------------

    def micro_batch(self, index: int) -> dict[str, torch.Tensor]:
        """The `index`-th micro-batch of the endless stream, reshuffled each epoch: a pure function of index."""
        epoch, i = divmod(index, self.batches_per_epoch)
        if self._epoch != epoch:
            self._epoch = epoch
            self._batches = make_batches(self.train_rows, self.cfg.data.batch_tokens, self.cfg.seed + epoch)
        batch = collate([self.train_rows[j] for j in self._batches[i]], self.pad_id)
        return {k: v.to(self.acc.device) for k, v in batch.items()}

    # ---- one loss --------------------------------------------------------------------------------

    def cache_features(self, rows: list[Row]) -> FeatureCache:
        """The target's features of every row from data.features, computing what is missing (split over processes)."""
        acc = self.acc
        key = {**target_fingerprint(self.model, self.tokenizer, self.cfg.target.model), "dtype": str(self.model.dtype)}
        cache = FeatureCache(ensure_writable_dir(self.cfg.data.features), rows, key, self.layers)
        acc.wait_for_everyone()  # every process has scanned what exists before any writes more: their shares agree
        built = cache.build(
            self.model,
            self.pad_id,
            self.cfg.data.batch_tokens,
            acc.process_index,
            acc.num_processes,
            progress=acc.is_local_main_process,
            lockstep=self.sharded,
        )
        acc.wait_for_everyone()
        cache.scan()
        acc.print(f"headstart: target features of {len(rows)} rows from {cache.dir} ({built} computed now)")
        return cache

    def target_features(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Frozen target: its hidden states `self.layers` (B, T, F), from the cache when there is one."""
        if self.features is not None:
            width = batch["input_ids"].shape[1]
            return self.features.batch(batch["row_index"].tolist(), width).to(self.acc.device).float()
        return target_features(self.model, batch["input_ids"], batch["attention_mask"], self.layers).float()

    def loss(self, batch: dict[str, torch.Tensor], step: int = 0) -> torch.Tensor:
        """The training loss of one micro-batch at optimizer step `step` (0-based)."""
        cfg = self.cfg.heads
        if self.kind.trains_target:  # Medusa-2: the adapted target's features, with gradient into its LoRA
            return medusa2_loss(
                self.module,
                self.heads,
                self.readout_f32,
                self.lm_head_weight,
                batch["input_ids"],
                batch["attention_mask"],
                batch["loss_mask"],
                cfg.num_heads,
                cfg.lora.kl_weight,
                self.readout.to_draft,
            )
        return self.kind.loss(self.module, self.heads, self.target_features(batch), batch, self.tools, step)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.get_output_embeddings().weight

    def readout_f32(self, x: torch.Tensor) -> torch.Tensor:
        """The target's lm_head over the draft vocabulary, in float32: (..., H) -> (..., N)."""
        return self.readout(x).float()

    def embed_f32(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed(ids).float()

    # ---- evaluation ------------------------------------------------------------------------------

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Per-head top-1/top-5, conditional acceptance and simulated acceptance length on held-out rows
        (`train/evaluate.py`); Medusa-2 also the adapted target's drift from the original (`drift/kl`: mean KL
        per token)."""
        module, heads = self.acc.unwrap_model(self.module), self.heads
        module.eval()
        drift = [0.0, 0]  # Medusa-2: sum of per-token KL, tokens
        K = self.cfg.heads.num_heads
        hits: list[list[torch.Tensor]] = [[] for _ in range(K)]
        for start in range(0, len(self.eval_rows), 8):
            batch = collate(self.eval_rows[start : start + 8], self.pad_id)
            batch = {k: v.to(self.acc.device) for k, v in batch.items()}
            ids, mask = batch["input_ids"], batch["loss_mask"]
            if self.kind.trains_target:  # Medusa-2: the adapted target's features; its drift from the original
                hidden, original = module(ids, batch["attention_mask"])
                n = int(mask[:, 1:].sum())
                if n:
                    kl = drift_kl(hidden, original, self.lm_head_weight, mask).item()
                    drift = [drift[0] + kl * n, drift[1] + n]
            else:
                hidden = self.target_features(batch)
            found = rank_hits(self.cfg.heads.kind, heads, hidden, ids, mask, K, self.tools, self.readout.to_target)
            for k, h in enumerate(found):
                hits[k].append(h)
        module.train()
        if not hits[0]:
            return {}
        metrics, self.rank_accuracy = summarize(hits)
        if drift[1]:
            metrics["drift/kl"] = drift[0] / drift[1]
        return metrics

    # ---- checkpoints -----------------------------------------------------------------------------

    @property
    def ckpt_root(self) -> Path:
        return Path(self.cfg.output_dir) / "checkpoints"

    @property
    def metrics_file(self) -> Path:
        return Path(self.cfg.output_dir) / "metrics.jsonl"

    def save_checkpoint(self, step: int) -> None:
        path = self.ckpt_root / f"step-{step:07d}"
        self.acc.save_state(str(path))
        if self.acc.is_main_process:
            (path / "config.json").write_text(json.dumps(config_to_dict(self.cfg), indent=2))
            (path / "trainer.json").write_text(json.dumps({"step": step}))  # written last: marks it complete
            for old in sorted(self.ckpt_root.glob("step-*"))[:-2]:
                shutil.rmtree(old, ignore_errors=True)
        self.acc.wait_for_everyone()

    def resume(self) -> int:
        """Load the newest complete checkpoint; the optimizer step to continue from (0 if none)."""
        done = sorted(p for p in self.ckpt_root.glob("step-*") if (p / "trainer.json").is_file())
        if not done:
            return 0
        self.acc.load_state(str(done[-1]))
        step = json.loads((done[-1] / "trainer.json").read_text())["step"]
        self.acc.print(f"headstart: resuming from {done[-1]} (step {step})")
        if self.acc.is_main_process:
            drop_metrics_after(self.metrics_file, step)
        return step

    def log_metrics(self, step: int, record: dict[str, float]) -> None:
        self.acc.log(record, step=step)
        if self.acc.is_main_process:
            with self.metrics_file.open("a") as f:
                f.write(json.dumps({"step": step, **record}) + "\n")

    # ---- the loop --------------------------------------------------------------------------------

    def fit(self) -> dict[str, float]:
        cfg, acc = self.cfg, self.acc
        out = Path(cfg.output_dir)
        start = self.resume()
        world, rank = acc.num_processes, acc.process_index
        accum = cfg.optim.grad_accum
        tokens, t0 = 0, time.perf_counter()
        from tqdm import tqdm

        bar = tqdm(
            total=cfg.optim.max_steps,
            initial=start,
            desc=f"train {cfg.heads.kind}",
            disable=not acc.is_local_main_process,
            dynamic_ncols=True,
        )
        metrics: dict[str, float] = {}
        best = self.best_so_far(out / "best")  # the best held-out acceptance's heads are kept in out/best
        if start == 0 and cfg.heads.init_from and self.eval_rows:  # where the trained heads start, on this data
            self.log_metrics(0, self.evaluate())
        for step in range(start, cfg.optim.max_steps):
            self.module.train()
            total = 0.0
            for micro in range(accum):
                batch = self.micro_batch((step * accum + micro) * world + rank)
                tokens += int(batch["attention_mask"].sum())
                sync = acc.no_sync(self.module) if micro < accum - 1 else contextlib.nullcontext()
                with sync, acc.autocast():
                    loss = self.loss(batch, step) / accum
                acc.backward(loss)
                total += loss.item()
            acc.clip_grad_norm_(self.module.parameters(), cfg.optim.grad_clip)
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            bar.update(1)
            done = step + 1
            record: dict[str, float] = {}
            if done % cfg.log_every == 0 or done == cfg.optim.max_steps:
                seconds = time.perf_counter() - t0
                total = acc.reduce(torch.tensor(total, device=acc.device), "mean").item()  # over processes
                record.update(
                    {
                        "train/loss": total,
                        "lr": self.scheduler.get_last_lr()[0],
                        "train/tokens_per_s": tokens * world / seconds,
                    }
                )
                bar.set_postfix(loss=f"{total:.3f}")
            if self.eval_rows and (done % cfg.eval_every == 0 or done == cfg.optim.max_steps):
                metrics = self.evaluate()
                record.update(metrics)
                if metrics.get("acceptance_length", 0.0) > best:
                    best = metrics["acceptance_length"]
                    self.save_heads(out / "best", done, metrics)
            if record:
                self.log_metrics(done, record)
            if done % cfg.save_every == 0 or done == cfg.optim.max_steps:
                self.save_checkpoint(done)
        bar.close()
        self.save_heads(out / "heads", cfg.optim.max_steps, metrics)
        return metrics

    def best_so_far(self, folder: Path) -> float:
        """The held-out acceptance length of the heads kept in `folder` by this run (0 if none yet)."""
        config = folder / "config.json"
        if not config.is_file():
            return 0.0
        return json.loads(config.read_text()).get("metrics", {}).get("acceptance_length", 0.0)

    def save_heads(self, folder: Path, steps: int, metrics: dict[str, float]) -> None:
        """The heads as they are now, with what made them, into `folder`. Every process calls it: an FSDP or
        DeepSpeed launch that shards the heads gathers their full weights here; the main process writes them."""
        cfg = self.cfg
        state = self.acc.get_state_dict(self.module)  # the full weights, gathered to the main process
        if not self.acc.is_main_process:
            return
        if self.kind.trains_target:  # Medusa-2 trains base + LoRA + heads as one module: keep the heads'
            state = {k.removeprefix("heads."): v for k, v in state.items() if k.startswith("heads.")}
        extra = {
            "dtype": cfg.save_dtype,
            "training": portable(config_to_dict(cfg)),
            "data_rows": len(self.train_rows),
            "eval_rows": len(self.eval_rows),
            "steps": steps,
            "metrics": metrics,
            "rank_accuracy": self.rank_accuracy,
        }
        if self.started_from is not None:
            extra["init_from"] = self.started_from
        fp = target_fingerprint(self.base, self.tokenizer, name=cfg.target.model)
        if self.kind.trains_target:  # the heads' target is base + this adapter, saved beside them
            fp["adapter"] = save_adapter(self.model, folder, cfg.target.model)
        save_heads(folder, self.heads, cfg.heads.kind, self.options, fp, extra, state)


def drop_metrics_after(path: Path, step: int) -> None:
    """Remove the lines of steps after `step` that a killed run logged past its last checkpoint (and a
    line cut short by the kill)."""

    def kept(line: str) -> bool:
        try:
            return json.loads(line)["step"] <= step
        except (ValueError, KeyError, TypeError):
            return False

    if path.is_file():
        path.write_text("".join(line for line in path.read_text().splitlines(keepends=True) if kept(line)))


def init_from_trained(heads: nn.Module, directory: str, model, tokenizer, keep_vocab: bool = False) -> dict:
    """Copy the weights of the trained heads in `directory` into `heads`, all but the draft vocabulary.

    Medusa and EAGLE predict hidden states that the target's lm_head reads out, so their weights do not
    depend on which tokens the readout scores: a run on new data recomputes the vocabulary from that
    data and starts from these weights. An EAGLE-3 head's own lm_head has a row per draft token: the
    rows move with their tokens (`carry_rows`), so its vocabulary is recomputed too (and may grow).
    With `keep_vocab` the trained vocabulary is taken as it is (a smaller data set than the one that
    chose it would choose worse), so every lm_head row is kept.
    """
    try:
        trained, config = load_heads(directory, model, tokenizer)
        if keep_vocab:
            own = heads.draft_vocab
            if trained.draft_vocab is None or own is None or len(trained.draft_vocab) != len(own):
                size = "all tokens" if trained.draft_vocab is None else f"{len(trained.draft_vocab):,} tokens"
                raise ConfigError(f"heads.keep_vocab: {directory} drafts {size}; set heads.draft_vocab to that size")
            own.copy_(trained.draft_vocab.to(own))
        state = {k: v for k, v in trained.state_dict().items() if k != "draft_vocab"}
        if hasattr(trained, "lm_head"):  # EAGLE-3
            state["lm_head.weight"], carried = carry_rows(trained, heads)
            n = len(state["lm_head.weight"])
            print(
                f"headstart: heads.init_from: {carried:,} of {n:,} draft tokens keep their trained lm_head rows, "
                "the others start from the target's",
                file=sys.stderr,
                flush=True,
            )
        missing, unexpected = heads.load_state_dict(state, strict=False)
    except ConfigError:
        raise
    except (ValueError, RuntimeError) as e:  # not a checkpoint, another target, other shapes
        raise ConfigError(f"heads.init_from: cannot start from {directory}: {e}") from e
    if unexpected or set(missing) - {"draft_vocab"}:
        raise ConfigError(f"heads.init_from: {directory} holds other heads (missing {missing}, extra {unexpected})")
    history = {k: config.extra[k] for k in ("steps", "data_rows", "init_from") if k in config.extra}
    return {"path": str(directory), **history}  # recorded in the new heads' config.json


def carry_rows(trained: nn.Module, heads: nn.Module) -> tuple[torch.Tensor, int]:
    """`heads`' lm_head rows (N, H) with the row of every draft token `trained` also drafts taken from `trained`
    (the others as they are: the target's rows); and how many were taken. A None vocabulary is the whole one."""
    rows = heads.lm_head.weight.detach().clone()  # (N, H)
    old = trained.lm_head.weight.detach().to(rows)  # (N_old, H)
    if old.shape[1] != rows.shape[1]:
        raise ValueError(f"its lm_head reads {old.shape[1]} values, these heads' {rows.shape[1]}")
    new_vocab = heads.draft_vocab if heads.draft_vocab is not None else torch.arange(len(rows))
    old_vocab = trained.draft_vocab.cpu() if trained.draft_vocab is not None else torch.arange(len(old))
    slot = torch.full((max(int(new_vocab.max()), int(old_vocab.max())) + 1,), -1)  # token -> its row in `old`
    slot[old_vocab] = torch.arange(len(old_vocab))
    found = slot[new_vocab.cpu()]  # (N,)
    kept = found >= 0
    rows[kept.to(rows.device)] = old[found[kept].to(old.device)]
    return rows, int(kept.sum())


def run(cfg: TrainConfig) -> dict[str, dict[str, float]]:
    """Train each head kind of `cfg.heads.kind` (one of KINDS or a comma list); returns {kind: held-out metrics}."""
    kinds = [k.strip() for k in cfg.heads.kind.split(",") if k.strip()]
    if not kinds or any(k not in KINDS for k in kinds):
        raise ConfigError(f"heads.kind must be one of {', '.join(KINDS)} or a comma list; got '{cfg.heads.kind}'")
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
    if cfg.target.adapter and cfg.target.model == "tiny":
        raise ConfigError("target.adapter: the built-in `tiny` target takes no adapter (save a model, pass its path)")
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Train draft heads on a frozen target.")
    parser.add_argument("--config", required=True, help="YAML config (configs/*.yaml)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. optim.lr=3e-4 heads.kind=eagle")
    args = parser.parse_intermixed_args(argv)  # overrides may come before or after --config
    try:
        require("train", "training")
        run(load_config(args.config, args.overrides))
    except (ConfigError, ValueError, MissingExtraError) as e:
        print(f"headstart: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
