"""The specs of the parallel layouts (the compatibility table's columns) and of the job-level features
that are no model component (precision, activation checkpointing, compile, offload, meta init,
distillation).

They sit here, torch-free, rather than in ``tessera/parallel``: ``layout.check_layout`` refuses
unsupported combinations at config time through ``compat``, which ``parallel`` itself imports (via
``layout``), so compat cannot import ``parallel``. Model components declare their specs next to
their code (``tessera/model/components.py`` lists them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from tessera.registry import LayoutSpec, Spec, register

_DS_ONLY = "the DeepSpeed engine is data parallel only; set parallel.{key}=1 or parallel.engine='torch'"

# The columns, in the table's order: (name, what it is, layouts it cannot combine with).
_LAYOUTS = (
    ("single", "one process", {}),
    ("ddp", "replicated data parallelism (parallel.dp_replicate)", {}),
    ("fsdp", "sharded data parallelism, FSDP2 (parallel.dp_shard)", {}),
    ("hsdp", "hybrid sharded data parallelism (dp_replicate x dp_shard)", {}),
    ("tp", "tensor parallelism (parallel.tp)", {}),
    ("sp", "sequence parallelism with TP (parallel.sequence_parallel)", {}),
    ("pp", "pipeline parallelism (parallel.pp)", {}),
    ("cp", "context parallelism (parallel.cp)", {}),
    ("ep", "expert parallelism (parallel.ep)", {}),
    (
        "deepspeed",
        "the DeepSpeed engine (parallel.engine='deepspeed', ZeRO over every rank)",
        {
            layout: _DS_ONLY.format(key=key)
            for layout, key in (("ddp", "dp_replicate"), ("tp", "tp"), ("pp", "pp"), ("cp", "cp"), ("ep", "ep"))
        },
    ),
)
LAYOUTS = tuple(
    register(LayoutSpec(name=name, feature=doc, keys=("parallel",), unsupported=refused, checks=()))
    for name, doc, refused in _LAYOUTS
)

_OP_AC = {
    "ep": "the recompute replays FSDP's hooks of the sharded experts inside the block, which op-level "
    "checkpointing rejects; use parallel.activation_checkpoint=full or selective",
    "deepspeed": "op-level checkpointing is not validated with ZeRO's hooks; use "
    "parallel.activation_checkpoint=full or selective",
}
_OFFLOAD = {
    "single": "offload is an FSDP feature; shard with parallel.dp_shard > 1",
    "ddp": "offload is an FSDP feature; shard with parallel.dp_shard > 1",
    "tp": "offload with tensor parallelism is not supported",
    "pp": "offload is not validated with pipeline stages yet",
    "ep": "offload is not validated with expert parallelism yet",
    "deepspeed": "the DeepSpeed engine offloads with parallel.deepspeed.offload_optimizer / offload_params",
}
_DISTILL = {  # the teacher is placed under the student's layout (train/distill.py): TP, PP and CP work
    "deepspeed": "not validated with the DeepSpeed engine yet; use parallel.engine='torch' (FSDP/DDP/TP/PP/CP)",
}
_FT_ONE_PROCESS = (
    "each torchft replica group is one process holding the whole model (DDP replicas are the fault domains); "
    "{what} inside a replica group is not supported yet: run one process per group (tessera launch --ft-replicas N)"
)
_TORCHFT = {
    layout: _FT_ONE_PROCESS.format(what=what)
    for layout, what in (
        ("ddp", "parallel.dp_replicate"),
        ("fsdp", "sharding (parallel.dp_shard)"),
        ("hsdp", "HSDP"),
        ("tp", "tensor parallelism"),
        ("sp", "sequence parallelism"),
        ("pp", "pipeline parallelism"),
        ("cp", "context parallelism"),
        ("ep", "expert parallelism"),
    )
}
_TORCHFT["deepspeed"] = "DeepSpeed's engine reduces and steps itself; torchft needs parallel.engine='torch'"


def _feature(name: str, keys: tuple[str, ...], uses: Callable[[Any], bool], unsupported: dict[str, str]) -> Spec:
    spec = Spec(kind="feature", name=name, feature=name, keys=keys, uses=uses, scope="job", unsupported=unsupported)
    return register(dataclasses.replace(spec, checks=()))


FEATURES = (
    _feature("training", (), lambda job: True, {}),
    _feature(
        "activation checkpointing",
        ("parallel.activation_checkpoint",),
        lambda job: job.parallel.activation_checkpoint != "none",
        {},
    ),
    _feature(
        "op-level selective checkpointing",
        ("parallel.activation_checkpoint",),
        lambda job: job.parallel.activation_checkpoint == "op",
        _OP_AC,
    ),
    _feature(  # "auto" compiles only where it is supported
        "torch.compile",
        ("parallel.compile",),
        lambda job: job.parallel.compile is True,
        {"deepspeed": "compile is not validated with the DeepSpeed engine yet; set parallel.compile=false"},
    ),
    _feature("bf16", ("train.dtype",), lambda job: job.train.dtype == "bf16", {}),
    _feature(
        "fp16",
        ("train.dtype",),
        lambda job: job.train.dtype == "fp16",
        {
            "deepspeed": "fp16 with the DeepSpeed engine is not validated yet (its CPU accelerator refuses fp16); "
            "use bf16",
        },
    ),
    _feature("cpu offload (CUDA)", ("parallel.cpu_offload",), lambda job: job.parallel.cpu_offload, _OFFLOAD),
    _feature(
        "meta init",
        ("parallel.meta_init",),
        lambda job: job.parallel.meta_init,
        {"deepspeed": "the DeepSpeed engine partitions a built model; set parallel.meta_init=false"},
    ),
    _feature("distillation", ("train.distill",), lambda job: bool(job.train.distill.teacher), _DISTILL),
    _feature(
        "fault tolerance (torchft replica groups)",
        ("parallel.fault_tolerance", "parallel.ft"),
        lambda job: job.parallel.fault_tolerance == "torchft",
        _TORCHFT,
    ),
)
