"""[parallel]: the parallel degrees and their knobs; [parallel.deepspeed]: the DeepSpeed engine's;
[parallel.ft]: torchft replica groups (parallel.fault_tolerance='torchft')."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class DeepSpeedConfig:
    """[parallel.deepspeed]: ZeRO stage, offload and an optional ds.json (with parallel.engine='deepspeed')."""

    zero_stage: int = 2  # ZeRO 1 shards optimizer state, 2 also gradients, 3 also parameters
    offload_optimizer: Literal["none", "cpu", "nvme"] = "none"  # optimizer state and step off the GPU
    offload_params: Literal["none", "cpu", "nvme"] = "none"  # zero_stage 3: parameters off the GPU
    nvme_path: str = ""  # directory on a fast local disk for nvme offload (ZeRO-Infinity)
    config: str = ""  # a ds.json merged into the generated config; contradictions refused


@dataclass
class FaultToleranceConfig:
    """[parallel.ft]: this process's replica group under torchft (parallel.fault_tolerance='torchft')."""

    replicas: int = 2  # replica groups (one process each) the global batch is dealt over
    replica_id: int = 0  # this process's replica group, 0 .. replicas-1 (`tessera launch --ft-replicas` sets it)
    lighthouse: str = ""  # torchft lighthouse HOST:PORT (or http://HOST:PORT); empty: $TORCHFT_LIGHTHOUSE
    min_replicas: int = 1  # fewest replica groups a step commits with
    timeout_s: float = 10.0  # a collective or quorum this slow counts as a failed peer (the step is redone)


PipelineSchedule = Literal["gpipe", "1f1b", "interleaved_1f1b", "interleaved_zb", "zbv", "dualpipev"]


@dataclass
class ParallelConfig:
    """Parallel degrees; their product must equal the world size (dp_shard=-1 takes the rest)."""

    dp_replicate: int = 1  # replicas of the model (DDP, or the replicate dimension of HSDP)
    dp_shard: int = -1  # ranks sharding params, grads and optimizer state (FSDP); -1 = the processes left
    tp: int = 1  # tensor-parallel degree (Megatron-style column/row-parallel linears, vocab-parallel head)
    pp: int = 1  # pipeline stages (the outermost mesh dimension)
    pp_schedule: PipelineSchedule = "1f1b"  # pipeline schedule (pp > 1)
    microbatches: int = 0  # micro-batches per pipeline step; 0 means pp
    pp_virtual_stages: int = 0  # stages per pp rank; 0 means 2 for interleaved/zero-bubble schedules, else 1
    layers_per_stage: str = ""  # block counts per stage, e.g. "3,5"; "cost": even FLOPs (head too); empty: even
    cp: int = 1  # context parallelism: each rank holds 1/cp of every sequence (zigzag split)
    cp_method: Literal["allgather", "ring"] = "allgather"  # cp attention: all-gather K/V, or pass them around a ring
    ep: int = 1  # expert-parallel degree: experts sharded over this many dp_shard x cp x tp ranks
    sequence_parallel: bool = True  # with tp > 1: shard norms/dropout activations along the sequence
    reshard_after_forward: bool = True  # FSDP: true is ZeRO-3, false keeps params gathered until backward (ZeRO-2)
    cpu_offload: bool = False  # FSDP: parameters, gradients and optimizer step on the CPU
    activation_checkpoint: Literal["none", "full", "selective", "op"] = "none"  # selective = every ac_every-th block
    ac_every: int = 2  # selective: checkpoint every n-th block
    compile: Literal["auto", True, False] = "auto"  # torch.compile each block; auto: on CUDA (see README Performance)
    meta_init: bool = False  # build on the meta device, shard, then initialize (for models too big for one host)
    engine: Literal["torch", "deepspeed"] = "torch"  # torch: FSDP2/DDP/TP/PP/CP/EP; deepspeed: ZeRO data parallelism
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    fault_tolerance: Literal["none", "torchft"] = "none"  # torchft: replica groups survive a dead peer ([parallel.ft])
    ft: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)
