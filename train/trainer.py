"""The `Trainer`: one head kind trained on a frozen target under Accelerate; evaluation, checkpoints, resume.

Set up by the recipe (train/recipe.py). A kind that trains the target with its heads (Medusa-2's LoRA) brings
a hook, `HeadKind.trains_target` (train/medusa2.py `LoraTraining`): what it trains, its loss, the features
evaluation reads and what it saves beside the heads; the trainer has no branch of its own for it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import math
import shutil
import sys
import time
from pathlib import Path

import torch
from torch import nn

from headstart.heads.checkpoint import build_heads, save_heads, target_fingerprint
from headstart.heads.kinds import Tools, get_kind
from headstart.heads.vocab import DraftReadout, frequent_tokens
from headstart.runtime.tokens import pad_id
from headstart.train.config import TrainConfig, config_to_dict, ensure_writable_dir, own_options, portable
from headstart.train.data import Row, collate, make_batches, split_rows
from headstart.train.evaluate import rank_hits, summarize
from headstart.train.features import FeatureCache, target_features
from headstart.train.fsdp import held_share, shard_target
from headstart.train.warm_start import init_from_trained

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


class CpuClock:
    """The CPU-seconds this process has spent training (every thread; time stopped or waiting is not counted),
    `paused()` while it does something else (evaluation)."""

    def __init__(self, spent: float = 0.0) -> None:
        self.spent, self._since = spent, time.process_time()

    @property
    def seconds(self) -> float:
        return self.spent + time.process_time() - self._since

    @contextlib.contextmanager
    def paused(self):
        self.spent = self.seconds
        try:
            yield
        finally:
            self._since = time.process_time()


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
        # the kind sees the `heads` section with its own options (`heads.options`) built as its dataclass
        section = dataclasses.replace(cfg.heads, options=own_options(self.kind, cfg.heads.options))
        self.options = self.kind.training_options(section)
        heads = build_heads(cfg.heads.kind, model, **self.options).float()
        self.depths = self.kind.eval_depth(heads, section)  # the drafting depths evaluation scores
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
        self.hook = target_hook(self.kind.trains_target, model, heads, cfg.heads)
        if self.hook is not None:  # e.g. Medusa-2: the target's LoRA trains beside the heads, at its own rate
            self.model, trained = self.hook.target, self.hook.module
            groups.append(self.hook.param_group)
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
        self.tools = Tools(self.readout_f32, self.embed_f32, self.target_readout, self.readout.to_draft, section)
        self._epoch = 0
        self.rank_accuracy: list[list[float]] = []
        self._batches = make_batches(self.train_rows, cfg.data.batch_tokens, cfg.seed)
        self.batches_per_epoch = len(self._batches)  # the grouping is fixed, only its order changes per epoch

    @property
    def heads(self) -> nn.Module:
        """The heads being trained, unwrapped."""
        module = self.acc.unwrap_model(self.module)
        return module.heads if self.hook is not None else module

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
        """The target's features of the rows from data.features. What is missing is computed as batches need it
        (`target_features`), except under a sharded target, whose processes run every forward together: there it
        is computed first (split over the processes)."""
        acc = self.acc
        key = {**target_fingerprint(self.model, self.tokenizer, self.cfg.target.model), "dtype": str(self.model.dtype)}
        cache = FeatureCache(ensure_writable_dir(self.cfg.data.features), rows, key, self.layers)
        if not self.sharded:
            acc.print(
                f"headstart: target features of {len(rows) - len(cache.missing())} of {len(rows)} rows cached in "
                f"{cache.dir}; the others are computed, and kept there, as batches need them"
            )
            return cache
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
        """Frozen target: its hidden states `self.layers` (B, T, F): from the cache where it holds every row of the
        batch, else from the target, kept in the cache (when there is one) for the rows it lacked."""
        rows = batch["row_index"].tolist()
        if self.features is not None and self.features.holds(rows):
            return self.features.batch(rows, batch["input_ids"].shape[1]).to(self.acc.device).float()
        hidden = target_features(self.model, batch["input_ids"], batch["attention_mask"], self.layers)
        if self.features is not None:
            self.features.keep(rows, hidden)
        return hidden.float()

    def loss(self, batch: dict[str, torch.Tensor], step: int = 0) -> torch.Tensor:
        """The training loss of one micro-batch at optimizer step `step` (0-based)."""
        if self.hook is not None:  # the target's features come from the module that trains it, with gradient
            return self.hook.loss(self.module, self.heads, batch, self.tools)
        return self.kind.loss(self.module, self.heads, self.target_features(batch), batch, self.tools, step)

    def readout_f32(self, x: torch.Tensor) -> torch.Tensor:
        """The target's lm_head over the draft vocabulary, in float32: (..., H) -> (..., N)."""
        return self.readout(x).float()

    def embed_f32(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed(ids).float()

    # ---- evaluation ------------------------------------------------------------------------------

    @torch.no_grad()
    def evaluate(self, rows: list[Row] | None = None) -> dict[str, float]:
        """Per-head top-1/top-5, conditional acceptance and simulated acceptance length on held-out rows (`rows`:
        default all; `train/evaluate.py`), and what a target-training hook measures besides (Medusa-2: `drift/kl`)."""
        module, heads = self.acc.unwrap_model(self.module), self.heads
        module.eval()
        K = self.depths
        rows = self.eval_rows if rows is None else rows
        extra: dict[str, list[float]] = {}  # a hook's metric: [sum, count]
        hits: list[list[torch.Tensor]] = [[] for _ in range(K)]
        for start in range(0, len(rows), 8):
            batch = collate(rows[start : start + 8], self.pad_id)
            batch = {k: v.to(self.acc.device) for k, v in batch.items()}
            ids, mask = batch["input_ids"], batch["loss_mask"]
            if self.hook is not None:
                hidden, measured = self.hook.eval_features(module, batch)
                for name, (value, n) in measured.items():
                    total = extra.setdefault(name, [0.0, 0])
                    total[0], total[1] = total[0] + value * n, total[1] + n
            else:
                hidden = self.target_features(batch)
            found = rank_hits(self.cfg.heads.kind, heads, hidden, ids, mask, K, self.tools, self.readout.to_target)
            for k, h in enumerate(found):
                hits[k].append(h)
        module.train()
        if not hits[0]:
            return {}
        metrics, self.rank_accuracy = summarize(hits)
        metrics.update({name: value / n for name, (value, n) in extra.items() if n})
        return metrics

    # ---- checkpoints -----------------------------------------------------------------------------

    @property
    def ckpt_root(self) -> Path:
        return Path(self.cfg.output_dir) / "checkpoints"

    @property
    def metrics_file(self) -> Path:
        return Path(self.cfg.output_dir) / "metrics.jsonl"

    def save_checkpoint(self, step: int, cpu_s: float = 0.0) -> None:
        """Everything a resumed run needs at optimizer step `step`, `cpu_s` training CPU-seconds in (all processes')."""
        if self.features is not None:
            self.features.flush()
        path = self.ckpt_root / f"step-{step:07d}"
        self.acc.save_state(str(path))
        if self.acc.is_main_process:
            (path / "config.json").write_text(json.dumps(config_to_dict(self.cfg), indent=2))
            marker = {"step": step, "cpu_s": cpu_s}
            (path / "trainer.json").write_text(json.dumps(marker))  # written last: marks it complete
            for old in sorted(self.ckpt_root.glob("step-*"))[:-2]:
                shutil.rmtree(old, ignore_errors=True)
        self.acc.wait_for_everyone()

    def resume(self) -> tuple[int, float]:
        """Load the newest complete checkpoint; (the optimizer step to continue from, this process's share of the
        training CPU-seconds every process spent before it) ((0, 0.0) if none)."""
        done = sorted(p for p in self.ckpt_root.glob("step-*") if (p / "trainer.json").is_file())
        if not done:
            return 0, 0.0
        self.acc.load_state(str(done[-1]))
        marker = json.loads((done[-1] / "trainer.json").read_text())
        step = marker["step"]
        self.acc.print(f"headstart: resuming from {done[-1]} (step {step})")
        if self.acc.is_main_process:
            drop_metrics_after(self.metrics_file, step)
        return step, marker.get("cpu_s", 0.0) / self.acc.num_processes

    def log_metrics(self, step: int, record: dict[str, float]) -> None:
        self.acc.log(record, step=step)
        if self.acc.is_main_process:
            with self.metrics_file.open("a") as f:
                f.write(json.dumps({"step": step, **record}) + "\n")

    # ---- the loop --------------------------------------------------------------------------------

    def fit(self) -> dict[str, float]:
        cfg, acc = self.cfg, self.acc
        out = Path(cfg.output_dir)
        start, spent = self.resume()
        clock = CpuClock(spent)
        quick = self.eval_rows[: cfg.eval_quick_rows]
        every = cfg.eval_every_cpu_s if quick else 0.0
        next_quick = (spent * acc.num_processes // every + 1) * every if every else math.inf  # the next mark
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
            with clock.paused():
                first = self.evaluate()
                if every:
                    first.update({f"quick/{k}": v for k, v in self.evaluate(quick).items()})
                self.log_metrics(0, {**first, "cpu_s": 0.0})
        done = start
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
            cpu_s = acc.reduce(torch.tensor(clock.seconds, device=acc.device), "sum").item()  # every process's
            last = done == cfg.optim.max_steps or 0 < cfg.max_cpu_s <= cpu_s
            record: dict[str, float] = {}
            if done % cfg.log_every == 0 or last:
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
            with clock.paused():
                if cpu_s >= next_quick and not last:
                    record.update({f"quick/{k}": v for k, v in self.evaluate(quick).items()})
                    next_quick = (cpu_s // every + 1) * every
                if self.eval_rows and (done % cfg.eval_every == 0 or last):
                    metrics = self.evaluate()
                    record.update(metrics)
                    if metrics.get("acceptance_length", 0.0) > best:
                        best = metrics["acceptance_length"]
                        self.save_heads(out / "best", done, metrics)
            if record:
                self.log_metrics(done, {**record, "cpu_s": cpu_s})
            if done % cfg.save_every == 0 or last:
                self.save_checkpoint(done, cpu_s)
            if last:
                break
        bar.close()
        self.save_heads(out / "heads", done, metrics)
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
        if self.hook is not None:  # base + LoRA + heads train as one module: keep the heads'
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
        if self.hook is not None:  # the heads' target is base + what the hook trained, saved beside them
            fp["adapter"] = self.hook.save(folder, cfg.target.model)
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


def target_hook(spec: str | None, model: nn.Module, heads: nn.Module, cfg):
    """The hook named by a kind's `trains_target` ("module:Class"), built over `model` and `heads`; None if none."""
    if not spec:
        return None
    module, name = spec.split(":")
    return getattr(importlib.import_module(module), name)(model, heads, cfg)
