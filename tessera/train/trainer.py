"""The trainer: build everything from a JobConfig, then step, evaluate, log, checkpoint, stop."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from tessera.config import JobConfig, eval_task_names
from tessera.data.objectives import Objective
from tessera.data.inspect import realized_mix
from tessera.data.pipeline import DataBundle, Split, build_data, cache_dir
from tessera.data.sources import DataError
from tessera.evaluate.loop import DownstreamEval
from tessera.parallel.fp8 import check_fp8_device
from tessera.parallel.qat import set_qat_step
from tessera.plan.stages import describe_stages
from tessera.model import build_model, count_parameters, generate
from tessera.parallel.loss import MicroBatch
from tessera.train.async_checkpoint import build_checkpointer
from tessera.train.checkpoint import CheckpointError, latest_checkpoint, read_meta
from tessera.train.distill import Distillation, build_teacher, check_teacher_tokenizer, open_teacher
from tessera.train.flops import flops_per_token, peak_flops
from tessera.threads import apply_threads, busy_hint
from tessera.train.hf_every import HFExports
from tessera.train.init_from import check_init_from, check_source, is_weights_only, open_source
from tessera.train.guard import HangWatchdog, NonFiniteGuard
from tessera.train.metrics import MetricsLogger, StepWindow, plot_loss_curve, read_metrics
from tessera.train.moe_stats import ExpertLoadTracker
from tessera.train.mtp_loss import MTPLoss, with_mtp_ahead
from tessera.train.optim import (
    check_optimizer_unchanged,
    keep_config_hyperparameters,
    warmup_notice,
)
from tessera.train.preemption import PreemptionGuard
from tessera.train.qk_clip import QKClip
from tessera.train.save_schedule import SaveSchedule
from tessera.train.elastic import resize as elastic_resize
from tessera.train.faults import Faults
from tessera.train.goodput import Goodput
from tessera.train.spike import SpikeGuard
from tessera.train.straggler import StragglerDetector, describe as describe_straggler
from tessera.train.rundir import check_resumable, completed_step, config_changes, describe_changes, open_run
from tessera.train.rundir import resolved_config_text, truncate_metrics, write_summary, write_text_atomic
from tessera.parallel.activation import compile_enabled, use_inductor_cache
from tessera.dtypes import DTYPES
from tessera.parallel.env import dist_env, resolve_device
from tessera.parallel.init import shard_seeds
from tessera.parallel.scaler import build_grad_scaler
from tessera.train.distributed import setup_parallel, teardown_parallel
from tessera.train.steps import ModelLoss, StepParts, TorchSteps
from tessera.train.ft_steps import runner_for
from tessera.train.loss import FusedHeadLoss, lm_loss


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
        config, self.elastic_banner = elastic_resize(config, dist_env().world_size)  # train.elastic_world
        self.config = config
        self.goodput = Goodput(config.train.run_dir, False, time.time())  # enabled on rank 0 in _open_logger
        self.run_dir = Path(config.train.run_dir)
        self.init_source = check_init_from(config)  # train.init_from: checked before any process group starts
        self.teacher_source = open_teacher(config)  # train.distill.teacher: likewise
        self.device = resolve_device(config.train.device)
        check_fp8_device(config.train.fp8, self.device)
        self.dtype = DTYPES[config.train.dtype]
        self.parallel = setup_parallel(config, self.device)
        self.device = self.parallel.device
        self.threads = apply_threads(config.train.threads, self.parallel.env.local_world_size)
        self.run_lock = open_run(config, self.parallel.is_main)  # lock (rank 0), refuse mixing two runs
        try:
            self._build(config)
        except BaseException:
            self.close()
            raise

    def _build(self, config: JobConfig) -> None:
        self.parallel.barrier()  # rank 0 has locked (and with train.overwrite, emptied) the run directory
        self.resume_from = resolve_resume(config)
        self._weights_only_resume()
        self.data: DataBundle = self._build_data()
        self.model = self._build_model()
        self.moe_tracker = ExpertLoadTracker.for_model(config.model, self.model, self.device, self.parallel.dims.tp)
        self.objective = Objective(config.model, config.train.seed)  # causal LM, masked LM or span corruption
        self.mtp_loss, self.distill = self._build_extra_losses()  # train.mtp_loss_weight, train.distill.teacher
        self.runner = self._build_runner()  # the one choice of engine: torch, pipeline or DeepSpeed (train/steps.py)
        c = config.checkpoint
        self.checkpointer = build_checkpointer(self.run_dir, c.keep_last, self.parallel.is_main, c.async_save)
        self.hf_exports = HFExports(self.run_dir, c.hf_every, self.parallel.is_main)  # checkpoint.hf_every
        self.save_schedule = SaveSchedule(c.every, c.every_minutes, config.train.steps, c.enabled, self.device)
        self.step = 0
        self.tokens_per_step = config.train.batch_size * config.train.grad_accum * config.train.seq_len
        self.flops_per_token = flops_per_token(config.model, config.train.seq_len)
        self.peak, self.peak_source = peak_flops(
            self.device, config.log.peak_flops, cache_dir(config.data.cache_dir), self.parallel.env.local_world_size
        )
        self.faults = Faults.from_env()  # the resilience tests' injected faults; none unless $TESSERA_FAULTS
        env = self.parallel.env
        self.stragglers = StragglerDetector(
            self.run_dir, config.log.straggler_ratio, config.log.every, env.rank, env.world_size, self.device
        )
        self.stragglers.attach(self.model, self.optimizer)  # per-rank phase times (train/straggler.py)
        self.faults.attach(self.model, env.rank)
        self.downstream = self._build_downstream()  # [eval] tasks, or None

    def _build_runner(self) -> TorchSteps:
        """The optimizer, schedule, grad scaler and the step runner of the configured engine."""
        cfg = self.config
        runner = runner_for(cfg)  # parallel.fault_tolerance='torchft': torchft's runner (train/ft_steps.py)
        runner.check_config(cfg)
        # DeepSpeed wraps the model and brings its optimizer (self.engine, train/engine.py); torch's are built here
        self.engine, self.model, self.optimizer, self.scheduler = runner.prepare(cfg, self.model, self.parallel)
        self.qk_clip = QKClip.attach(self.model, self.optimizer, cfg.optim.qk_clip_threshold)  # None when off
        fp16_scaler = self.dtype == torch.float16 and not runner.scales_fp16_itself
        scaler = build_grad_scaler(self.device, fp16_scaler, self.parallel.env.is_distributed)
        # train.fused_loss, except where the engine cannot fuse the head and with distillation (it reads logits)
        fused = cfg.train.fused_loss and runner.fuses_head and self.distill is None
        loss = ModelLoss(self.model, cfg, self.parallel, self._autocast, (self.mtp_loss, self.distill), fused)
        self.nonfinite = NonFiniteGuard(cfg.train.on_nonfinite, cfg.train.max_nonfinite_skips)
        self.spikes = SpikeGuard.for_train(cfg.train)  # train.on_spike (train/spike.py)
        parts = StepParts(
            cfg,
            self.parallel,
            self.model,
            self.optimizer,
            self.scheduler,
            scaler,
            loss,
            self._autocast,
            self.nonfinite,
            self.spikes,
            self.moe_tracker,
            self.qk_clip,
            self._extra_metrics,
        )
        built = runner.create(parts, self.engine, self.pipeline)
        built.bind_loader(self.data.train)
        return built

    @property
    def scaler(self) -> torch.amp.GradScaler:
        """The fp16 grad scaler (disabled otherwise) the step runner uses."""
        return self.runner.parts.scaler

    @scaler.setter
    def scaler(self, scaler: torch.amp.GradScaler) -> None:
        self.runner.parts.scaler = scaler

    def _weights_only_resume(self) -> None:
        """A ``convert hf-import`` checkpoint holds weights only: start from it (or init_from) instead of resuming."""
        if self.resume_from is None or not is_weights_only(read_meta(self.resume_from)):
            return
        cfg = self.config
        cfg.train.init_from = cfg.train.init_from or str(self.resume_from)
        self.init_source = open_source(cfg.train.init_from, cfg.model)
        check_source(self.init_source, cfg.model, cfg.train.upcycle_noise, cfg.train.seed)
        self.resume_from = None

    def close(self) -> None:
        """Release the run directory (the end of :meth:`fit` does it; so does the end of the process)."""
        if self.run_lock is not None:
            self.run_lock.release()
            self.run_lock = None

    def _build_data(self) -> DataBundle:
        # Rank 0 trains the tokenizer and tokenizes the corpus into the cache; the rest reuse it.
        if not self.parallel.is_main:
            self.parallel.barrier()
        data = build_data(self.config, self.parallel.dp_rank, self.parallel.dp_size)
        if self.parallel.is_main:
            self.parallel.barrier()
        return data

    def _build_extra_losses(self) -> tuple[MTPLoss | None, Distillation | None]:
        """The multi-token-prediction term (a pipeline's last stage adds it itself) and distillation."""
        cfg = self.config
        mtp = None
        if cfg.model.mtp_depth and cfg.parallel.pp == 1:  # a pipeline adds the MTP term on its last stage itself
            mtp = MTPLoss(cfg.model.mtp_depth, cfg.train.mtp_loss_weight, lm_loss, cfg.train.label_smoothing)
        distill = None
        if self.teacher_source is not None:
            check_teacher_tokenizer(self.teacher_source, Path(self.data.tokenizer.path))
            # Under pipeline parallelism only the last stage's ranks hold the (whole) teacher.
            here = self.pipeline is None or self.pipeline.has_last
            teacher = build_teacher(self.teacher_source, cfg, self.parallel) if here else None
            d = cfg.train.distill
            microbatches = self.pipeline.microbatches if self.pipeline is not None else 0
            distill = Distillation(teacher, d.temperature, d.alpha, self._autocast, microbatches)
            if self.pipeline is not None and here:
                self.pipeline.extra_loss = distill.add_rows
        return mtp, distill

    def _extra_metrics(self) -> dict[str, float]:
        """This step's MTP losses per depth and distillation KL, averaged over the data-parallel ranks."""
        found: dict[str, float] = {}
        for source in (self.mtp_loss, self.distill, self.runner):
            found.update(source.metrics() if source is not None else {})
        if not found:
            return {}
        if self.distill is not None and self.config.parallel.pp > 1:  # measured on the last stage only
            found["distill_kl"] = self.parallel.sum_over_pp([found["distill_kl"]])[0]
        ranks = self.parallel.dp_size * self.parallel.dims.cp  # cp ranks' figures carry their token share
        return dict(zip(found, (v / ranks for v in self.parallel.sum_over_dp(list(found.values())))))

    def _build_model(self) -> torch.nn.Module:
        """Build (every rank the same weights from the seed, or on meta), parallelize, place."""
        cfg = self.config
        torch.manual_seed(cfg.train.seed)
        with torch.device("meta") if cfg.parallel.meta_init else contextlib.nullcontext():
            model = build_model(cfg.model)
        self.n_params = count_parameters(model)
        self.n_embedding_params = self.n_params - count_parameters(model, exclude_embeddings=True)
        self.compiled = compile_enabled(cfg.parallel, self.device.type)
        self.first_step_s = 0.0  # with compiled blocks: the first step's seconds, until its compile time is printed
        if self.compiled:  # compiled kernels persist in the user's cache, reused by restarts and later runs
            self.inductor_cache = use_inductor_cache()
        self.pipeline = None
        if cfg.parallel.pp > 1:  # this rank's stages; self.model holds their modules under full-model names
            self.pipeline = self.parallel.pipeline(model, cfg, lm_loss, self._pipeline_head_loss())
            model, roots = self.pipeline.model, self.pipeline.stage_models
        else:
            model = self.parallel.parallelize(model, cfg)
            roots = [model]
        if cfg.parallel.meta_init:
            for root in roots:  # on the FSDP roots, which then re-point their shards
                root.to_empty(device=self.device)
            with torch.no_grad():
                model.init_weights(shard_seeds(cfg.train.seed))
        model = model.to(self.device)
        if self.init_source is not None and self.resume_from is None:
            self.init_source.load_into(model)  # each rank reads the blocks of the tensors it holds
        return model

    def _build_downstream(self) -> DownstreamEval | None:
        """The ``[eval]`` downstream tasks over the live model (None when no task is named)."""
        if not eval_task_names(self.config.eval):
            return None
        dp = (self.parallel.dp_rank, self.parallel.dp_size, self.parallel.sum_over_dp)
        cache = cache_dir(self.config.data.cache_dir)
        return DownstreamEval(self.config, self.model, self.data.tokenizer, self.device, dp, cache, self._autocast)

    def _write_run_files(self) -> None:
        write_text_atomic(self.run_dir / "config.toml", resolved_config_text(self.config))
        self.data.tokenizer.save(self.run_dir)  # tokenizer.model or tokenizer.json (+ its config)

    def _autocast(self) -> contextlib.AbstractContextManager:
        # Under FSDP its mixed-precision policy casts parameters instead of autocast.
        if self.dtype == torch.float32 or self.parallel.fsdp:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def restore(self, path: Path) -> str:
        """Continue from a checkpoint: weights, optimizer, scheduler, data position, RNG, step.

        The config's optimizer hyper-parameters and schedule win over the checkpoint's; returns a line
        naming the resolved keys that changed since the checkpoint ("" when none did).
        """
        imported = "imported_from" in read_meta(path)  # convert deepspeed-import: a schedule but no data position
        keys = ("step", "model", "config", "scheduler", "optim_param_groups") + (() if imported else ("loader",))
        saved = read_meta(path, required=keys)
        if saved["model"] != self.config.to_dict()["model"]:
            raise CheckpointError(
                f"checkpoint '{path}' was trained with a different [model] section; resume with the same model config "
                "or start a new train.run_dir"
            )
        changes = config_changes(saved["config"], self.config)
        if not imported:
            check_resumable(changes, path)
            check_optimizer_unchanged(changes, path)
        fresh_groups = [dict(group) for group in self.optimizer.param_groups]
        meta = self.runner.load(self.checkpointer, path)
        self.scheduler.load_state_dict(meta["scheduler"])
        keep_config_hyperparameters(self.optimizer, self.scheduler, fresh_groups)
        try:
            if not imported:
                self.data.train.load_state_dict(meta["loader"])
        except DataError as err:
            changed = ", ".join(f"{k} {old!r} -> {new!r}" for k, (old, new) in changes.items() if k.startswith("data."))
            raise DataError(f"{err}{f' (changed: {changed})' if changed else ''}") from None
        self.step = int(meta["step"])
        return describe_changes(changes, path)

    def save(self) -> Path:
        """Checkpoint the current step (the loop's stall counts against goodput)."""
        with self.goodput.timed("checkpoint"):
            return self._save()

    def _save(self) -> Path:
        extra = {
            "scheduler": self.scheduler.state_dict(),
            "loader": self.data.train.state_dict(),
            "model": self.config.to_dict()["model"],
            "config": self.config.to_dict(),
        }
        self.hf_exports.wait()  # the save's pruning must not delete a checkpoint an HF export still reads
        return self.runner.save(self.checkpointer, self.step, extra)

    def train_step(self) -> dict[str, Any]:
        """One optimizer step over ``grad_accum`` micro-batches through the step runner; returns its metrics."""
        if self.config.train.qat != "none":  # from the step alone: a resumed run switches at the same step
            set_qat_step(self.model, self.step, self.config.train.qat_start)
        return self.runner.step(self.step + 1, self._micro_batch)

    def _micro_batch(self) -> MicroBatch:
        """The next micro-batch through the objective (on the host: no device syncs), then on the device."""
        loader = self.data.train  # a fault belongs to the data: the step an uninterrupted run reads it at
        at_step = loader.consumed // (loader.global_batch * self.config.train.grad_accum) + 1
        batch = self.faults.corrupt(at_step, loader.next_batch(), self.config.model.vocab_size)
        parts = self.objective(batch)
        if self.mtp_loss is not None and self.parallel.cp_mesh is not None:  # before the split: see with_mtp_ahead
            parts = with_mtp_ahead(parts, self.config.model.mtp_depth)
        parts = self.parallel.split_batch(*parts)  # cp: this rank's slice
        return MicroBatch.of(parts).to(self.device)

    def _pipeline_head_loss(self) -> Callable[..., FusedHeadLoss] | None:
        """The pipeline's last stage fuses the head into the loss too (``train.fused_loss``)."""
        chunk = self.config.train.loss_chunk_tokens
        if not self.config.train.fused_loss or self.config.train.distill.teacher:  # distillation reads the logits
            return None
        return lambda labels, mask, smoothing, twice: FusedHeadLoss(labels, mask, smoothing, chunk, twice)

    @torch.no_grad()
    def evaluate(self, dataset: Split | None = None) -> float:
        """Mean validation loss over the first ``train.eval_batches`` global batches (fixed order).

        Each global batch is split over the data-parallel ranks like a training batch; a split
        smaller than one batch is evaluated whole on every rank.
        """
        dataset = dataset if dataset is not None else self.data.val
        bs, dp = self.config.train.batch_size, self.parallel.dp_size
        n = min(len(dataset), self.config.train.eval_batches * bs) // bs * bs
        local = bs // dp
        starts = [s + self.parallel.dp_rank * local for s in range(0, n, bs)] if n else [0]
        size = local if n else len(dataset)
        self.model.eval()
        total, count = 0.0, 0.0
        for start in starts:
            batch = self.data.collate([dataset[i] for i in range(start, start + size)])
            parts = self.parallel.split_batch(*self.objective(batch))  # cp: this rank's slice (on the host)
            weight = parts[2].numel() if parts[3] is None else int(parts[3].sum())  # on the host
            total += self.runner.eval_loss(MicroBatch.of(parts).to(self.device), weight)
            count += weight
        self.model.train()
        if n or self.parallel.cp_mesh is not None:  # cp ranks hold parts of the same batches: always summed
            total, count = self.parallel.sum_over_dp([total, count])
        return total / count

    def sample(self, prompt: str, tokens: int) -> str:
        """A continuation of ``prompt`` (temperature 0.8, top-k 50) from a seeded private generator."""
        tok = self.data.tokenizer
        ids = torch.tensor([tok.prompt_ids(prompt)], device=self.device)
        gen = torch.Generator(device=self.device).manual_seed(self.config.train.seed)
        with self._autocast():
            out = generate(self.model, ids, tokens, temperature=0.8, top_k=50, eos_id=tok.eos_id, generator=gen)
        return prompt + tok.decode(out[0].tolist())

    def _should_eval(self) -> bool:
        every = self.config.train.eval_every
        return (
            self.data.val is not None
            and len(self.data.val) > 0
            and (self.step == self.config.train.steps or (every > 0 and self.step % every == 0))
        )

    def _should_save(self) -> bool:
        return self.save_schedule.due(self.step)  # steps, last step, every_minutes (decided by all ranks)

    def fit(self) -> TrainResult:
        """Train to ``train.steps`` (resuming first when asked), then plot and sample."""
        try:
            done = completed_step(self.resume_from, self.config.train.steps)
            if done is not None:
                return self._already_complete(done)
            changes = self.restore(self.resume_from) if self.resume_from is not None else ""
            logger = self._open_logger()
            logger.print(self._banner())
            self._announce(self.elastic_banner)  # train.elastic_world: one line whatever log.progress says
            if changes:
                logger.print(changes)
            result = TrainResult(self.run_dir, self.config.train.steps)
            started = time.perf_counter()
            echo_s = 1.0 if self.parallel.env.is_distributed else 0.0  # torchrun re-sends the terminal's Ctrl-C
            preemption = PreemptionGuard(self.run_dir, echo_s=echo_s).install()
            watchdog = HangWatchdog(self.run_dir, self.parallel.env.rank, self.config.train.hang_timeout_s)
            try:
                with watchdog:
                    self._loop(logger, result, preemption, watchdog)
            finally:
                try:
                    self.checkpointer.wait()  # checkpoint.async: the last save is complete before the run ends
                    self.hf_exports.wait()  # checkpoint.hf_every: so is the last HF export
                finally:  # a failed background write raises: the signal handlers still go back
                    preemption.uninstall()
                    logger.close()
            result.seconds = time.perf_counter() - started
            if not result.preempted:
                self._finish(result, logger)
            return result
        finally:
            self.close()

    def _open_logger(self) -> MetricsLogger:
        cfg = self.config
        if self.parallel.is_main:
            self._write_run_files()
            self.goodput.enabled = True
            self.goodput.begin(self.step, read_metrics(self.run_dir))  # the earlier session's records, untruncated
            truncate_metrics(self.run_dir, self.step)
        return MetricsLogger.for_job(cfg, enabled=self.parallel.is_main)

    def _already_complete(self, step: int) -> TrainResult:
        """Nothing left to train: say so, and leave the run's files as they are."""
        self._announce(
            f"tessera: {self.run_dir} is already complete at step {step} (train.steps={self.config.train.steps}), "
            "so this launch trains 0 steps and leaves summary.json as it is; raise train.steps to continue it"
        )
        self.step = step
        return TrainResult(self.run_dir, step)

    def _announce(self, message: str) -> None:
        """A line the user must see whatever ``log.progress`` says (rank 0)."""
        if self.parallel.is_main and message:
            print(message, flush=True)

    def _loop(
        self, logger: MetricsLogger, result: TrainResult, preemption: PreemptionGuard, watchdog: HangWatchdog
    ) -> None:
        """Steps until ``train.steps`` or a stop signal; every step, evaluation and save reports progress."""
        cfg = self.config
        window = StepWindow(self.flops_per_token, self.peak * self.parallel.env.world_size)
        if self.step == 0 and self.data.val is not None and len(self.data.val) > 0:
            result.val_losses[0] = self._log_eval(logger, {"step": 0}, tasks=self.config.eval.every > 0)
        self.model.train()
        while self.step < cfg.train.steps:
            t0 = time.perf_counter()
            self.faults.maybe_hang(self.parallel.env.rank, self.step + 1)
            self.stragglers.start_step()
            metrics = self.train_step()
            if self._handle_spike(logger, result, window):
                continue  # rolled back to a checkpoint: self.step is its step
            self.step = metrics.pop("trained_step", self.step + 1)  # torchft: a joining group steps to its peers'
            watchdog.kick(self.step)
            self._check_stragglers(logger)
            window.add(metrics, self.tokens_per_step, time.perf_counter() - t0)
            self.goodput.step(self.step, time.perf_counter() - t0)
            self._note_compile(logger, time.perf_counter() - t0)
            result.losses.append(metrics["loss"])
            tasks = self.downstream is not None and self.downstream.due(self.step)
            if self._should_eval():  # logged records hold the logging window's means (StepWindow)
                result.val_losses[self.step] = self._log_eval(logger, self._record(window), tasks)
                watchdog.kick(self.step)
            elif tasks:
                logger.log({**self._record(window), **self.downstream.run()})
                watchdog.kick(self.step)
            elif self.step % cfg.log.every == 0 or self.step == cfg.train.steps:
                logger.log(self._record(window))
            if line := self.data.log_blend_phase(self.step, self.run_dir if self.parallel.is_main else None):
                logger.print(line)  # data.blend_schedule: the realized mix of the phase that just ended
            saved = self._should_save()
            if saved or self.hf_exports.due(self.step):
                self._save_and_export()
                saved = True
                watchdog.kick(self.step)
            if self.step < cfg.train.steps and preemption.stop_requested(self.device):
                if not saved:
                    self.save()
                self.checkpointer.wait()  # checkpoint.async: exit only once the save in flight is complete
                checkpoint = latest_checkpoint(self.run_dir)
                self._announce(preemption.record(self.step, checkpoint))
                result.preempted = preemption.reason
                return

    def _check_stragglers(self, logger: MetricsLogger) -> None:
        """At the end of a logging window: compare the ranks' phase times (a collective), log a new straggler;
        refresh the goodput file."""
        every, steps = self.config.log.every, self.config.train.steps
        record = self.stragglers.end_step(self.step, self.step % every == 0 or self.step == steps)
        if record is not None:
            logger.log(record)
            logger.print(describe_straggler(record["straggler"]))
        if self.step % every == 0:
            self.goodput.write()  # RUN/goodput.json for tessera status

    def _handle_spike(self, logger: MetricsLogger, result: TrainResult, window: StepWindow) -> bool:
        """Log this step's spike (``train.on_spike``); on rollback restore the newest checkpoint, keep the data
        position after the spiking batch (skipping the batches since the checkpoint) and return True."""
        for spike in self.spikes.take_new():
            logger.log({"step": spike.step, "spike": asdict(spike)})
            logger.print(f"spike: {spike.describe()} (train.on_spike=warn: trained on)")
        if self.spikes.pending is None:
            return False
        spike = self.spikes.pending
        self.checkpointer.wait()
        target = latest_checkpoint(self.run_dir)
        if target is None:
            logger.log(self.spikes.no_checkpoint())
            logger.print(f"spike: no checkpoint before step {spike.step} to roll back to; its update was dropped")
            return False
        position = self.data.train.state_dict()
        with self.goodput.timed("rollback"):
            self.restore(target)
        self.goodput.discard(self.step)
        skipped = (self.data.train.state_dict()["consumed"], position["consumed"])
        self.data.train.load_state_dict(position)
        logger.log(self.spikes.rolled_back(self.step, skipped))
        window.flush()  # the steps since the checkpoint are trained again
        del result.losses[max(0, len(result.losses) - (spike.step - 1 - self.step)) :]
        logger.print(
            f"spike: rolled back to {target} (step {self.step}); skipped samples {skipped[0]}..{skipped[1]} "
            f"of the data stream ({spike.step - self.step} batches, the spiking one included)"
        )
        return True

    def _save_and_export(self) -> None:
        """This step's checkpoint and, when ``checkpoint.hf_every`` is due, its HF export started in the background."""
        path = self.save()
        if not self.hf_exports.due(self.step):
            return
        self.checkpointer.wait()  # checkpoint.async: the export reads the complete checkpoint
        self.hf_exports.start(path if path is not None else latest_checkpoint(self.run_dir), self.step)

    def _note_compile(self, logger: MetricsLogger, seconds: float) -> None:
        """With compiled blocks, print once the first step's extra seconds over the second: its compile time."""
        if not self.compiled or self.first_step_s < 0:
            return
        if self.first_step_s == 0:
            self.first_step_s = seconds
            return
        logger.print(
            f"compile: {self.first_step_s - seconds:.1f} s (first step {self.first_step_s:.1f} s, the next "
            f"{seconds:.1f} s), cached in {self.inductor_cache}"
        )
        self.first_step_s = -1.0

    def _record(self, window: StepWindow) -> dict[str, Any]:
        """The metrics.jsonl record of the logging window that ends at this step."""
        record = {"step": self.step, **window.flush()}
        if self.nonfinite.skipped:
            record["skipped_steps"] = self.nonfinite.skipped
        return record

    def _log_eval(self, logger: MetricsLogger, record: dict[str, Any], tasks: bool = False) -> float:
        with self.goodput.timed("eval"):
            val = self.evaluate()
            scores = self.downstream.run() if tasks and self.downstream is not None else {}
        logger.log({**record, "val_loss": val, "val_ppl": math.exp(min(val, 50.0)), **scores})
        return val

    def _banner(self) -> str:
        n = self.n_params
        layout = (
            f"{self.parallel.env.world_size} processes, dp={self.parallel.dp_size} tp={self.parallel.dims.tp}"
            if self.parallel.env.is_distributed
            else "1 process"
        )
        where = f"resuming from {self.resume_from}" if self.resume_from else "starting fresh"
        peak = f"peak {self.peak / 1e9:,.1f} GFLOP/s per process" if self.peak else "MFU off"
        lines = [
            f"tessera: {n / 1e6:.2f}M parameters, {self.data.tokenizer.vocab_size} tokens in vocab, "
            f"{len(self.data.train.dataset)} train / {len(self.data.val) if self.data.val is not None else 0} val "
            f"sequences of {self.config.train.seq_len}, "
            f"{self.device.type} {self.config.train.dtype}, {layout}, {where}; run dir {self.run_dir}",
            f"tessera: {self.threads.describe()}, {peak} ({self.peak_source})",
        ]
        extra = [busy_hint(self.threads.threads) if self.device.type == "cpu" else "", realized_mix(self.data.train)]
        extra += [warmup_notice(self.config.optim, self.config.train.steps), self.data.notice]
        extra.append(describe_stages(self.config) if self.config.parallel.pp > 1 else "")
        extra.append(self._init_line())
        return "\n".join(lines + [f"tessera: {line}" for line in extra if line])

    def _init_line(self) -> str:
        """Where the weights came from (train.init_from), or why init_from is not used."""
        init_from = self.config.train.init_from
        if init_from and self.resume_from is not None:
            return f"train.init_from={init_from} ignored: the run resumes from its own checkpoint {self.resume_from}"
        if self.init_source is None:
            return ""
        return f"weights from {self.init_source.describe()}; optimizer, schedule, data position and step start fresh"

    def _finish(self, result: TrainResult, logger: MetricsLogger) -> None:
        cfg = self.config
        if cfg.log.plot and self.parallel.is_main:
            plot_loss_curve(self.run_dir)
        split = self.parallel.tp_enabled or cfg.parallel.pp > 1 or self.parallel.cp_mesh is not None
        if cfg.train.sample_tokens > 0 and split:
            logger.print(
                f"sample skipped under tensor/pipeline/context parallelism; run: tessera generate {self.run_dir}"
            )
        elif (
            cfg.train.sample_tokens > 0 and cfg.model.arch == "decoder"
        ):  # every rank decodes: FSDP's gathers are collective
            result.sample = self.sample(cfg.train.sample_prompt, cfg.train.sample_tokens)
            logger.print("sample:\n" + result.sample)
        if self.moe_tracker is not None:
            logger.print(self.moe_tracker.finish(self.run_dir, write=self.parallel.is_main))
        param_sumsq = self.runner.parameter_sums_of_squares()  # collective: every rank
        if not self.parallel.is_main:
            return
        final_loss = result.losses[-1] if result.losses else None
        # param_sumsq: per tensor, layout-independent: the parity tests' final check
        self.goodput.write()
        extra = {"spikes": self.spikes.events, "goodput": self.goodput.totals(), **self.runner.summary()}
        write_summary(
            self.run_dir,
            self.step,
            result.seconds,
            final_loss,
            self.resume_from is not None,
            param_sumsq,
            init_from=cfg.train.init_from,
            extra=extra,
        )
        vals = list(result.val_losses.values())
        trend = f"val loss {vals[0]:.4f} -> {vals[-1]:.4f}" if len(vals) > 1 else ""
        logger.print(f"done: step {self.step} in {result.seconds:.1f}s {trend}; outputs in {self.run_dir}")


def train(config: JobConfig) -> TrainResult:
    """Train the job described by ``config``: one process, or one rank of a torchrun job."""
    return Trainer(config).fit()


def train_and_exit(config: JobConfig) -> TrainResult:
    """:func:`train`, then leave the process group (the CLI's entry)."""
    try:
        return train(config)
    finally:
        teardown_parallel()
