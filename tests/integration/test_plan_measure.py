"""The memory plan against measurement: the real model under the real parallelize() on fake ranks.

``measure_layout`` runs tessera's own ``parallelize()`` and the trainer's step on a fake process
group with fake tensors and adds up every live tensor (torch's memory tracker); the planner's
formula must land within 10% of it for each layout family. A second test checks the fake-rank
measurement against real gloo processes with real tensors, so the measurement itself is sound.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tessera.validate import load_config
from tessera.plan.layouts import layout_of
from tessera.plan.measure import StepSpec, measure_layout, training_memory
from tessera.plan.memory import estimate_memory
from tessera.plan.planner import job_setting
from tessera.plan.shapes import model_shape

from helpers.runs import REPO

MODEL = [
    "model.vocab_size=2048",
    "model.dim=128",
    "model.n_layers=4",
    "model.n_heads=4",
    "model.max_seq_len=128",
    "train.seq_len=128",
]

CHUNKS = ["model.vocab_size=8192", "train.loss_chunk_tokens=128"]  # 4 chunks of the 512 tokens per rank

# Each layout family once (bf16 unless named): data parallel (FSDP, ZeRO-2-style, HSDP, DDP), TP with and without
# SP, every activation-checkpointing mode, accumulation, and a vocabulary small enough that backward is the peak.
LAYOUTS = {
    "fsdp4": ["parallel.dp_shard=4"],
    "fsdp4-fp32": ["parallel.dp_shard=4", "train.dtype=fp32"],
    "fsdp4-no-reshard": ["parallel.dp_shard=4", "parallel.reshard_after_forward=false"],
    "fsdp2-tp2-sp": ["parallel.dp_shard=2", "parallel.tp=2"],
    "fsdp2-tp2-no-sp-fp32": [
        "parallel.dp_shard=2",
        "parallel.tp=2",
        "parallel.sequence_parallel=false",
        "train.dtype=fp32",
    ],
    "tp4": ["parallel.dp_shard=1", "parallel.tp=4", "train.batch_size=4"],
    "hsdp2x2": ["parallel.dp_replicate=2", "parallel.dp_shard=2"],
    "ddp4": ["parallel.dp_replicate=4", "parallel.dp_shard=1"],
    "fsdp4-full-ac-small-vocab": ["parallel.dp_shard=4", "parallel.activation_checkpoint=full", "model.vocab_size=512"],
    "fsdp4-op-ac-fp32": ["parallel.dp_shard=4", "parallel.activation_checkpoint=op", "train.dtype=fp32"],
    "tp2-selective-ac-accum2-small-vocab": [
        "parallel.dp_shard=2",
        "parallel.tp=2",
        "parallel.activation_checkpoint=selective",
        "train.grad_accum=2",
        "model.vocab_size=512",
    ],
    # The loss: the layouts above fuse the head into the loss in one chunk (train.fused_loss, the default);
    # these run the plain loss on whole logits, or the fused one in several chunks of a larger vocabulary.
    "fsdp4-plain-loss": ["parallel.dp_shard=4", "train.fused_loss=false"],
    "tp4-plain-loss": ["parallel.dp_shard=1", "parallel.tp=4", "train.batch_size=4", "train.fused_loss=false"],
    "fsdp4-fused-chunks-fp32": [*CHUNKS, "parallel.dp_shard=4", "train.dtype=fp32"],
    "fsdp2-tp2-sp-fused-chunks": [*CHUNKS, "parallel.dp_shard=2", "parallel.tp=2"],
    "ddp4-fused-chunks": [*CHUNKS, "parallel.dp_replicate=4", "parallel.dp_shard=1"],
}


def _planned(config, world: int) -> float:
    layout = layout_of(config, world)
    return estimate_memory(model_shape(config.model), layout, job_setting(config, layout, "cpu")).total


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_plan_within_10_percent_of_fake_rank_measurement(name):
    config = load_config(None, [*MODEL, "train.batch_size=16", "train.dtype=bf16", *LAYOUTS[name]])
    measured = measure_layout(config, 4)
    planned = _planned(config, 4)
    assert planned == pytest.approx(measured.peak, rel=0.10), (
        f"{name}: plan {planned / 2**20:.1f} MiB, measured {measured.peak / 2**20:.1f}"
    )


# The optimizer's state and step (MuonAdamW reads its step counter on the host, so it cannot run on fake
# tensors): one process, real tensors, a model whose optimizer step is the peak (few tokens, wide blocks).
OPTIMIZERS = {
    "adamw": [],  # torch's fused kernel (optim.implementation=auto): no temporaries, the step ends backward's peak
    "adamw-for-loop": ["optim.implementation=for-loop"],
    "adamw-bf16-state": ["optim.state_dtype=bf16"],
    "muon": ["optim.name=muon"],
    "muon-bf16-state": ["optim.name=muon", "optim.state_dtype=bf16"],
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_plan_follows_the_optimizer_state_and_step(name):
    import torch

    from tessera.model import build_model

    overrides = [*MODEL, "model.dim=256", "train.seq_len=8", "train.batch_size=1", "parallel.dp_shard=1"]
    config = load_config(None, [*overrides, "train.dtype=bf16", *OPTIMIZERS[name]])
    torch.manual_seed(0)
    measured, _ = training_memory(build_model(config.model), config, StepSpec(1, False, False), steps=1)
    layout = layout_of(config, 1)
    planned = estimate_memory(model_shape(config.model), layout, job_setting(config, layout, "cpu"))
    assert planned.moment in ("optimizer step", "backward end")
    assert planned.total == pytest.approx(measured, rel=0.03), (
        f"{name}: plan {planned.total / 2**20:.1f} MiB, measured {measured / 2**20:.1f}"
    )


WORKER = """
import json, sys, warnings
warnings.filterwarnings("ignore")
import torch
torch.set_num_threads(1)
from tessera.validate import load_config
from tessera.model import build_model
from tessera.parallel import ParallelDims, parallelize, uses_fsdp
from tessera.parallel.env import init_distributed
from tessera.plan.measure import StepSpec, training_memory
env = init_distributed("cpu")
config = load_config(None, sys.argv[1:])
dims = ParallelDims.from_config(config.parallel, env.world_size)
dims.build_mesh("cpu")
torch.manual_seed(0)
model = parallelize(build_model(config.model), dims, config)
peak, _ = training_memory(model, config, StepSpec(dims.dp, uses_fsdp(dims), dims.tp > 1), steps=1)
with open(f"{OUT}/peak{env.rank}.json", "w") as f:
    json.dump(peak, f)
"""


@pytest.mark.slow
def test_fake_rank_measurement_equals_real_processes(tmp_path):
    """The same step on 4 real gloo processes with real tensors peaks at the fake-rank figure (FSDP x TP, bf16)."""
    overrides = [*MODEL, "train.batch_size=16", "train.dtype=bf16", "parallel.dp_shard=2", "parallel.tp=2"]
    script = tmp_path / "worker.py"
    script.write_text(f"OUT = {str(tmp_path)!r}\n" + WORKER)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4", str(script), *overrides]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env, timeout=600, cwd=REPO)
    peaks = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("peak*.json"))]
    assert proc.returncode == 0 and len(peaks) == 4, proc.stderr[-3000:]
    fake = measure_layout(load_config(None, overrides), 4, steps=1).peak
    assert max(peaks) == pytest.approx(fake, rel=0.01)
