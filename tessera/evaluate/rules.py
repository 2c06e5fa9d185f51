"""The ``[eval]`` rules (run by :func:`tessera.validate.validate`): what the loop's downstream tasks need."""

from __future__ import annotations

from tessera.config import ConfigError, JobConfig, eval_task_names


def check_eval(config: JobConfig) -> None:
    """Counts are sane; tasks are named only for a decoder whose plain forward the trainer can call."""
    e = config.eval
    for key in ("every", "limit"):
        if getattr(e, key) < 0:
            raise ConfigError(f"eval.{key} must be >= 0, got {getattr(e, key)}")
    if e.stdlib_docs <= 0:
        raise ConfigError(f"eval.stdlib_docs must be positive, got {e.stdlib_docs}")
    if not eval_task_names(e):
        return
    if config.model.arch != "decoder":
        raise ConfigError(
            f"eval.tasks scores a causal decoder; model.arch={config.model.arch!r} has no next-token head: "
            "unset eval.tasks"
        )
    p = config.parallel
    if p.pp > 1 or p.cp > 1 or p.engine == "deepspeed":
        raise ConfigError(
            "eval.tasks runs the model's plain forward: not with parallel.pp > 1, parallel.cp > 1 or "
            "parallel.engine=deepspeed; unset eval.tasks and score a checkpoint with `tessera lm-eval`"
        )
