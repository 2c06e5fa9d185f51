"""Model FLOPs per token and the peak FLOP/s of a device, for MFU.

FLOPs per token are counted from the modules that run (tessera/train/flop_count.py, checked against
torch's FlopCounterMode): active experts only, causal attention over the keys each query sees, MLA,
Mamba, linear attention, MTP and the head. MFU uses model FLOPs; hardware FLOPs add what activation
checkpointing recomputes and what masked kernels compute anyway.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

import torch

from tessera.config import ModelConfig
from tessera.train.flop_count import count_config, per_token
from tessera.threads import machine_busy

# Dense bf16 tensor-core peaks (FLOP/s) of common accelerators, by a substring of the device name.
GPU_PEAK_BF16 = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "A10G": 125e12,
    "4090": 165e12,
    "V100": 125e12,
}


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Model training FLOPs (forward + backward) per trained token, MFU's numerator."""
    return per_token(count_config(cfg, seq_len).model_training, seq_len)


def hardware_flops_per_token(cfg: ModelConfig, seq_len: int, checkpoint: str = "none", every: int = 2) -> float:
    """What the kernels execute per trained token, with activation checkpointing's recompute (HFU's numerator)."""
    return per_token(count_config(cfg, seq_len, checkpoint, every).hardware_training, seq_len)


def measure_cpu_peak_flops(size: int = 1024, repeats: int = 20) -> float:
    """Best achieved FLOP/s of an fp32 square matmul on this CPU with the current threads.

    The best of many short trials, so a neighbour briefly busy on the same cores lowers it
    less; a CPU shared with other work can still make the reported MFU exceed what it is.
    """
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b  # warm up the kernels and the thread pool
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2.0 * size**3 / best


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else the platform's processor string."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _read_cache(path: Path) -> dict[str, float]:
    try:
        cache = json.loads(path.read_text()) if path.is_file() else {}
    except ValueError:
        return {}
    return cache if isinstance(cache, dict) else {}


def cached_cpu_peak_flops(cache_dir: Path | None, local_processes: int = 1) -> tuple[float, str]:
    """This machine's measured CPU peak per process and where it came from.

    The probe runs once per CPU model, thread count, processes per node and torch version and is
    kept in ``cache_dir/cpu_peak.json``: one noisy measurement no longer moves every run's MFU.
    A probe taken while other work loads the machine is used but not kept, so a busy moment is
    not remembered. (Under torchrun the local processes probe at about the same time, sharing
    the cores as they will while training.) Delete the file to measure again.
    """
    key = f"{cpu_name()} | {torch.get_num_threads()} threads x {local_processes} processes | torch {torch.__version__}"
    path = cache_dir / "cpu_peak.json" if cache_dir is not None else None
    cache = _read_cache(path) if path is not None else {}
    if isinstance(cache.get(key), (int, float)) and cache[key] > 0:
        return float(cache[key]), f"cached in {path}"
    busy = machine_busy(peers=local_processes - 1)  # before the probe, beside the peers probing with it
    peak = measure_cpu_peak_flops()
    if path is None or busy is not None:
        busy_note = f" on a busy machine ({busy:.1f} cores of other work), not cached" if busy is not None else ""
        return peak, "measured" + busy_note
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps({**cache, key: peak}, indent=1))
    os.replace(tmp, path)
    return peak, f"measured, cached in {path}"


def peak_flops(
    device: torch.device, configured: float = 0.0, cache_dir: Path | None = None, local_processes: int = 1
) -> tuple[float, str]:
    """Peak FLOP/s per device and its source: log.peak_flops, a known GPU's bf16 peak, or the cached CPU probe."""
    if configured > 0:
        return configured, "log.peak_flops"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, value in GPU_PEAK_BF16.items():
            if key in name:
                return value, f"{key} bf16 peak"
        return 0.0, f"unknown GPU {name!r}: set log.peak_flops"  # MFU is reported as 0 until it is set
    return cached_cpu_peak_flops(cache_dir, local_processes)
