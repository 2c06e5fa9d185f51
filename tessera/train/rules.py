"""The rules of the [train], [optim], [checkpoint] and [log] keys."""

from __future__ import annotations

from tessera.config import JobConfig, ModelConfig, OptimConfig, TrainConfig, resolved_objective
from tessera.config.checks import require, require_all
from tessera.model.attention import kernel_spec


def check_train(t: TrainConfig, m: ModelConfig) -> None:
    require_all("train", t, ("steps", "batch_size", "grad_accum", "seq_len", "eval_batches"), positive=True)
    require_all("train", t, ("eval_every", "sample_tokens", "loss_chunk_tokens"), positive=False)
    require(
        t.seq_len <= m.max_seq_len,
        f"train.seq_len={t.seq_len} exceeds model.max_seq_len={m.max_seq_len}; raise model.max_seq_len or shorten "
        "train.seq_len",
    )
    require(
        not m.dsa.topk or m.dsa.topk < t.seq_len,
        f"model.dsa.topk={m.dsa.topk} is not smaller than train.seq_len={t.seq_len}: every query would attend to "
        "every key (dense attention at sparse cost); pick a topk below the sequence length",
    )
    require(0.0 <= t.label_smoothing < 1.0, f"train.label_smoothing must be in [0, 1), got {t.label_smoothing}")
    require(
        t.device in ("auto", "cpu", "cuda") or t.device.startswith("cuda:"),
        f"train.device={t.device!r} must be auto, cpu or cuda",
    )
    require(t.threads >= 0, f"train.threads must be >= 0 (0 = auto), got {t.threads}")
    require(
        0 <= t.upcycle_noise < float("inf"), f"train.upcycle_noise must be a finite number >= 0, got {t.upcycle_noise}"
    )
    require(t.mtp_loss_weight >= 0, f"train.mtp_loss_weight must be >= 0, got {t.mtp_loss_weight}")
    require(t.distill.temperature > 0, f"train.distill.temperature must be positive, got {t.distill.temperature}")
    require(0.0 <= t.distill.alpha <= 1.0, f"train.distill.alpha must be in [0, 1], got {t.distill.alpha}")
    require(
        not t.distill.teacher or resolved_objective(m) == "causal_lm",
        f"train.distill.teacher distills a causal LM; model.objective is {resolved_objective(m)!r}",
    )
    require(bool(t.run_dir), "train.run_dir must not be empty")
    require(0 <= t.seed < 2**32, f"train.seed must be in [0, 2**32) (numpy and megatron seeds), got {t.seed}")
    require(t.max_nonfinite_skips >= 1, f"train.max_nonfinite_skips must be >= 1, got {t.max_nonfinite_skips}")
    require(t.hang_timeout_s >= 0, f"train.hang_timeout_s must be >= 0 (0 = no watchdog), got {t.hang_timeout_s}")
    check_spike(t)


def check_spike(t: TrainConfig) -> None:
    """``train.on_spike``'s window and threshold (docs/fault-tolerance.md), and the elastic world."""
    require(5 <= t.spike_window <= 100_000, f"train.spike_window must be in [5, 100000] steps, got {t.spike_window}")
    require(
        1.0 <= t.spike_threshold <= 100.0,
        f"train.spike_threshold must be in [1, 100] (robust standard deviations; 6 is a good start), got "
        f"{t.spike_threshold}",
    )
    require(t.max_rollbacks >= 1, f"train.max_rollbacks must be >= 1, got {t.max_rollbacks}")
    require(t.elastic_world >= 0, f"train.elastic_world must be >= 0 (0 = not elastic), got {t.elastic_world}")


def check_optim(o: OptimConfig, t: TrainConfig) -> None:
    require(o.lr > 0, f"optim.lr must be positive, got {o.lr}")
    require(0.0 <= o.min_lr_ratio <= 1.0, f"optim.min_lr_ratio must be in [0, 1], got {o.min_lr_ratio}")
    require(o.weight_decay >= 0, f"optim.weight_decay must be >= 0, got {o.weight_decay}")
    require(
        0.0 <= o.beta1 < 1.0 and 0.0 <= o.beta2 < 1.0, f"optim.beta1/beta2 must be in [0, 1), got {o.beta1}, {o.beta2}"
    )
    require(o.warmup_steps >= 0, f"optim.warmup_steps must be >= 0, got {o.warmup_steps}")
    require(0.0 < o.decay_fraction <= 1.0, f"optim.decay_fraction must be in (0, 1], got {o.decay_fraction}")
    require(o.grad_clip >= 0, f"optim.grad_clip must be >= 0 (0 disables), got {o.grad_clip}")
    require(o.eps > 0, f"optim.eps must be positive (AdamW divides by sqrt(v) + eps), got {o.eps}")
    require(o.muon.lr >= 0, f"optim.muon.lr must be >= 0 (0 = optim.lr), got {o.muon.lr}")
    require(0.0 <= o.muon.momentum < 1.0, f"optim.muon.momentum must be in [0, 1), got {o.muon.momentum}")
    require(1 <= o.muon.ns_steps < 100, f"optim.muon.ns_steps must be in [1, 99], got {o.muon.ns_steps}")
    require(o.qk_clip_threshold >= 0, f"optim.qk_clip_threshold must be >= 0 (0 disables), got {o.qk_clip_threshold}")
    require(
        o.implementation == "auto" or o.state_dtype == "fp32",
        f"optim.implementation={o.implementation!r} picks torch's AdamW kernel, which keeps fp32 moments; "
        "optim.state_dtype='bf16' runs tessera's own update: set optim.implementation='auto'",
    )


def check_qk_clip(o: OptimConfig, m: ModelConfig) -> None:
    if o.qk_clip_threshold <= 0:
        return
    require(
        not m.attention.qk_norm,
        "optim.qk_clip_threshold rescales q/k projections, which model.attention.qk_norm would undo; "
        "set one of them off",
    )
    require(not m.mla.kv_rank, "optim.qk_clip_threshold supports standard attention, not [model.mla]; set it to 0")
    require(
        kernel_spec(m.attention.kernel).scores,  # model/rules.py has checked that the kernel is registered
        f"optim.qk_clip_threshold needs softmax attention logits, not model.attention.kernel='{m.attention.kernel}'",
    )


def check_output(config: JobConfig) -> None:
    c, log = config.checkpoint, config.log
    require(c.every > 0, f"checkpoint.every must be positive, got {c.every}")
    require(c.every_minutes >= 0, f"checkpoint.every_minutes must be >= 0 (0 = off), got {c.every_minutes}")
    require(c.keep_last >= 1, f"checkpoint.keep_last must be >= 1, got {c.keep_last}")
    require(c.hf_every >= 0, f"checkpoint.hf_every must be >= 0 (0 = off), got {c.hf_every}")
    require(log.every > 0, f"log.every must be positive, got {log.every}")
    require(
        log.straggler_ratio == 0 or 1.0 < log.straggler_ratio <= 100.0,
        f"log.straggler_ratio must be 0 (off) or in (1, 100], got {log.straggler_ratio}",
    )
    require(
        config.train.on_spike != "rollback" or c.enabled,
        "train.on_spike=rollback restores a checkpoint but checkpoint.enabled=false; enable checkpoints or set "
        "train.on_spike=warn",
    )
    require(log.peak_flops >= 0, f"log.peak_flops must be >= 0, got {log.peak_flops}")
