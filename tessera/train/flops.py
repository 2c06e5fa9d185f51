"""Model FLOPs per token and the peak FLOP/s of a device, for MFU.

FLOPs per token follow PaLM (appendix B): 6 * N + 12 * L * H * Q * T, where N counts the
parameters that take part in matmuls (everything but the token-embedding lookup), L layers,
H heads of size Q, and T the sequence length (the attention score and value products).
"""

from __future__ import annotations

import time

import torch

from tessera.config import ModelConfig

# Dense bf16 tensor-core peaks (FLOP/s) of common accelerators, by a substring of the device name.
GPU_PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12, "4090": 165e12, "V100": 125e12}


def flops_per_token(matmul_params: int, cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs (forward + backward) per token."""
    return 6.0 * matmul_params + 12.0 * cfg.n_layers * cfg.dim * seq_len


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


def peak_flops(device: torch.device, configured: float = 0.0) -> float:
    """Peak FLOP/s per device: the configured value, a known GPU's bf16 peak, or a CPU probe."""
    if configured > 0:
        return configured
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, value in GPU_PEAK_BF16.items():
            if key in name:
                return value
        return 0.0  # unknown GPU: MFU is reported as 0 until log.peak_flops is set
    return measure_cpu_peak_flops()
