"""The rules of the engine keys: [parallel.deepspeed] and what DeepSpeed's own optimizer cannot do."""

from __future__ import annotations

from pathlib import Path

from tessera.config import JobConfig, OptimConfig, ParallelConfig, TrainConfig
from tessera.config.checks import require
from tessera.errors import ConfigError, read_json_object
from tessera.model.ffn import ffn_hidden_size


DS_JSON_FIX = "; give the path of a ds.json that holds one JSON object"  # ends each parallel.deepspeed.config error


def check_engine(p: ParallelConfig, t: TrainConfig) -> None:
    """The DeepSpeed keys (the layouts the engine refuses are in the compatibility table)."""
    require(
        p.engine == "torch" or t.on_nonfinite == "stop",
        "train.on_nonfinite=skip cannot hold back a DeepSpeed step (it reduces, clips and updates in one call); "
        "set train.on_nonfinite=stop or parallel.engine='torch'",
    )
    ds = p.deepspeed
    deepspeed_only = {
        "offload_optimizer": ds.offload_optimizer != "none",
        "offload_params": ds.offload_params != "none",
    }
    deepspeed_only.update(nvme_path=bool(ds.nvme_path), config=bool(ds.config))
    for key, used in deepspeed_only.items():
        require(not used or p.engine == "deepspeed", f"parallel.deepspeed.{key} needs parallel.engine='deepspeed'")
    require(ds.zero_stage in (1, 2, 3), f"parallel.deepspeed.zero_stage must be 1, 2 or 3, got {ds.zero_stage}")
    require(
        ds.offload_params == "none" or ds.zero_stage == 3,
        f"parallel.deepspeed.offload_params={ds.offload_params!r} needs parallel.deepspeed.zero_stage=3 "
        "(only ZeRO-3 partitions parameters)",
    )
    require(
        "nvme" not in (p.deepspeed.offload_optimizer, p.deepspeed.offload_params) or bool(p.deepspeed.nvme_path),
        "nvme offload needs parallel.deepspeed.nvme_path = a directory on a fast local disk",
    )
    if p.deepspeed.config:
        path = Path(p.deepspeed.config)
        require(path.is_file(), f"parallel.deepspeed.config='{path}' does not exist; give the path of a ds.json")
        read_json_object(path, ConfigError, f"parallel.deepspeed.config='{path}'", DS_JSON_FIX)


def check_engine_optimizer(p: ParallelConfig, o: OptimConfig) -> None:
    """DeepSpeed runs its own AdamW: tessera's Muon, bf16 state and QK-clip live in the torch engine."""
    if p.engine != "deepspeed":
        return
    used_keys = {"name": o.name != "adamw", "state_dtype": o.state_dtype != "fp32"}
    used_keys["implementation"] = o.implementation != "auto"
    for key, used in used_keys.items():
        require(
            not used, f"optim.{key}={getattr(o, key)!r} needs parallel.engine='torch' (DeepSpeed runs its own AdamW)"
        )
    require(
        o.qk_clip_threshold == 0, "optim.qk_clip_threshold needs parallel.engine='torch'; set it to 0 for DeepSpeed"
    )


def check_fp8(config: JobConfig) -> None:
    """train.fp8: the torch engine only (tessera/parallel/fp8.py converts the linears before FSDP), and matrix
    sides torchao's fp8 GEMMs take: multiples of 16 (32 for MXFP8, its scaling block), also the sequence."""
    t, m = config.train, config.model
    if t.fp8 == "off":
        return
    require(
        config.parallel.engine == "torch",
        f"train.fp8={t.fp8!r} runs in the torch engine (torchao converts the linears before FSDP); "
        "parallel.engine='deepspeed' does not support it: set train.fp8=off or parallel.engine=torch",
    )
    multiple = 32 if t.fp8 == "mxfp8" else 16
    head_dim = m.head_dim or m.dim // m.n_heads
    sides = {"model.dim": m.dim, "model.n_heads*head_dim": m.n_heads * head_dim}
    sides["model.n_kv_heads*head_dim"] = (m.n_kv_heads or m.n_heads) * head_dim
    sides.update({"model.ffn_hidden": m.ffn_hidden} if m.ffn_hidden else {"model.multiple_of": m.multiple_of})
    for name, value in sides.items():
        require(
            value % multiple == 0,
            f"train.fp8={t.fp8!r} needs matrix sides divisible by {multiple}, but {name}={value}; "
            f"change {name.split('*')[0]} or set train.fp8=off",
        )
    rows = t.batch_size * t.seq_len
    require(
        t.fp8 != "mxfp8" or t.seq_len % 32 == 0,
        f"train.fp8='mxfp8' scales blocks of 32 tokens: train.seq_len={t.seq_len} (x batch {t.batch_size} = "
        f"{rows} rows) must be a multiple of 32",
    )


def check_qat(config: JobConfig) -> None:
    """train.qat: the torch engine without TP (the fake-quantizers are swapped in before FSDP and tested so),
    not with fp8, a start within the run, and (int4) a group size dividing every block linear's input."""
    t, m = config.train, config.model
    if t.qat == "none":
        return
    require(
        t.fp8 == "off",
        f"train.qat={t.qat!r} and train.fp8={t.fp8!r} both replace the block linears; set one of them off",
    )
    require(
        config.parallel.engine == "torch",
        f"train.qat={t.qat!r} runs in the torch engine (torchao swaps the linears before FSDP); "
        "parallel.engine='deepspeed' does not support it: set train.qat=none or parallel.engine=torch",
    )
    require(
        config.parallel.tp == 1,
        f"train.qat={t.qat!r} is not supported with tensor parallelism (parallel.tp={config.parallel.tp}); use tp=1",
    )
    require(
        0 <= t.qat_start < t.steps,
        f"train.qat_start={t.qat_start} must be in [0, train.steps={t.steps}): it is the step fake quantization "
        "starts at; lower it",
    )
    if t.qat != "int4-weight":
        return
    head_dim = m.head_dim or m.dim // m.n_heads
    inputs = {"model.dim": m.dim, "model.n_heads*head_dim": m.n_heads * head_dim}
    inputs["the FFN hidden size"] = ffn_hidden_size(m.dim, m.activation, m.ffn_hidden, m.ffn_multiplier, m.multiple_of)
    for name, value in inputs.items():
        require(
            t.qat_group_size > 0 and value % t.qat_group_size == 0,
            f"train.qat_group_size={t.qat_group_size} does not divide the input dimension {name}={value}; "
            "use a divisor of it (e.g. 32)",
        )
