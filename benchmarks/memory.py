"""Per-rank memory of real CPU training runs next to tessera's planner (``tessera plan``).

Every number is measured on real gloo processes with real tensors: torch's memory tracker
(``MemTracker``, or ``FSDPMemTracker`` under FSDP) adds up the storage of every live tensor.

Part 1, model states at rest. After one optimizer step of a decoder (bf16 compute), the bytes
of parameters, gradients and AdamW state each rank holds, for DDP and FSDP (ZeRO-3) at 1, 2, 4
ranks, next to tessera's formula and the ZeRO paper's. tessera keeps fp32 parameters as the
master copy, fp32 gradients and two fp32 moments: 4P + 4P + 8P. That equals the paper's
mixed-precision 16P (2P bf16 params + 2P bf16 grads + 12P fp32 master and moments) only by
coincidence of the byte counts, not because the same tensors exist. At rest FSDP holds 16P/N
whether or not it reshards after forward, so no "ZeRO-2" row is printed here.

Part 2, what ZeRO-2 and ZeRO-3 change: the parameter bytes a rank holds between forward and
backward (at the loss). Resharding after forward (ZeRO-3) keeps the fp32 shards plus the last
block gathered for backward; ``parallel.reshard_after_forward=false`` (ZeRO-2-style) keeps every
block and the root gathered in bf16 until backward: 4P/N + 2P.

Part 3, the whole step: per-rank peak of one training step for each layout family (single,
DDP, FSDP, ZeRO-2-style FSDP, HSDP, TP, TP+SP, FSDP x TP, pipeline 1F1B / interleaved / with
FSDP; context and expert parallelism when the compatibility matrix allows them), without and
with activation checkpointing, on a small and a medium model, next to the planner's figure.

Part 4, ``--measure`` on larger configs: a 1B and Llama 3 8B on 8 and 64 fake ranks (real
``parallelize()``, fake tensors) next to the planner.

Part 5, TP collectives: the collectives DTensor issues for one tensor-parallel block (tp=2),
forward and backward, with and without sequence parallelism.

Part 6, DeepSpeed next to FSDP2: model states per rank of the small decoder (fp32, so DeepSpeed's
module stays fp32 as tessera's weights do) on 2 gloo ranks under tessera's DeepSpeed engine
(``parallel.engine=deepspeed``) at ZeRO-1, ZeRO-2, ZeRO-3, ZeRO-2 and ZeRO-3 with the Adam step
offloaded (``parallel.offload_optimizer=cpu``), and under FSDP2 (``parallel.dp_shard=2``, Part 1's
worker), each beside the ZeRO formula for tessera's precision (fp32 weights 4P, grads 4P, AdamW 8P;
ZeRO-1 4P + 4P + 8P/N, ZeRO-2 4P + 4P/N + 8P/N, ZeRO-3 and FSDP2 16P/N). MemTracker cannot see
DeepSpeed's flat buffers, so the bytes are read from DeepSpeed's own structures, each storage
counted once (a view into a flat buffer counts the whole buffer, once) in this order: after
backward, before the step, gradients = the module parameters' ``.grad`` plus every tensor under a
ZeRO-optimizer attribute whose name holds "grad" (``averaged_gradients``/``grads_in_partition``,
``grad_partitions_flat_buffer``, offload gradient buffers) and the reduce buckets (``ipg_buckets``);
after the step, parameters = the module parameters (their ``ds_tensor`` partitions under ZeRO-3),
optimizer = the inner optimizer's state tensors plus the fp32 flat partitions it steps
(``single_partition_of_fp32_groups`` / ``fp32_partitioned_groups_flat``), other = any further tensor
the ZeRO optimizer holds. DeepSpeed's bucket and prefetch sizes (5e8 elements by default) and its
ZeRO-3 persistence threshold would dominate a 5M-parameter model, so the generated config gets
``DS_SMALL_BUCKETS`` (printed). Rows more than 5% off their formula list their buffers by attribute.

    python benchmarks/memory.py                # all parts (tens of minutes on 2 cores)
    python benchmarks/memory.py --parts 1,2,5  # a subset
    python benchmarks/memory.py --parts 6      # DeepSpeed vs FSDP2 (about 30 s)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import warnings

import torch

MIB = 2**20
SMALL = [
    "model.vocab_size=4096",
    "model.dim=256",
    "model.n_layers=4",
    "model.n_heads=8",
    "model.max_seq_len=256",
    "train.seq_len=128",
]
MEDIUM = [
    "model.vocab_size=8192",
    "model.dim=512",
    "model.n_layers=8",
    "model.n_heads=8",
    "model.n_kv_heads=4",
    "model.max_seq_len=256",
    "train.seq_len=256",
]
DIM, HEADS, VOCAB, SEQ, BATCH = 256, 8, 4096, 64, 4


def _config(overrides: list[str]):
    from tessera.validate import load_config

    return load_config(None, ["model.tie_embeddings=false", "train.dtype=bf16", *overrides])


def _local_bytes(tensors) -> int:
    from torch.distributed.tensor import DTensor

    # numel x size, not storage size: FSDP's gradient shards are views into one reduce-scatter buffer
    return sum(t.numel() * t.element_size() for t in (t.to_local() if isinstance(t, DTensor) else t for t in tensors))


def _build(config, dims):
    """The parallelized model (or pipeline) as the trainer builds it, plus the StepSpec for the step."""
    from tessera.model import build_model
    from tessera.parallel import parallelize, uses_fsdp
    from tessera.parallel.pipeline import build_pipeline
    from tessera.plan.measure import StepSpec
    from tessera.train.trainer import lm_loss

    torch.manual_seed(0)
    model = build_model(config.model)
    fsdp, tp = uses_fsdp(dims), dims.tp > 1
    if config.parallel.pp > 1:
        pipe = build_pipeline(
            model, dims, config, torch.device("cpu"), lm_loss, lambda stage: parallelize(stage, dims, config)
        )
        return pipe.model, StepSpec(dims.dp, fsdp, tp, pipeline=pipe, pp_mesh=dims.submesh("pp"))
    return parallelize(model, dims, config), StepSpec(dims.dp, fsdp, tp)


def _states(model, config, spec) -> dict:
    """Part 1: bytes of parameters, gradients and optimizer state after one optimizer step."""
    from tessera.model import count_parameters
    from tessera.plan.measure import _step
    from tessera.train.optim import build_optimizer

    optimizer = build_optimizer(model, config.optim)
    optimizer.zero_grad = lambda set_to_none=True: None  # keep the gradients to count them
    tokens = torch.randint(
        0, config.model.vocab_size, (1, config.train.batch_size // spec.dp, config.train.seq_len + 1)
    )
    _step(model, optimizer, config, tokens, spec)
    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    return {
        "params": _local_bytes(model.parameters()),
        "grads": _local_bytes(p.grad for p in model.parameters() if p.grad is not None),
        "optim": _local_bytes(state),
        "P": count_parameters(model),
    }


def _loss_params(model, config, spec) -> dict:
    """Part 2: parameter bytes (sharded + gathered) held at the loss, between forward and backward (FSDP)."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    from tessera.plan.measure import _step
    from tessera.train.optim import build_optimizer
    from tessera.train.trainer import lm_loss

    optimizer = build_optimizer(model, config.optim)
    local = config.train.batch_size // spec.dp
    _step(
        model, optimizer, config, torch.randint(0, config.model.vocab_size, (1, local, config.train.seq_len + 1)), spec
    )
    tokens = torch.randint(0, config.model.vocab_size, (local, config.train.seq_len + 1))
    with FSDPMemTracker(model, optimizer) as tracker:
        loss = lm_loss(model(tokens[:, :-1]), tokens[:, 1:])
        snapshot = next(iter(tracker.get_tracker_snapshot("current").values()))
        loss.backward()
    kinds = {str(getattr(k, "value", k)): v for k, v in snapshot.items()}
    return {"sharded": kinds.get("Sharded Param", 0), "gathered": kinds.get("Unsharded Param", 0)}


def worker(mode: str, overrides: list[str]) -> None:
    """One rank: build the layout, measure, and let rank 0 print every rank's figures as one JSON line."""
    import torch.distributed as dist

    from tessera.parallel import ParallelDims
    from tessera.parallel.env import init_distributed
    from tessera.plan.measure import training_memory

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    env = init_distributed("cpu")
    config = _config(overrides)
    dims = ParallelDims.from_config(config.parallel, env.world_size)
    if env.is_distributed:
        dims.build_mesh("cpu")
    model, spec = _build(config, dims)
    if mode == "peak":
        peak, kinds = training_memory(model, config, spec, steps=1)
        record = {"peak": peak, "kinds": kinds}
    else:
        record = (_states if mode == "states" else _loss_params)(model, config, spec)
    records = [None] * env.world_size
    if env.is_distributed:
        dist.all_gather_object(records, record)
        dist.destroy_process_group()
    else:
        records = [record]
    if env.rank == 0:
        print("RESULT " + json.dumps(records), flush=True)


def _launch(world: int, *args: str):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if world == 1:
        cmd = [sys.executable, __file__, *args]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={world}",
            __file__,
            *args,
        ]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"{' '.join(args)} at {world} ranks failed:\n{proc.stderr[-3000:]}")
    return json.loads(lines[0][7:])


def _plan(overrides: list[str], world: int, pp_rank: int | None = None) -> float:
    """The planner's per-GPU bytes (tensors only, CPU optimizer) for the same job."""
    from tessera.plan.activations import tessera_precision
    from tessera.plan.layouts import layout_of
    from tessera.plan.memory import Setting, estimate_memory, rank_memory
    from tessera.plan.shapes import model_shape

    config = _config(overrides)
    layout = layout_of(config, world)
    setting = Setting(
        tessera_precision(config.train.dtype, layout.fsdp),
        config.train.seq_len,
        "cpu",
        config.parallel.layers_per_stage,
    )
    shape = model_shape(config.model)
    if pp_rank is not None:
        return rank_memory(shape, layout, setting, pp_rank).total
    return estimate_memory(shape, layout, setting).total


def part1() -> None:
    print("Part 1: model states at rest after the optimizer step, MiB per rank (small model, bf16 compute)")
    print(f"{'layout':<7}{'ranks':>6}{'params':>9}{'grads':>9}{'optim':>9}{'total':>9}{'tessera':>9}{'ZeRO paper':>12}")
    for mode in ("ddp", "fsdp"):
        for world in (1, 2, 4):
            degrees = (
                ["parallel.dp_shard=1"]
                if world == 1
                else (
                    [f"parallel.dp_replicate={world}", "parallel.dp_shard=1"]
                    if mode == "ddp"
                    else [f"parallel.dp_shard={world}"]
                )
            )
            r = _launch(world, "--worker", "states", *SMALL, f"train.batch_size={4 * world}", *degrees)[0]
            n = world if mode == "fsdp" else 1
            total = r["params"] + r["grads"] + r["optim"]
            print(
                f"{mode:<7}{world:>6}{r['params'] / MIB:>9.2f}{r['grads'] / MIB:>9.2f}{r['optim'] / MIB:>9.2f}"
                f"{total / MIB:>9.2f}"
                f"{16 * r['P'] / n / MIB:>9.2f}{16 * r['P'] / n / MIB:>12.2f}"
            )
    print("tessera: fp32 params (master) 4P + fp32 grads 4P + AdamW moments 8P = 16P (DDP), 16P/N (FSDP).")
    print(
        "ZeRO paper, mixed-precision Adam: 2P bf16 params + 2P bf16 grads + 12P fp32 master and moments "
        "= 16P (stage 0),"
    )
    print("16P/N (stage 3): equal totals by coincidence of the fp32 master weights, not the same tensors.")


def part2() -> None:
    from tessera.plan.shapes import model_shape

    print(
        "\nPart 2: parameter bytes per rank between forward and backward (at the loss), MiB: "
        "ZeRO-3 vs ZeRO-2-style FSDP"
    )
    print(f"{'reshard_after_forward':<24}{'ranks':>6}{'shards':>9}{'gathered':>10}{'total':>9}{'formula':>9}  formula")
    shape = model_shape(_config(SMALL).model)
    p, last = shape.total, shape.blocks[-1].total
    for world in (2, 4):
        for reshard in (True, False):
            r = _launch(
                world,
                "--worker",
                "loss_params",
                *SMALL,
                f"train.batch_size={4 * world}",
                f"parallel.dp_shard={world}",
                f"parallel.reshard_after_forward={str(reshard).lower()}",
            )[0]
            formula = 4 * p / world + (2 * last if reshard else 2 * p)
            text = "4P/N + 2 x last block (bf16)" if reshard else "4P/N + 2P (every block and the root, bf16)"
            print(
                f"{reshard!s:<24}{world:>6}{r['sharded'] / MIB:>9.2f}{r['gathered'] / MIB:>10.2f}"
                f"{(r['sharded'] + r['gathered']) / MIB:>9.2f}{formula / MIB:>9.2f}  {text}"
            )


# (name, ranks, overrides): each layout family of Part 3, on the small model unless MEDIUM is named.
PART3 = [
    ("single", 1, ["parallel.dp_shard=1"]),
    ("single, full AC", 1, ["parallel.dp_shard=1", "parallel.activation_checkpoint=full"]),
    ("DDP 2", 2, ["parallel.dp_replicate=2", "parallel.dp_shard=1"]),
    (
        "DDP 2, selective AC",
        2,
        ["parallel.dp_replicate=2", "parallel.dp_shard=1", "parallel.activation_checkpoint=selective"],
    ),
    ("FSDP 4", 4, ["parallel.dp_shard=4"]),
    ("FSDP 4, full AC", 4, ["parallel.dp_shard=4", "parallel.activation_checkpoint=full"]),
    ("FSDP 4, op AC", 4, ["parallel.dp_shard=4", "parallel.activation_checkpoint=op"]),
    ("FSDP 4, ZeRO-2-style", 4, ["parallel.dp_shard=4", "parallel.reshard_after_forward=false"]),
    ("HSDP 2x2", 4, ["parallel.dp_replicate=2", "parallel.dp_shard=2"]),
    ("TP 2", 2, ["parallel.dp_shard=1", "parallel.tp=2", "parallel.sequence_parallel=false"]),
    ("TP 2 + SP", 2, ["parallel.dp_shard=1", "parallel.tp=2"]),
    ("TP 2 + SP, full AC", 2, ["parallel.dp_shard=1", "parallel.tp=2", "parallel.activation_checkpoint=full"]),
    ("FSDP 2 x TP 2 + SP", 4, ["parallel.dp_shard=2", "parallel.tp=2"]),
    ("PP 2, 1F1B, 4 micro-batches", 2, ["parallel.dp_shard=1", "parallel.pp=2", "parallel.microbatches=4"]),
    (
        "PP 2, 1F1B, full AC",
        2,
        ["parallel.dp_shard=1", "parallel.pp=2", "parallel.microbatches=4", "parallel.activation_checkpoint=full"],
    ),
    (
        "PP 2, interleaved v2",
        2,
        ["parallel.dp_shard=1", "parallel.pp=2", "parallel.microbatches=4", "parallel.pp_schedule=interleaved_1f1b"],
    ),
    ("PP 2 x FSDP 2", 4, ["parallel.dp_shard=2", "parallel.pp=2", "parallel.microbatches=4"]),
    ("CP 2", 2, ["parallel.dp_shard=1", "parallel.cp=2"]),
    ("EP 2 (MoE, 4 experts)", 2, ["parallel.dp_shard=2", "parallel.ep=2", "model.moe.experts=4", "model.moe.top_k=2"]),
    ("medium: FSDP 4", 4, [*MEDIUM, "parallel.dp_shard=4"]),
    ("medium: FSDP 4, full AC", 4, [*MEDIUM, "parallel.dp_shard=4", "parallel.activation_checkpoint=full"]),
    ("medium: FSDP 2 x TP 2 + SP", 4, [*MEDIUM, "parallel.dp_shard=2", "parallel.tp=2"]),
    ("medium: DDP 2", 2, [*MEDIUM, "parallel.dp_replicate=2", "parallel.dp_shard=1"]),
    (
        "medium: PP 2 x TP 2",
        4,
        [*MEDIUM, "parallel.dp_shard=1", "parallel.pp=2", "parallel.tp=2", "parallel.microbatches=4"],
    ),
]


def _refused(overrides: list[str], world: int) -> str:
    from tessera.errors import ConfigError
    from tessera.layout import check_layout

    try:
        check_layout(_config(overrides), world)
    except ConfigError as err:
        return str(err)
    return ""


def part3() -> None:
    print("\nPart 3: per-rank peak of one training step, MiB (real gloo ranks, real tensors) vs the planner")
    print(f"{'layout':<34}{'ranks':>6}{'measured (max rank)':>21}{'plan':>9}{'plan/measured':>15}")
    for name, world, extra in PART3:
        overrides = [*SMALL, *extra, f"train.batch_size={8 if world < 4 else 16}"]
        refused = _refused(overrides, world)
        if refused:
            print(f"{name:<34}{world:>6}  not run: {refused[:90]}")
            continue
        peaks = [r["peak"] for r in _launch(world, "--worker", "peak", *overrides)]
        planned = _plan(overrides, world)
        print(f"{name:<34}{world:>6}{max(peaks) / MIB:>21.1f}{planned / MIB:>9.1f}{planned / max(peaks):>15.3f}")


LLAMA_1B = [
    "model.vocab_size=32000",
    "model.dim=2048",
    "model.n_layers=16",
    "model.n_heads=16",
    "model.n_kv_heads=8",
    "model.ffn_hidden=5632",
    "model.max_seq_len=4096",
    "train.seq_len=4096",
]
# (name, recipe, overrides, fake ranks) for Part 4.
PART4 = [
    ("1B: FSDP 8", None, [*LLAMA_1B, "parallel.dp_shard=8", "train.batch_size=16"], 8),
    (
        "1B: FSDP 4 x TP 2 + SP, full AC",
        None,
        [
            *LLAMA_1B,
            "parallel.dp_shard=4",
            "parallel.tp=2",
            "train.batch_size=8",
            "parallel.activation_checkpoint=full",
        ],
        8,
    ),
    (
        "1B: HSDP 8x8, op AC",
        None,
        [
            *LLAMA_1B,
            "parallel.dp_replicate=8",
            "parallel.dp_shard=8",
            "train.batch_size=64",
            "parallel.activation_checkpoint=op",
        ],
        64,
    ),
    (
        "8B: FSDP 8, op AC",
        "configs/llama3-8b.toml",
        ["parallel.tp=1", "parallel.dp_shard=8", "train.batch_size=8", "parallel.activation_checkpoint=op"],
        8,
    ),
    (
        "8B: FSDP 8 x TP 8 + SP",
        "configs/llama3-8b.toml",
        ["parallel.tp=8", "parallel.dp_shard=8", "train.batch_size=8"],
        64,
    ),
    (
        "8B: FSDP 64, full AC",
        "configs/llama3-8b.toml",
        ["parallel.tp=1", "parallel.dp_shard=64", "train.batch_size=64", "parallel.activation_checkpoint=full"],
        64,
    ),
]


def part4() -> None:
    from tessera.validate import load_config
    from tessera.plan.activations import tessera_precision
    from tessera.plan.layouts import layout_of
    from tessera.plan.measure import measure_layout
    from tessera.plan.memory import Setting, estimate_memory
    from tessera.plan.shapes import model_shape

    print(
        "\nPart 4: --measure on fake ranks (real model, real parallelize(), fake tensors) vs the planner, GiB per GPU"
    )
    print(f"{'layout':<34}{'ranks':>6}{'measured':>10}{'plan':>9}{'plan/measured':>15}{'seconds':>9}")
    for name, recipe, overrides, world in PART4:
        config = load_config(recipe, ["train.dtype=bf16", *overrides])
        m = measure_layout(config, world)
        layout = layout_of(config, world)
        setting = Setting(tessera_precision("bf16", layout.fsdp), config.train.seq_len, "cpu")
        planned = estimate_memory(model_shape(config.model), layout, setting).total
        print(
            f"{name:<34}{world:>6}{m.peak / 2**30:>10.2f}{planned / 2**30:>9.2f}{planned / m.peak:>15.3f}"
            f"{m.seconds:>9.0f}"
        )


def tp_worker() -> None:
    """Count DTensor collectives of one TP block, forward and backward, without and with SP."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from tessera.config import model_config
    from tessera.model import build_model
    from tessera.parallel.comms import CollectiveCounter
    from tessera.parallel.tensor import apply_tensor_parallel

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    out = {}
    for sp in (False, True):
        torch.manual_seed(0)
        model = build_model(
            model_config(vocab_size=VOCAB, dim=DIM, n_layers=1, n_heads=HEADS, max_seq_len=128, tie_embeddings=False)
        )
        apply_tensor_parallel(model, mesh, sp)
        block = model.layers["0"]
        x = torch.randn(BATCH, SEQ, DIM, requires_grad=True)
        if sp:
            from torch.distributed.tensor import DTensor, Shard

            x_in = DTensor.from_local(x.chunk(2, dim=1)[dist.get_rank()].detach().requires_grad_(), mesh, (Shard(1),))
        else:
            x_in = x
        ctx = model.context(BATCH, SEQ, 0, None, None, x.device) if hasattr(model, "context") else None
        fwd, bwd = CollectiveCounter(), CollectiveCounter()
        with fwd:
            y = block(x_in, ctx)
        loss = (y.full_tensor() if hasattr(y, "full_tensor") else y).float().pow(2).mean()
        with bwd:
            loss.backward()
        out["sp" if sp else "tp"] = {
            "forward": {k: f"{v} x {fwd.kib[k]:.0f} KiB" for k, v in fwd.counts.items()},
            "backward": {k: f"{v} x {bwd.kib[k]:.0f} KiB" for k, v in bwd.counts.items()},
        }
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(out), flush=True)
    dist.destroy_process_group()


def part5() -> None:
    counts = _launch(2, "--tp-worker")
    size = BATCH * SEQ * DIM * 4 / 1024
    print(
        f"\nPart 5: collectives of one TP block at tp=2 "
        f"(activation {BATCH}x{SEQ}x{DIM} fp32 = {size:.0f} KiB per collective)"
    )
    for name, expected in (
        ("tp", "2 all_reduce forward, 2 backward"),
        ("sp", "2 all_gather + 2 reduce_scatter forward, the same backward"),
    ):
        print(
            f"  {name}: measured forward {counts[name]['forward']}, backward {counts[name]['backward']}; "
            f"expected {expected}"
        )


# Part 6: DeepSpeed ZeRO stages (tessera's engine) and FSDP2, model states per rank on 2 ranks.
DS_LAYOUTS = [
    ("ZeRO-1", ["parallel.zero_stage=1"], 1),
    ("ZeRO-2", ["parallel.zero_stage=2"], 2),
    ("ZeRO-3", ["parallel.zero_stage=3"], 3),
    ("ZeRO-2 + CPU Adam offload", ["parallel.zero_stage=2", "parallel.offload_optimizer=cpu"], 2),
    ("ZeRO-3 + CPU Adam offload", ["parallel.zero_stage=3", "parallel.offload_optimizer=cpu"], 3),
]
DS_BUCKET = 2**16  # elements: DeepSpeed's 5e8 defaults would allocate ~2 GB of fp32 buckets for a 5M-parameter model
DS_SMALL_BUCKETS = {
    "reduce_bucket_size": DS_BUCKET,
    "allgather_bucket_size": DS_BUCKET,
    "stage3_prefetch_bucket_size": DS_BUCKET,
    "stage3_max_live_parameters": DS_BUCKET,
    "stage3_max_reuse_distance": DS_BUCKET,
    "stage3_param_persistence_threshold": 0,  # else small weights stay whole on every rank
    "overlap_comm": False,
}
DS_FP32 = ["train.dtype=fp32", "train.grad_accum=1"]  # DeepSpeed's bf16 would make the module itself bf16


def _storages(tensors, seen: set[int]) -> int:
    """Bytes of the storages behind ``tensors`` not counted yet (views into one flat buffer count it once)."""
    total = 0
    for t in tensors:
        if not torch.is_tensor(t) or t.device.type == "meta":
            continue
        storage = t.untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def _walk(value, depth: int = 0):
    """Every tensor inside ``value``'s lists, tuples, dicts and DeepSpeed bucket objects."""
    if torch.is_tensor(value):
        yield value
    elif depth < 4 and isinstance(value, (list, tuple)):
        for item in value:
            yield from _walk(item, depth + 1)
    elif depth < 4 and isinstance(value, dict):
        for item in value.values():
            yield from _walk(item, depth + 1)
    elif depth < 4 and type(value).__module__.startswith("deepspeed.runtime.zero") and hasattr(value, "__dict__"):
        for item in vars(value).values():
            yield from _walk(item, depth + 1)


def _ds_states(engine, seen: set[int]) -> dict:
    """Bytes each rank holds in DeepSpeed's own structures, each storage counted once (``seen``: counted already)."""
    zero, module = engine.optimizer, engine.module
    params = list(module.parameters())
    record = {"params": _storages((getattr(p, "ds_tensor", p) for p in params), seen)}
    inner_state = [v for s in zero.optimizer.state.values() for v in s.values()]
    flats = getattr(zero, "fp32_partitioned_groups_flat", None) or zero.single_partition_of_fp32_groups
    record["optim"] = _storages([*inner_state, *flats], seen)
    record["fp32_copy"] = sum(f.numel() * f.element_size() for f in flats)  # part of optim: DeepSpeed's master clone
    other = {}
    for name, value in vars(zero).items():
        if name == "optimizer" or isinstance(value, torch.nn.Module):
            continue
        size = _storages(_walk(value), seen)
        if size:
            other[name.split("__")[-1]] = size
    record["other"] = other
    return record


def _ds_grads(engine, seen: set[int]) -> dict:
    """Gradient bytes after backward, before the step: module .grad plus ZeRO's partition buffers and buckets."""
    zero = engine.optimizer
    found = {"param.grad": _storages((p.grad for p in engine.module.parameters()), seen)}
    for name, value in vars(zero).items():
        if "grad" in name.lower() and name != "optimizer" and not isinstance(value, torch.nn.Module):
            size = _storages(_walk(value), seen)
            if size:
                found[name.split("__")[-1]] = size
    found.update({f"{k} (bucket)": v for k, v in _ds_buckets(zero, seen).items()})
    return found


def _ds_buckets(zero, seen: set[int]) -> dict:
    buckets = {}
    for name in ("ipg_buckets", "ipg_buffer", "temp_grad_buffer_for_cpu_offload"):
        size = _storages(_walk(getattr(zero, name, None)), seen)
        if size:
            buckets[name] = size
    return buckets


def _ds_layout(overrides: list[str], env) -> dict:
    """One ZeRO layout: build tessera's DeepSpeed engine, backward (count grads), step (count params and state)."""
    from tessera.model import build_model, count_parameters
    from tessera.parallel import ParallelDims
    from tessera.train.distributed import ParallelContext
    from tessera.train.engine import DeepSpeedEngine
    from tessera.train.trainer import lm_loss

    config = _config(overrides)
    torch.manual_seed(0)
    model = build_model(config.model)
    P = count_parameters(model)
    dims = ParallelDims.from_config(config.parallel, env.world_size)
    engine = DeepSpeedEngine(config, model, ParallelContext(env, dims, torch.device("cpu")))
    local = config.train.batch_size // env.world_size
    tokens = torch.randint(0, config.model.vocab_size, (local, config.train.seq_len + 1))
    engine.backward(lm_loss(engine.model(tokens[:, :-1]), tokens[:, 1:]))
    seen: set[int] = {id(None)}
    grads = _ds_grads(engine.model, seen)
    averaged = list(_walk(getattr(engine.model.optimizer, "averaged_gradients", None)))
    views = sum(t.numel() * t.element_size() for t in averaged)
    engine.step()
    record = _ds_states(engine.model, seen)
    record.update(grads=sum(grads.values()), grad_parts=grads, grad_views=views, P=P)
    engine.model.destroy()
    return record


def ds_worker(overrides: list[str]) -> None:
    """Part 6, one rank: every ZeRO layout in turn in this world; rank 0 prints all ranks' records."""
    import torch.distributed as dist

    from tessera.parallel.env import init_distributed

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    env = init_distributed("cpu")
    path = f"/tmp/tessera_memory_ds_{os.getppid()}.json"
    if env.rank == 0:
        with open(path, "w") as f:
            json.dump({"zero_optimization": DS_SMALL_BUCKETS}, f)
    dist.barrier()
    out = {}
    for name, extra, _ in DS_LAYOUTS:
        record = _ds_layout([*overrides, "parallel.engine=deepspeed", f"parallel.deepspeed_config={path}", *extra], env)
        records = [None] * env.world_size
        dist.all_gather_object(records, record)
        out[name] = records
    if env.rank == 0:
        os.remove(path)
        print("RESULT " + json.dumps(out), flush=True)
    dist.destroy_process_group()


def _zero_formula(stage: int, p: int, n: int) -> tuple[int, int, int]:
    """(params, grads, optimizer) bytes per rank under ZeRO ``stage`` with fp32 weights, grads and AdamW moments."""
    return (4 * p if stage < 3 else 4 * p // n, 4 * p if stage < 2 else 4 * p // n, 8 * p // n)


def _off_formula(name: str, r: dict, formula: tuple[int, int, int]) -> str:
    """Why a row misses its formula by over 5%: DeepSpeed's buffers by attribute (empty when it does not)."""
    measured = (r["params"], r["grads"], r["optim"], r["params"] + r["grads"] + r["optim"] + _other(r))
    if all(abs(m / f - 1) <= 0.05 for m, f in zip(measured, (*formula, sum(formula)))):
        return ""
    parts = [f"grads = {_mib(r['grad_parts'])}"]
    if r["grad_views"]:
        parts.append(f"the partition's own gradient views {r['grad_views'] / MIB:.2f}")
    parts.append(f"optim includes DeepSpeed's fp32 master partition {r['fp32_copy'] / MIB:.2f}")
    if _other(r):
        parts.append(f"other = {_mib(r['other'])}")
    return f"  {name}: " + "; ".join(parts)


def _mib(parts: dict) -> str:
    return ", ".join(f"{k} {v / MIB:.2f}" for k, v in parts.items() if v >= 1024) or "-"


def _other(r: dict) -> int:
    return sum(v for v in r.get("other", {}).values() if v >= 1024)


def part6() -> None:
    """DeepSpeed ZeRO-1/2/3 (+ CPU Adam offload) and FSDP2 on 2 ranks: params, grads, optimizer state vs ZeRO."""
    world = 2
    overrides = [*SMALL, *DS_FP32, f"train.batch_size={4 * world}"]
    print(
        f"\nPart 6: DeepSpeed ZeRO-1/2/3 (+ CPU Adam offload) and FSDP2, model states per rank on {world} gloo ranks, "
        "MiB, measured (formula), the rank holding more (small model, fp32)"
    )
    print(f"DeepSpeed config set for a small model: {json.dumps(DS_SMALL_BUCKETS)}")
    ds = _launch(world, "--ds-worker", *overrides)
    fsdp = _launch(world, "--worker", "states", *overrides, f"parallel.dp_shard={world}")
    rows = [(name, stage, ds[name]) for name, _, stage in DS_LAYOUTS] + [("FSDP2 (dp_shard=2)", 3, fsdp)]
    print(f"{'layout':<27}{'params':>16}{'grads':>16}{'optim':>16}{'other':>7}{'total':>16}{'ratio':>7}")
    notes = []
    for name, stage, records in rows:
        r = max(records, key=lambda r: r["params"] + r["grads"] + r["optim"] + _other(r))
        f = _zero_formula(stage, r["P"], world)
        cells = "".join(f"{m / MIB:>7.2f} ({x / MIB:>6.2f})" for m, x in zip((r["params"], r["grads"], r["optim"]), f))
        total = r["params"] + r["grads"] + r["optim"] + _other(r)
        print(
            f"{name:<27}{cells}{_other(r) / MIB:>7.2f}{total / MIB:>7.2f} ({sum(f) / MIB:>6.2f}){total / sum(f):>7.3f}"
        )
        notes.append(_off_formula(name, r, f) if "grad_parts" in r else "")
    print(
        f"P = {rows[0][2][0]['P']:,} parameters, N = {world}; formula: ZeRO-1 4P + 4P + 8P/N, ZeRO-2 4P + 4P/N + "
        "8P/N, ZeRO-3 and FSDP2 16P/N (fp32 weights, grads, AdamW moments); other: further DeepSpeed buffers"
    )
    if any(notes):
        print("Rows off their formula by over 5% (MiB by DeepSpeed attribute):")
        print("\n".join(n for n in notes if n))


def main() -> None:
    """Run the chosen parts and print their tables."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", choices=["states", "loss_params", "peak"])
    parser.add_argument("--tp-worker", action="store_true")
    parser.add_argument("--ds-worker", action="store_true")
    parser.add_argument("--parts", default="1,2,3,4,5,6", help="comma-separated parts to run")
    args, overrides = parser.parse_known_args()
    if args.worker:
        return worker(args.worker, overrides)
    if args.tp_worker:
        return tp_worker()
    if args.ds_worker:
        return ds_worker(overrides)
    parts = {"1": part1, "2": part2, "3": part3, "4": part4, "5": part5, "6": part6}
    for part in args.parts.split(","):
        parts[part.strip()]()


if __name__ == "__main__":
    main()
