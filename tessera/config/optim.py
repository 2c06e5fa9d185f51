"""[optim]: the optimizer, its state precision, QK-clip and the LR schedule; [optim.muon]: Muon's own keys."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class MuonConfig:
    """[optim.muon]: the Muon update of the hidden matrices (with optim.name='muon')."""

    lr: float = 0.0  # peak learning rate of the Muon matrices; 0 = optim.lr (fits scale=rms)
    momentum: float = 0.95  # momentum of the Muon matrices
    nesterov: bool = True  # Nesterov momentum
    ns_steps: int = 5  # Newton-Schulz iterations per update
    ns_dtype: Literal["bf16", "fp32"] = "bf16"  # precision of the Newton-Schulz iteration
    scale: Literal["rms", "spectral"] = "rms"  # update x 0.2*sqrt(max(out,in)) (rms) or sqrt(max(1,out/in))


@dataclass
class OptimConfig:
    """The optimizer (AdamW, or Muon with AdamW for the rest), its state precision, QK-clip, the schedule."""

    name: Literal["adamw", "muon"] = "adamw"  # muon: Muon on hidden matrices, AdamW on embeddings/head/norms/biases
    lr: float = 3e-4  # peak learning rate, reached after warmup_steps (with muon: the AdamW parameters')
    min_lr_ratio: float = 0.1  # the schedule's floor as a fraction of lr
    weight_decay: float = 0.1  # decoupled weight decay (Muon matrices too); none on norms, biases, embeddings
    beta1: float = 0.9  # AdamW first-moment decay
    beta2: float = 0.95  # AdamW second-moment decay
    eps: float = 1e-8  # AdamW denominator epsilon
    schedule: Literal["cosine", "linear", "constant", "wsd"] = "cosine"  # decay after warmup; wsd: warmup-stable-decay
    warmup_steps: int = 100  # linear warmup from 0 to lr
    decay_fraction: float = 0.2  # wsd: the final fraction of steps that decays
    grad_clip: float = 1.0  # global-norm clipping; 0 disables
    muon: MuonConfig = field(default_factory=MuonConfig)
    state_dtype: Literal["fp32", "bf16"] = "fp32"  # precision of the optimizer state (Adam moments, Muon momentum)
    implementation: Literal["auto", "fused", "foreach", "for-loop"] = "auto"  # AdamW kernel; auto: fused (CPU, CUDA)
    qk_clip_threshold: float = 0.0  # QK-clip: shrink q/k weights of heads whose max attention logit exceeds it; 0 off
