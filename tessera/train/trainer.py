"""The trainer: build everything from a JobConfig, then step, evaluate, log, checkpoint, stop."""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from tessera.config import ConfigError, JobConfig
from tessera.data.objectives import causal_lm
from tessera.data.pipeline import DataBundle, Split, build_data
from tessera.model import Decoder, build_model, count_parameters, generate
from tessera.train.checkpoint import Checkpointer, CheckpointError, latest_checkpoint, read_meta
from tessera.train.flops import flops_per_token, peak_flops
from tessera.train.metrics import MetricsLogger, plot_loss_curve
from tessera.train.optim import build_optimizer, build_scheduler
from tessera.train.preemption import PreemptionGuard

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_device(name: str) -> torch.device:
    """``train.device`` as a torch device ("auto" prefers CUDA)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"train.device={name!r} but no CUDA device is visible; use train.device=cpu")
    return torch.device(name)


def lm_loss(logits: torch.Tensor, labels: torch.Tensor, label_smoothing: float = 0.0, loss_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mean next-token cross-entropy in float32, over the positions where ``loss_mask`` (B, T) is true."""
    if loss_mask is None:
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), label_smoothing=label_smoothing)
    losses = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), label_smoothing=label_smoothing, reduction="none")
    mask = loss_mask.flatten().float()
    return (losses * mask).sum() / mask.sum().clamp(min=1.0)


def resolve_resume(config: JobConfig) -> Path | None:
    """The checkpoint ``train.resume`` points at: newest in the run ("auto"), none, or a path."""
    resume = config.train.resume
    if resume == "none":
        return None
    if resume == "auto":
        return latest_checkpoint(config.train.run_dir)
    path = Path(resume)
    read_meta(path)  # raises a clear CheckpointError when it is not a checkpoint
    return path


@dataclass
class TrainResult:
    """What a finished run reports back (the same numbers are in metrics.jsonl)."""

    run_dir: Path
    steps: int
    losses: list[float] = field(default_factory=list)
    val_losses: dict[int, float] = field(default_factory=dict)
    seconds: float = 0.0
    sample: str = ""
    preempted: str = ""  # the signal that stopped the run early (after a checkpoint), else ""


class Trainer:
    """Owns the model, optimizer, data and sinks of one run; ``fit()`` trains it."""

    def __init__(self, config: JobConfig) -> None:
        self.config = config
        self.run_dir = Path(config.train.run_dir)
        self.device = resolve_device(config.train.device)
        self.dtype = DTYPES[config.train.dtype]
        if self.dtype == torch.float16 and self.device.type == "cpu":
            raise ConfigError("train.dtype='fp16' needs a GPU; use train.dtype=bf16 or fp32 on CPU")
        self.resume_from = resolve_resume(config)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(config.train.seed)
        self.data: DataBundle = build_data(config)
        self.model: Decoder = build_model(config.model).to(self.device)
        self.optimizer = build_optimizer(self.model, config.optim)
        self.scheduler = build_scheduler(self.optimizer, config.optim, config.train.steps)
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.dtype == torch.float16)
        self.checkpointer = Checkpointer(self.run_dir, config.checkpoint.keep_last)
        self.step = 0
        self.tokens_per_step = config.train.batch_size * config.train.grad_accum * config.train.seq_len
        matmul_params = count_parameters(self.model, exclude_embeddings=True)
        self.flops_per_token = flops_per_token(matmul_params, config.model, config.train.seq_len)
        self.peak = peak_flops(self.device, config.log.peak_flops)
        self._write_run_files()

    def _write_run_files(self) -> None:
        (self.run_dir / "config.toml").write_text(self.config.to_toml())
        shutil.copyfile(self.data.tokenizer.path, self.run_dir / "tokenizer.model")

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def restore(self, path: Path) -> None:
        """Continue from a checkpoint: weights, optimizer, scheduler, data position, RNG, step."""
        if read_meta(path).get("model") != self.config.to_dict()["model"]:
            raise CheckpointError(f"checkpoint '{path}' was trained with a different [model] section; resume with the same model config or set train.resume=none")
        meta = self.checkpointer.load(path, self.model, self.optimizer)
        self.scheduler.load_state_dict(meta["scheduler"])
        self.data.train.load_state_dict(meta["loader"])
        self.step = int(meta["step"])

    def save(self) -> Path:
        """Checkpoint the current step."""
        extra = {
            "scheduler": self.scheduler.state_dict(),
            "loader": self.data.train.state_dict(),
            "model": self.config.to_dict()["model"],
            "config": self.config.to_dict(),
        }
        return self.checkpointer.save(self.step, self.model, self.optimizer, extra)

    def train_step(self) -> dict[str, float]:
        """One optimizer step over ``grad_accum`` micro-batches; returns its metrics."""
        cfg = self.config
        total_loss = 0.0
        for _ in range(cfg.train.grad_accum):
            batch = self.data.train.next_batch().to(self.device)
            inputs, labels = causal_lm(batch.tokens)
            with self._autocast():
                logits = self.model(inputs, **batch.model_kwargs())
            loss = lm_loss(logits, labels, cfg.train.label_smoothing, batch.loss_mask) / cfg.train.grad_accum
            self.scaler.scale(loss).backward()
            total_loss += loss.item()
        self.scaler.unscale_(self.optimizer)
        max_norm = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        lr = self.scheduler.get_last_lr()[0]
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"loss": total_loss, "lr": lr, "grad_norm": grad_norm.item()}

    @torch.no_grad()
    def evaluate(self, dataset: Split | None = None) -> float:
        """Mean validation loss over the first ``train.eval_batches`` batches (fixed order)."""
        dataset = dataset if dataset is not None else self.data.val
        bs = self.config.train.batch_size
        n = min(len(dataset), self.config.train.eval_batches * bs)
        self.model.eval()
        total, count = 0.0, 0
        for start in range(0, n, bs):
            batch = self.data.collate([dataset[i] for i in range(start, min(n, start + bs))]).to(self.device)
            inputs, labels = causal_lm(batch.tokens)
            with self._autocast():
                logits = self.model(inputs, **batch.model_kwargs())
            weight = labels.numel() if batch.loss_mask is None else int(batch.loss_mask.sum())
            total += lm_loss(logits, labels, loss_mask=batch.loss_mask).item() * weight
            count += weight
        self.model.train()
        return total / count

    def sample(self, prompt: str, tokens: int) -> str:
        """A continuation of ``prompt`` (temperature 0.8, top-k 50) from a seeded private generator."""
        tok = self.data.tokenizer
        ids = torch.tensor([[tok.bos_id] + tok.encode(prompt)], device=self.device)
        gen = torch.Generator(device=self.device).manual_seed(self.config.train.seed)
        with self._autocast():
            out = generate(self.model, ids, tokens, temperature=0.8, top_k=50, eos_id=tok.eos_id, generator=gen)
        return prompt + tok.decode(out[0].tolist())

    def _should_eval(self) -> bool:
        every = self.config.train.eval_every
        return self.data.val is not None and len(self.data.val) > 0 and (self.step == self.config.train.steps or (every > 0 and self.step % every == 0))

    def _should_save(self) -> bool:
        c = self.config.checkpoint
        return c.enabled and (self.step % c.every == 0 or self.step == self.config.train.steps)

    def fit(self) -> TrainResult:
        """Train to ``train.steps`` (resuming first when asked), then plot and sample."""
        cfg = self.config
        if self.resume_from is not None:
            self.restore(self.resume_from)
        _truncate_metrics(self.run_dir, self.step)
        logger = MetricsLogger(self.run_dir, cfg.train.steps, cfg.log.progress, cfg.log.tensorboard)
        result = TrainResult(self.run_dir, cfg.train.steps)
        logger.print(self._banner())
        started = time.perf_counter()
        preemption = PreemptionGuard(self.run_dir).install()
        try:
            if self.step == 0 and self.data.val is not None and len(self.data.val) > 0:
                result.val_losses[0] = self._log_eval(logger, {"step": 0})
            self.model.train()
            while self.step < cfg.train.steps:
                t0 = time.perf_counter()
                metrics = self.train_step()
                self.step += 1
                elapsed = time.perf_counter() - t0
                tokens_per_s = self.tokens_per_step / elapsed
                record = {"step": self.step, **metrics, "tokens_per_s": tokens_per_s, "mfu": tokens_per_s * self.flops_per_token / self.peak if self.peak else 0.0}
                result.losses.append(metrics["loss"])
                if not math.isfinite(metrics["loss"]):
                    raise FloatingPointError(f"loss became {metrics['loss']} at step {self.step}; lower optim.lr or enable optim.grad_clip")
                if self._should_eval():
                    result.val_losses[self.step] = self._log_eval(logger, record)
                elif self.step % cfg.log.every == 0 or self.step == cfg.train.steps:
                    logger.log(record)
                saved = self._should_save()
                if saved:
                    self.save()
                if self.step < cfg.train.steps and preemption.stop_requested(self.device):
                    checkpoint = latest_checkpoint(self.run_dir) if saved else self.save()
                    logger.print(preemption.record(self.step, checkpoint))
                    result.preempted = preemption.reason
                    break
        finally:
            preemption.uninstall()
            logger.close()
        result.seconds = time.perf_counter() - started
        if result.preempted:
            return result
        self._finish(result, logger)
        return result

    def _log_eval(self, logger: MetricsLogger, record: dict[str, Any]) -> float:
        val = self.evaluate()
        logger.log({**record, "val_loss": val, "val_ppl": math.exp(min(val, 50.0))})
        return val

    def _banner(self) -> str:
        n = count_parameters(self.model)
        where = f"resuming from {self.resume_from}" if self.resume_from else "starting fresh"
        return (
            f"tessera: {n / 1e6:.2f}M parameters, {self.data.tokenizer.vocab_size} tokens in vocab, "
            f"{len(self.data.train.dataset)} train / {len(self.data.val) if self.data.val is not None else 0} val sequences of {self.config.train.seq_len}, "
            f"{self.device.type} {self.config.train.dtype}, {where}; run dir {self.run_dir}"
        )

    def _finish(self, result: TrainResult, logger: MetricsLogger) -> None:
        cfg = self.config
        if cfg.log.plot:
            plot_loss_curve(self.run_dir)
        if cfg.train.sample_tokens > 0:
            result.sample = self.sample(cfg.train.sample_prompt, cfg.train.sample_tokens)
            logger.print("sample:\n" + result.sample)
        summary = {"steps": self.step, "seconds": result.seconds, "val_losses": result.val_losses, "final_loss": result.losses[-1] if result.losses else None}
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        vals = list(result.val_losses.values())
        trend = f"val loss {vals[0]:.4f} -> {vals[-1]:.4f}" if len(vals) > 1 else ""
        logger.print(f"done: step {self.step} in {result.seconds:.1f}s {trend}; outputs in {self.run_dir}")


def _truncate_metrics(run_dir: Path, step: int) -> None:
    """Drop metrics.jsonl records past ``step`` (left by a run that died after its last checkpoint)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return
    keep = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= step]
    if step == 0:
        keep = []
    path.write_text("".join(line + "\n" for line in keep))


def train(config: JobConfig) -> TrainResult:
    """Train the job described by ``config`` (single process)."""
    return Trainer(config).fit()
