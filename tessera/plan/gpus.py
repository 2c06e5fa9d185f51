"""The GPU catalog: peak bf16 FLOP/s, memory, links, and the calibrated achievable efficiency.

Peaks are the vendors' dense (no sparsity) bf16 tensor-core figures, and their fp32 CUDA-core
figures for ``train.dtype = "fp32"`` (tessera leaves TF32 off, so fp32 matmuls run at that rate); memory is what
``nvidia-smi`` reports as total; ``nvlink`` is the per-GPU unidirectional NVLink bandwidth;
``network`` the per-GPU inter-node bandwidth of the usual HGX/DGX build (one NIC per GPU:
200 Gb/s HDR InfiniBand on A100 systems, 400 Gb/s NDR on H100/H200/B200).

``efficiency`` is the fraction of peak that the model's matmuls achieve on that GPU. It is the
one fitted number per GPU kind (not per run): the A100 value is fitted to Narayanan et al. 2021
(Table 1) and Korthikanti et al. 2022, the H100 value to the Llama 3 paper (Table 4); see
``tests/unit/plan/test_plan_published.py``, which refits them and checks the catalog holds the fit. H200
shares H100's SMs and uses its value; B200 has no published run here and borrows H100's value
(marked ``calibrated=False``).
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera.config import ConfigError

GIB = 2**30


@dataclass(frozen=True)
class GPU:
    """One accelerator kind as the planner sees it."""

    name: str
    peak_flops: float  # dense bf16 FLOP/s
    memory: float  # bytes
    hbm_bandwidth: float  # bytes/s
    nvlink: float  # bytes/s per GPU, one direction
    network: float  # bytes/s per GPU between nodes, one direction
    efficiency: float  # achievable fraction of peak on the model's matmuls (calibrated)
    fp32_flops: float = 0.0  # dense fp32 FLOP/s without tensor cores: tessera's fp32 runs (TF32 stays off)
    calibrated: bool = True
    gpus_per_node: int = 8


# Achieved fraction of link bandwidth by NCCL ring collectives (bus bandwidth / nominal); stated, not fitted.
LINK_EFFICIENCY = 0.8
# Per-collective start-up latency (seconds), inside a node and across nodes.
LATENCY_NVLINK, LATENCY_NETWORK = 10e-6, 30e-6
# What a CUDA process holds beyond its tensors: context, cuBLAS workspaces, NCCL communicators.
RUNTIME_OVERHEAD = 2.0 * GIB
# The caching allocator's reserve over live tensor bytes (fragmentation), as a fraction.
ALLOCATOR_SLACK = 0.05

A100_EFFICIENCY = 0.665
H100_EFFICIENCY = 0.68

CATALOG: dict[str, GPU] = {
    "a100-40gb": GPU("A100-40GB", 312e12, 40 * GIB, 1.555e12, 300e9, 25e9, A100_EFFICIENCY, 19.5e12),
    "a100-80gb": GPU("A100-80GB", 312e12, 80 * GIB, 2.039e12, 300e9, 25e9, A100_EFFICIENCY, 19.5e12),
    "h100-80gb": GPU("H100-80GB", 989e12, 79.6 * GIB, 3.35e12, 450e9, 50e9, H100_EFFICIENCY, 67e12),
    "h200-141gb": GPU("H200-141GB", 989e12, 140.4 * GIB, 4.8e12, 450e9, 50e9, H100_EFFICIENCY, 67e12),
    "b200": GPU("B200", 2250e12, 179 * GIB, 8.0e12, 900e9, 50e9, H100_EFFICIENCY, 80e12, calibrated=False),
}


def gpu(name: str) -> GPU:
    """The catalog entry for ``name`` (e.g. ``h100-80gb``; case and a missing suffix are forgiven)."""
    key = name.lower().strip()
    if key in CATALOG:
        return CATALOG[key]
    matches = [k for k in CATALOG if k.startswith(key)]
    if len(matches) == 1:
        return CATALOG[matches[0]]
    raise ConfigError(f"unknown GPU '{name}'; use one of {', '.join(CATALOG)}")


def catalog_kind(device_name: str, memory_bytes: float) -> str:
    """The catalog key of a GPU reported as ``device_name`` with ``memory_bytes`` of memory, or "" if none matches.

    Matches the model in the name (``NVIDIA H100 80GB HBM3`` -> H100) and picks the catalog entry of that model
    whose memory is closest, so an A100 40 GB and an 80 GB part resolve to their own entries.
    """
    name = device_name.upper().replace(" ", "")
    same_model = [k for k, g in CATALOG.items() if g.name.split("-")[0] in name]
    if not same_model:
        return ""
    return min(same_model, key=lambda k: abs(CATALOG[k].memory - memory_bytes))


def local_gpu_kind() -> str:
    """The catalog key of this machine's first CUDA GPU, "" without CUDA or for a GPU the catalog lacks."""
    import torch

    if not torch.cuda.is_available():
        return ""
    props = torch.cuda.get_device_properties(0)
    return catalog_kind(props.name, props.total_memory)
